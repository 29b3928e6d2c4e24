"""mHC pre (dsv4_kernels.triton_mhc.hc_pre with the block's input norm fused) at V4-Flash widths, by token count,
on its three paths (CUDA only; a script, not a test): "split" (mix kernel + (T, D blocks) pre kernel + norm, the
path of steps up to split_max_tokens), and the two long paths after torch's fp32 matmul (cuBLAS) for the logits:
"rows" (dsv4_kernels/triton_mhc_rows.py: a whole-row collapse a token with its sum of squares and the norm fused,
then the weights of token blocks) and "token" (one pre program a token, reading its streams three times); and
the logits matmul alone. Small steps are host-bound here (three launches; serving runs them under CUDA graphs).

Shapes: hc 4 streams x 4096, 24 mixing logits, 20 Sinkhorn iterations, streams in --dtype (fp32: the engine's
residual streams, $DSV4_FP32_RESIDUAL on by default). Prints the median time of each path
(triton.testing.do_bench), the bytes-read roof (the streams once, at the measured copy bandwidth) and the paths'
largest output difference from "token" (they round differently: fp32 sums in another order). --sweep also times
the rows path's collapse at 4, 8 and 16 warps (ROW_ELEMS_PER_WARP) from 1024 tokens. --graph-small times the split
path at decode sizes (1, 4, 8, 64 tokens) in CUDA-graph replays (no host launch cost, as decode runs it) by
MIX_PROGRAMS (the split-K width), MIX_GEMV_MAX_TOKENS and PRE_SPLITS_PER_LOAD.

Usage: dsv4 bench kernels mhc [--tokens 1 64 256 1024 4096 8192] [--dtype float32|bfloat16] [--out FILE]
                                   [--sweep]
       dsv4 bench kernels mhc --merge FP32_TABLE BF16_TABLE   # --out files -> BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from benchmarks.timing import bench, bench_cudagraph, copy_gbps

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


PATHS = ("split", "rows", "token")  # the split kernels; the long path "rows" (default); the long path "token"


def run(path: str, args, row_elems_per_warp: int | None = None):
    from dsv4_kernels import triton_mhc, triton_mhc_mix, triton_mhc_rows

    saved = (
        triton_mhc_mix.MIX_MAX_TOKENS,
        triton_mhc_mix.MIX_MAX_TOKENS_BF16,
        triton_mhc.LONG_PATH,
        triton_mhc_rows.ROW_ELEMS_PER_WARP,
    )
    triton_mhc_mix.MIX_MAX_TOKENS = triton_mhc_mix.MIX_MAX_TOKENS_BF16 = 1 << 30 if path == "split" else 0
    triton_mhc.LONG_PATH = "token" if path == "token" else "rows"
    triton_mhc_rows.ROW_ELEMS_PER_WARP = row_elems_per_warp or triton_mhc_rows.ROW_ELEMS_PER_WARP
    try:
        streams, fn, base, scale, norm_w = args
        return triton_mhc.hc_pre(streams, fn, base, scale, ITERS, 1e-6, 1e-6, norm_weight=norm_w)
    finally:
        (
            triton_mhc_mix.MIX_MAX_TOKENS,
            triton_mhc_mix.MIX_MAX_TOKENS_BF16,
            triton_mhc.LONG_PATH,
            triton_mhc_rows.ROW_ELEMS_PER_WARP,
        ) = saved


def bench_ms(fn) -> float:
    """Median milliseconds (benchmarks.timing.bench, a flushed L2; this op's tables are in ms-derived us)."""
    return bench(fn, rep=100) / 1e3


def graph_small(dev, dtype: torch.dtype) -> None:
    """The split path at decode sizes, CUDA-graph replays, by MIX_PROGRAMS, the mix kernel (16-row dot tiles or
    one token a program: MIX_GEMV_MAX_TOKENS) and the pre kernel's splits a load (PRE_SPLITS_PER_LOAD); outputs
    checked against the defaults'."""
    from dsv4_kernels import triton_mhc, triton_mhc_mix

    knobs = ("MIX_PROGRAMS", "MIX_GEMV_MAX_TOKENS", "PRE_SPLITS_PER_LOAD")
    home = {"MIX_PROGRAMS": triton_mhc_mix, "MIX_GEMV_MAX_TOKENS": triton_mhc_mix, "PRE_SPLITS_PER_LOAD": triton_mhc}
    saved = {k: getattr(home[k], k) for k in knobs}
    try:
        for t in (1, 4, 8, 64):
            x = inputs(t, dev, dtype, seed=t)
            want = run("split", x)
            for programs in (64, 128, 256):
                for gemv in (0, 16):
                    for per_load in (32, 128):
                        for k, v in zip(knobs, (programs, gemv, per_load)):
                            setattr(home[k], k, v)
                        diff = max((u.float() - v.float()).abs().max().item() for u, v in zip(run("split", x), want))
                        us = bench_cudagraph(lambda: run("split", x), rep=50)
                        print(
                            f"  graph T={t} MIX_PROGRAMS={programs} MIX_GEMV_MAX_TOKENS={gemv} "
                            f"PRE_SPLITS_PER_LOAD={per_load}: {us:.1f} us, max |diff| vs default {diff:.1e}",
                            flush=True,
                        )
    finally:
        for k, v in saved.items():
            setattr(home[k], k, v)


def section(tables: list[str]) -> str:
    """The BENCHMARKS.md section from --out tables (each starts with its command line, which names the dtype)."""
    return "\n".join(
        [
            "## mHC pre: split kernels vs the long path (`dsv4 bench kernels mhc`)",
            "",
            "`dsv4_kernels.triton_mhc.hc_pre` at V4-Flash widths (4 streams x 4096, 24 mixing logits, 20 Sinkhorn "
            "iterations, the block's input norm fused) by token count, host launch included (small steps are "
            'host-bound here; decode runs them under CUDA graphs). "split": the mix kernel + the (T, D blocks) pre '
            "kernel, its mix on tensor cores from MIX_TENSOR_CORE_MIN_TOKENS tokens (bf16 streams: three bf16 dots "
            "on fn's hi / mid / lo parts; fp32 streams, in runs before 2026-12-04 01:00 UTC: six, x split the same "
            'way); "split, FMA dot": the same on fp32 FMAs; "long" (runs before 2026-12-04 13:00 UTC) and '
            '"long, token": torch\'s fp32 matmul + one pre program a token; "long, rows": torch\'s fp32 matmul + a '
            "whole-row collapse a token (sum of squares and norm fused) + the weights of 64-token blocks "
            "(dsv4_kernels/triton_mhc_rows.py; in a 09:34 UTC run the rows path took its logits from a split-K TF32x3 "
            'mix kernel instead: 2.6 ms a call at 8K tokens, the mix alone 2.4 ms); "(logits matmul)": the cuBLAS '
            "matmul both long paths start with. Newest run first.",
            "",
            *[t.strip() + "\n" for t in tables],
            "The rule taken from these (`triton_mhc_mix.split_max_tokens`): fp32 streams, the engine's residual, take "
            "the split kernels up to 256 tokens and the long path above (cuBLAS reads fp32 as stored; the six-dot "
            "kernel was 3x slower than it at 8K and is gone), there the rows kernels (`triton_mhc.LONG_PATH`, "
            "0.44 against 0.77 ms a call at 8K tokens: 0.28 of it the matmul, the rest 1.3x the streams' read); bf16 "
            "streams take the split kernels at every size (no fp32 copy). `$DSV4_HC_SPLIT_MAX_TOKENS` / "
            "`$DSV4_HC_SPLIT_MAX_TOKENS_BF16` / `$DSV4_HC_LONG_PATH` override.",
            "",
            "Decode sizes under CUDA graphs (`--graph-small`, fp32 streams, 2026-12-04 14:00 UTC): the split path "
            "takes 20.9 us a call at 1 token and 21.6 at 8 with 128 to 512 split-K programs (K caps the splits at "
            "128 there), 25.1 / 37.2 us with 64 / 32; at 64 tokens 39.4 us with 128 programs against 50.8 with 256 "
            "(fewer partials for the pre kernel to add) and 55.7 with 64: `triton_mhc_mix.MIX_PROGRAMS` is 128.",
            "",
            "Decode sizes again (`--graph-small`, 2026-12-04 16:52 UTC), by the mix kernel (16-row dot tiles, or "
            "one token a program as a matrix-vector product: `MIX_GEMV_MAX_TOKENS`) and the splits the pre kernel "
            "adds a load (`PRE_SPLITS_PER_LOAD`: each load one dependent global read, three per token), 128 "
            "programs: 1 token 21.1 us (dot tiles, 32 a load) -> 18.5 (128 a load) -> 11.1 (GEMV, 128 a load); 4 "
            "tokens 21.7 -> 13.2; 8 tokens 21.6 -> 16.4 (dot tiles with 128 a load 18.7); 64 tokens 39.1 -> 37.5 "
            "(128 a load; the GEMV is not used there). Defaults since: GEMV up to 8 tokens, 128 splits a load (the "
            "batch-1 decode step's mHC pre went from 148 to 74 us).",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4 bench kernels mhc", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024, 4096, 8192])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the streams' dtype")
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    ap.add_argument("--sweep", action="store_true", help="also time the rows path's sizes from 1024 tokens")
    ap.add_argument(
        "--graph-small", action="store_true", help="also time decode sizes under CUDA graphs by MIX_PROGRAMS"
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="put these --out tables (fp32 streams first) into BENCHMARKS.md's mHC section and exit",
    )
    args = ap.parse_args(argv)
    if args.merge:
        from service.benchmarks_md import write_section

        write_section("mhc_pre", section([Path(f).read_text() for f in args.merge]))
        print(f"merged {', '.join(args.merge)} into BENCHMARKS.md")
        return 0
    if not torch.cuda.is_available():
        print("dsv4 bench kernels mhc: needs a CUDA GPU", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    gbps = copy_gbps(dev)
    rows = []
    for t in args.tokens:
        x = inputs(t, dev, getattr(torch, args.dtype), seed=t)
        times = {p: bench_ms(lambda p=p: run(p, x)) for p in PATHS}
        outs = {p: run(p, x) for p in PATHS}
        streams, fn = x[0], x[1]
        logits_ms = bench_ms(lambda: streams.reshape(t, HC * D).float() @ fn.t())
        diff = {
            p: max((u.float() - v.float()).abs().max().item() for u, v in zip(outs[p], outs["token"]))
            for p in ("split", "rows")
        }
        roof_ms = t * HC * D * x[0].element_size() / gbps / 1e6
        rows.append((t, times["split"], times["rows"], times["token"], logits_ms, roof_ms, diff["split"], diff["rows"]))
        print(
            f"hc_pre T={t}: "
            + ", ".join(f"{p} {times[p] * 1e3:.1f} us" for p in PATHS)
            + f", logits matmul {logits_ms * 1e3:.1f} us, roof {roof_ms * 1e3:.1f} us, max |diff| vs token: "
            f"split {diff['split']:.2e}, rows {diff['rows']:.2e}",
            flush=True,
        )
        if args.sweep and t >= 1024:  # the rows path's collapse: 16, 8, 4 warps at V4-Flash widths
            for epw in (1024, 2048, 4096):
                ms = bench_ms(lambda: run("rows", x, epw))
                print(f"  sweep T={t} ROW_ELEMS_PER_WARP={epw}: {ms * 1e3:.1f} us", flush=True)
    if args.graph_small:
        graph_small(dev, getattr(torch, args.dtype))
    tokens = " ".join(map(str, args.tokens))
    lines = [
        f"- command: `dsv4 bench kernels mhc --tokens {tokens} --dtype {args.dtype}`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {gbps:.0f} GB/s",
        "",
        "| tokens | split us | long, rows us | long, token us | (logits matmul us) | streams-read roof us "
        "| best x roof | max abs diff vs token: split | rows |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {t} | {s * 1e3:.1f} | {r * 1e3:.1f} | {c * 1e3:.1f} | {lg * 1e3:.1f} | {f * 1e3:.1f} "
        f"| {min(s, r, c) / f:.1f} | {ds:.1e} | {dr:.1e} |"
        for t, s, r, c, lg, f, ds, dr in rows
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
