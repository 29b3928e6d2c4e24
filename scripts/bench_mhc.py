"""mHC pre (dsv4_kernels.triton_mhc.hc_pre with the block's input norm fused) at V4-Flash widths: the split path (mix
kernel + (T, D blocks) pre kernel + norm; for bf16 streams its mix dot on tensor cores from
MIX_TENSOR_CORE_MIN_TOKENS, and on fp32 FMAs at every size) against the long path (torch's fp32 matmul on an fp32
copy of the streams + one pre program a token), by token count (CUDA only; a script, not a test). Small steps are
host-bound here (three launches; serving runs them under CUDA graphs).

Shapes: hc 4 streams x 4096, 24 mixing logits, 20 Sinkhorn iterations, streams in --dtype (fp32: the engine's
residual streams, $DSV4_FP32_RESIDUAL on by default). Prints the median time of each path
(triton.testing.do_bench), the bytes-read roof (the streams once, at the measured copy bandwidth) and the two
paths' largest output difference (they round differently: fp32 sums in another order).

Usage: python scripts/bench_mhc.py [--tokens 1 64 256 1024 4096 8192] [--dtype float32|bfloat16] [--out FILE]
       python scripts/bench_mhc.py --merge FP32_TABLE BF16_TABLE   # --out files -> BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HC, D, ITERS = 4, 4096, 20


def inputs(t: int, device, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    n_mix = (2 + HC) * HC
    streams = torch.randn(t, HC, D, generator=g, device=device).to(dtype)
    fn = torch.randn(n_mix, HC * D, generator=g, device=device) * (HC * D) ** -0.5
    base = torch.randn(n_mix, generator=g, device=device) * 0.1
    scale = torch.rand(3, generator=g, device=device) + 0.5
    norm_w = torch.rand(D, generator=g, device=device) + 0.5
    return streams, fn, base, scale, norm_w


PATHS = ("split", "split fma", "long")  # the default; its mix on fp32 FMAs at every size; the long path


def run(path: str, args):
    from dsv4_kernels import triton_mhc

    saved = triton_mhc.MIX_MAX_TOKENS, triton_mhc.MIX_MAX_TOKENS_BF16, triton_mhc.MIX_TENSOR_CORE_MIN_TOKENS
    triton_mhc.MIX_MAX_TOKENS = triton_mhc.MIX_MAX_TOKENS_BF16 = 0 if path == "long" else 1 << 30
    if path == "split fma":
        triton_mhc.MIX_TENSOR_CORE_MIN_TOKENS = 1 << 30
    try:
        streams, fn, base, scale, norm_w = args
        return triton_mhc.hc_pre(streams, fn, base, scale, ITERS, 1e-6, 1e-6, norm_weight=norm_w)
    finally:
        triton_mhc.MIX_MAX_TOKENS, triton_mhc.MIX_MAX_TOKENS_BF16, triton_mhc.MIX_TENSOR_CORE_MIN_TOKENS = saved


def copy_gbps(device) -> float:
    from triton.testing import do_bench

    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() / ms / 1e6


def section(tables: list[str]) -> str:
    """The BENCHMARKS.md section from --out tables (each starts with its command line, which names the dtype)."""
    return "\n".join([
        "## mHC pre: split kernels vs the long path (`scripts/bench_mhc.py`)", "",
        "`dsv4_kernels.triton_mhc.hc_pre` at V4-Flash widths (4 streams x 4096, 24 mixing logits, 20 Sinkhorn "
        "iterations, the block's input norm fused) by token count, host launch included (small steps are "
        "host-bound here; decode runs them under CUDA graphs). \"split\": the mix kernel + the (T, D blocks) pre "
        "kernel, its mix on tensor cores from MIX_TENSOR_CORE_MIN_TOKENS tokens (bf16 streams: three bf16 dots "
        "on fn's hi / mid / lo parts; fp32 streams, in runs before 2026-12-04 01:00 UTC: six, x split the same "
        "way); \"split, FMA dot\": the same on fp32 FMAs; \"long\": torch's fp32 matmul + one pre program a "
        "token.", "",
        *[t.strip() + "\n" for t in tables],
        "The rule taken from these (`triton_mhc.split_max_tokens`): fp32 streams, the engine's residual, take "
        "the split kernels up to 256 tokens and the long path above (cuBLAS reads fp32 as stored; the six-dot "
        "kernel was 3x slower than it at 8K and is gone); bf16 streams take the split kernels at every size "
        "(no fp32 copy). `$DSV4_HC_SPLIT_MAX_TOKENS` / `$DSV4_HC_SPLIT_MAX_TOKENS_BF16` override."])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024, 4096, 8192])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the streams' dtype")
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="put these --out tables (fp32 streams first) into BENCHMARKS.md's mHC section and exit")
    args = ap.parse_args()
    if args.merge:
        from service.benchmarks_md import write_section

        write_section("mhc_pre", section([Path(f).read_text() for f in args.merge]))
        print(f"merged {', '.join(args.merge)} into BENCHMARKS.md")
        return 0
    if not torch.cuda.is_available():
        print("bench_mhc: needs a CUDA GPU")
        return 1
    from triton.testing import do_bench

    dev = torch.device("cuda")
    gbps = copy_gbps(dev)
    rows = []
    for t in args.tokens:
        x = inputs(t, dev, getattr(torch, args.dtype), seed=t)
        times = {p: do_bench(lambda p=p: run(p, x), warmup=10, rep=100) for p in PATHS}
        a, b = run("split", x), run("long", x)
        diff = max((u.float() - v.float()).abs().max().item() for u, v in zip(a, b))
        roof_ms = t * HC * D * 2 / gbps / 1e6
        rows.append((t, times["split"], times["split fma"], times["long"], roof_ms, diff))
        print(f"hc_pre T={t}: " + ", ".join(f"{p} {times[p] * 1e3:.1f} us" for p in PATHS)
              + f", roof {roof_ms * 1e3:.1f} us, max |diff| split vs long {diff:.2e}", flush=True)
    tokens = " ".join(map(str, args.tokens))
    lines = [f"- command: `python scripts/bench_mhc.py --tokens {tokens} --dtype {args.dtype}`",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {gbps:.0f} GB/s",
             "", "| tokens | split path us | split, FMA dot us | long path us | long / split | streams-read roof us "
             "| split x roof | max abs diff split vs long |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {t} | {s * 1e3:.1f} | {f * 1e3:.1f} | {lg * 1e3:.1f} | {lg / s:.2f} | {r * 1e3:.1f} | {s / r:.1f} "
              f"| {d:.1e} |" for t, s, f, lg, r, d in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
