"""The attention output's inverse RoPE in place (dsv4_kernels.triton_norm_rope.rope, inplace=True) by rows a
program and warps, at V4-Flash shapes: a prefill chunk (8192 tokens x 64 heads x 512, 64 rope channels) and decode
(1 and 64 tokens). Why: the 8K slice prefill's profile gave the kernel 0.5-0.6 ms a layer (H100 and H200), ~10x the
time its bytes need (a read and a write of the 64 rope channels: 67 MB at 8K tokens); its default of 128 rows a
program was set from a run that timed 0.25 ms.

Both in-place kernels are swept: the strided one (even / odd channels loaded apart) and `pairs` (the rope channels
as one contiguous tile, split in registers). Each config's output must equal the default's bit for bit. Times: CUDA-graph replays
(benchmarks.timing.bench_cudagraph), so launch cost is out. A script, not a test (CUDA only).
Usage: dsv4 bench kernels rope [--tokens 8192 64 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.timing import bench_cudagraph

HEADS, DIM, ROPE = 64, 512, 64
TOKENS = (8192, 64, 1)
BLOCKS = (8, 32, 64, 128, 256)
WARPS = (2, 4, 8)


def problem(tokens: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(tokens)
    x = torch.randn(tokens, HEADS, DIM, generator=g, device=dev).to(torch.bfloat16)
    ang = torch.rand(tokens, ROPE // 2, generator=g, device=dev) * 6.28
    return x, ang.cos(), ang.sin()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4 bench kernels rope", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[8192], help=f"token counts (default 8192; decode: {TOKENS[1:]})"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dsv4 bench kernels rope: needs a CUDA GPU", file=sys.stderr)
        return 1
    from dsv4_kernels.triton_norm_rope import rope

    dev = torch.device("cuda")
    lines = [
        f"{torch.cuda.get_device_name()}: inverse RoPE in place, {HEADS} heads x {DIM}, {ROPE} rope channels",
        "",
        "| tokens | kernel | rows a program | warps | us | GB/s (rope channels read + written) | same as default |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    ok = True
    for t in args.tokens:
        x, cos, sin = problem(t, dev)
        want = rope(x.clone(), cos, sin, inverse=True, inplace=True)
        nbytes = 2 * t * HEADS * ROPE * x.element_size()
        for pairs in (False, True):
            for block in BLOCKS:
                for warps in WARPS:
                    kw = dict(inverse=True, inplace=True, block_r=block, num_warps=warps, pairs=pairs)
                    got = rope(x.clone(), cos, sin, **kw)
                    same = torch.equal(got, want)
                    ok &= same
                    buf = x.clone()
                    us = bench_cudagraph(lambda: rope(buf, cos, sin, **kw), rep=20)  # noqa: B023 (timed at once)
                    kernel = "pairs" if pairs else "strided"
                    lines.append(
                        f"| {t} | {kernel} | {block} | {warps} | {us:.1f} | {nbytes / us / 1e3:.0f} | {same} |"
                    )
                    print(lines[-1], flush=True)
        buf = x.clone()
        us = bench_cudagraph(lambda: rope(buf, cos, sin, inverse=True, inplace=True), rep=20)
        lines.append(f"| {t} | default | default | 4 | {us:.1f} | {nbytes / us / 1e3:.0f} | True |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
