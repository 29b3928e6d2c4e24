"""Dense projections of V4-Flash in FP8 through DeepGEMM vs bf16 torch.mm (one H200; not a test).

For each projection shape (N x K of wq_a, wq_b, wkv, one of wo_a's 8 groups, wo_b, indexer wq_b,
shared-expert w1/w3 and w2) and token count M (default 1/64/128/8192) it times, under a CUDA graph
after an L2 flush (benchmarks.timing.bench_graph: device time, no launch overhead):
- `fp8`: dsv4_kernels.deepgemm_linear.fp8_gemm = Triton 1x128 activation quantiser + deep_gemm.fp8_gemm_nt;
- `bf16`: x @ W^T on the dequantised bf16 weight (what the engine ran before);
- `gemv` (M <= 8): the same quantiser + dsv4_kernels.triton_fp8_gemv.fp8_gemv (the few-token path,
  $DSV4_FP8_GEMV_MAX_TOKENS), with its error against the reference.
--gemv-sweep: the GEMV's tile bytes x warps at each shape and M, each output checked against the default's (within
1e-2: another order of the same sums); prints the best per shape and the best single configuration (what the module's
TILE / NUM_WARPS should be).
Reported: both times, the speed-up, TFLOP/s of the FP8 path, and its relative error ||fp8 - ref|| / ||ref||
against dsv4_kernels.fp8_linear.fp8_linear_ref (fp32, same quantised activations) and against the exact bf16 product.
Every shape is warmed (DeepGEMM JIT-compiles per shape) before timing.

Usage: dsv4 bench kernels fp8-gemm [--tokens 1 64 128 8192] [--out FILE] [--write] [--gemv-sweep]
--write puts the table into BENCHMARKS.md (section fp8_gemm, service/benchmarks_md.write_section); on the GPU
machine write --out instead and merge the file here with --merge FILE.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from benchmarks.timing import bench_graph
from dsv4_kernels import fp8_linear as ref
from dsv4_kernels.quant import quant_fp8_block

# name -> (N, K) of V4-Flash (hidden 4096, q_lora 1024, 64 heads x 512, o_groups 8 x o_lora 1024, moe 2048)
SHAPES = {
    "wq_a 4096->1024": (1024, 4096),
    "wq_b 1024->32768": (32768, 1024),
    "wkv 4096->512": (512, 4096),
    "wo_a group 4096->1024": (1024, 4096),
    "wo_b 8192->4096": (4096, 8192),
    "indexer wq_b 1024->8192": (8192, 1024),
    "shared w1/w3 4096->2048": (2048, 4096),
    "shared w2 2048->4096": (4096, 2048),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def measure(name: str, n: int, k: int, m: int, gen: torch.Generator) -> dict:
    from dsv4_kernels.deepgemm_linear import fp8_gemm

    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    fw = ref.weight_from_checkpoint(*quant_fp8_block(w, scale_fmt="ue8m0"))
    wb = fw.dequant(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    got = fp8_gemm(x, fw)  # compiles this shape
    want_ref = ref.fp8_linear_ref(x.float(), fw) if m * n <= (1 << 26) else None
    exact = x.float() @ wb.float().t()
    fp8_us = bench_graph(lambda: fp8_gemm(x, fw))
    bf16_us = bench_graph(lambda: x @ wb.t())
    gemv_us = gemv_err = None
    if m <= GEMV_MAX_M:
        gemv_us = bench_graph(lambda: gemv(x, fw))
        gemv_err = rel(gemv(x, fw), want_ref)
    return {
        "name": name,
        "m": m,
        "n": n,
        "k": k,
        "fp8_us": fp8_us,
        "bf16_us": bf16_us,
        "tflops": 2 * m * n * k / fp8_us / 1e6,
        "err_ref": rel(got, want_ref) if want_ref is not None else None,
        "err_exact": rel(got, exact),
        "bf16_err_exact": rel(x @ wb.t(), exact),
        "gemv_us": gemv_us,
        "gemv_err": gemv_err,
    }


GEMV_MAX_M = 8


def gemv(x: torch.Tensor, fw, tile: int | None = None, warps: int | None = None) -> torch.Tensor:
    """The few-token path: the engine's quantiser, then the Triton GEMV (not DeepGEMM)."""
    from dsv4_kernels import triton_fp8_gemv as G
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128

    xq, xs = quant_act_1x128(x, fw.pow2_act)
    out = torch.empty(x.shape[0], fw.shape[0], dtype=torch.bfloat16, device=x.device)
    return G.fp8_gemv(xq, xs, fw.weight, fw.scale, out, tile=tile or G.TILE, num_warps=warps or G.NUM_WARPS)


