"""What programmatic dependent launch (PDL) saves between small Triton kernels replayed in a CUDA graph.

A chain of N dependent one-wave kernels (each reads the previous one's output: x -> x + 1 over 64K fp32, 64
programs, ~2 us of work, like the engine's decode glue kernels) is captured three ways and replayed:
- plain launches;
- launch_pdl=True, every kernel waiting on its predecessor (gdc_wait) before its loads;
- the same, and each kernel also lets its dependent launch early (gdc_launch_dependents right after its wait).
Prints us per kernel for each, and checks the chain's result (every element == N). GPU only (sm_90+).
Usage: python -m benchmarks.pdl_probe [--kernels 64] [--replays 200]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, WAIT: tl.constexpr, EARLY: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()  # the predecessor's writes are visible after this
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def _chain(bufs, kernels: int, mode: str) -> None:
    n = bufs[0].numel()
    block = 1024
    kw = {} if mode == "plain" else {"launch_pdl": True}
    for i in range(kernels):
        _step_kernel[(triton.cdiv(n, block),)](
            bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=block, WAIT=mode != "plain", EARLY=mode == "early", **kw
        )


def measure(kernels: int, replays: int, mode: str) -> tuple[float, bool]:
    bufs = [torch.zeros(1 << 16, device="cuda"), torch.zeros(1 << 16, device="cuda")]
    _chain(bufs, kernels, mode)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _chain(bufs, kernels, mode)
    bufs[0].zero_()
    graph.replay()
    torch.cuda.synchronize()
    ok = bool((bufs[kernels % 2] == kernels).all())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays / kernels, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=int, default=64)
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, {args.kernels} kernels a graph")
    print("| launches | us a kernel | result right |")
    print("|---|---:|---|")
    for mode in ("plain", "pdl", "early", "plain"):
        try:
            us, ok = measure(args.kernels, args.replays, mode)
            print(f"| {mode} | {us:.2f} | {ok} |")
        except Exception as e:  # a triton or driver without PDL: say so and go on
            print(f"| {mode} | failed: {type(e).__name__}: {str(e)[:200]} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