def gemv_sweep(tokens: list[int], gen: torch.Generator) -> str:
    """Tile bytes x warps of the GEMV at each shape and M <= GEMV_MAX_M -> a markdown table with the best per shape
    and the configuration whose summed time over the shapes is least."""
    from dsv4_kernels import triton_fp8_gemv as G

    tiles, warps = (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8)
    default = (G.TILE, G.NUM_WARPS)
    rows, totals = [], {}
    for m in [t for t in tokens if t <= GEMV_MAX_M]:
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
            fw = ref.weight_from_checkpoint(*quant_fp8_block(w, scale_fmt="ue8m0"))
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            base = gemv(x, fw)
            times = {}
            for tile in tiles:
                for nw in warps:
                    # other tiles / warps sum in another order: close, not bitwise
                    if rel(gemv(x, fw, tile, nw), base) > 1e-2:
                        raise AssertionError(f"gemv tile {tile} warps {nw} differs from the default at {name}, M={m}")
                    times[(tile, nw)] = bench_graph(lambda tile=tile, nw=nw: gemv(x, fw, tile, nw))
                    totals[(tile, nw)] = totals.get((tile, nw), 0.0) + times[(tile, nw)]
            best = min(times, key=times.__getitem__)
            rows.append(f"| {name} | {m} | {best[0]} | {best[1]} | {times[best]:.1f} | {times.get(default, 0.0):.1f} |")
            print(rows[-1], flush=True)
    top = min(totals, key=totals.__getitem__)
    return "\n".join(
        [f"| projection | M | best tile bytes | warps | us | default {default} us |", "|---|---:|---:|---:|---:|---:|"]
        + rows
        + [
            "",
            f"Best single configuration over the shapes: tile {top[0]}, {top[1]} warps ({totals[top]:.1f} us summed).",
        ]
    )


def table(rows: list[dict], command: str) -> str:
    dev = torch.cuda.get_device_name()
    lines = [
        "## FP8 dense GEMMs (DeepGEMM) vs bf16",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {dev}, torch {torch.__version__}",
        "- time: device us in a CUDA graph after an L2 flush (weights from HBM); fp8 = Triton 1x128 activation "
        "quantiser + `deep_gemm.fp8_gemm_nt` (bf16 out), bf16 = `x @ W^T` on the dequantised weight",
        "- err vs ref: ||fp8 - fp8_linear_ref|| / ||ref|| (same quantised activations, fp32); err vs exact: "
        "against x @ W^T in fp32 (what FP8 activations cost), bf16's own error beside it",
        "",
        "| projection | M | fp8 us | bf16 us | bf16 / fp8 | fp8 TFLOP/s | err vs ref | err vs exact (bf16's) "
        "| gemv us | gemv / fp8 | gemv err vs ref |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        err_ref = f"{r['err_ref']:.1e}" if r["err_ref"] is not None else "n/a"
        lines.append(
            f"| {r['name']} | {r['m']} | {r['fp8_us']:.1f} | {r['bf16_us']:.1f} | "
            f"{r['bf16_us'] / r['fp8_us']:.2f}x | {r['tflops']:.0f} | {err_ref} | "
            f"{r['err_exact']:.1e} ({r['bf16_err_exact']:.1e}) | "
            + (
                f"{r['gemv_us']:.1f} | {r['gemv_us'] / r['fp8_us']:.2f}x | {r['gemv_err']:.1e} |"
                if r["gemv_us"] is not None
                else "| | |"
            )
        )
    by_m: dict[int, list[float]] = {}
    for r in rows:
        by_m.setdefault(r["m"], []).append(r["bf16_us"] / r["fp8_us"])
    lines.append("")
    lines.append(
        "Speed-up of FP8 over bf16 by token count (geometric mean over the shapes): "
        + ", ".join(f"M={m}: {torch.tensor(v).log().mean().exp().item():.2f}x" for m, v in by_m.items())
        + "."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4 bench kernels fp8-gemm", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 128, 8192])
    ap.add_argument("--out", default=None)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--merge", default=None, help="put this section file into BENCHMARKS.md and exit")
    ap.add_argument("--gemv-sweep", action="store_true", help="sweep the FP8 GEMV's tiles and warps, then exit")
    args = ap.parse_args(argv)
    if args.merge:
        from service.benchmarks_md import write_section

        write_section("fp8_gemm", Path(args.merge).read_text())
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU with deep_gemm", file=sys.stderr)
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.gemv_sweep:
        md = gemv_sweep(args.tokens, gen)
        print(md)
        if args.out:
            Path(args.out).write_text(md)
        return 0
    rows = []
    for m in args.tokens:
        for name, (n, k) in SHAPES.items():
            rows.append(measure(name, n, k, m, gen))
            r = rows[-1]
            gv = f"  gemv {r['gemv_us']:8.1f} us" if r["gemv_us"] is not None else ""
            print(f"{name:28s} M={m:5d} fp8 {r['fp8_us']:8.1f} us  bf16 {r['bf16_us']:8.1f} us{gv}", flush=True)
    md = table(rows, "dsv4 bench kernels fp8-gemm " + " ".join(sys.argv[1:] if argv is None else argv))
    print(md)
    if args.out:
        Path(args.out).write_text(md)
    if args.write:
        from service.benchmarks_md import write_section

        write_section("fp8_gemm", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
