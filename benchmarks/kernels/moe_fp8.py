"""Routed experts for prefill: FP8 experts through DeepGEMM's contiguous grouped GEMM vs bf16 x MXFP4 through
triton_kernels, at V4-Flash shapes (256 experts top-6, 4096 -> 2 x 2048 gate/up, 2048 -> 4096 down; one H200).

For each token count (default 2048 and 8192) it times, under a CUDA graph after an L2 flush (device time):
- `fp8 GEMMs exact` / `fp8 GEMMs bound`: the two `m_grouped_fp8_gemm_nt_contiguous` calls alone on the padded,
  quantised rows of the exact layout (what an eager prefill step runs) and of the sync-free bound (under capture);
- `fp8 MoE bound`: the whole dsv4_kernels.deepgemm_moe.deepgemm_moe (layout, 1x128 quantiser, gather, GEMMs, SwiGLU
  + quantiser, gathered k-way sum) captured, so on the bound layout;
- `fp8 MoE exact`: the same call eager (its exact layout's host sync inside), median wall time after an L2 flush
  (triton's do_bench: host gaps included, unlike the graph rows);
- `mxfp4 MoE`: dsv4_kernels.mxfp4_ogs.ogs_moe on the same experts in MXFP4 (what the engine runs today).
Reported: microseconds, TFLOP/s over the useful FLOPs (2 x pairs x (H x 2I + I x H); padding rows not counted) and
% of the FP8 roof measured in the same run (`deep_gemm.fp8_gemm_nt` at 8192^3), and the FP8 MoE's relative error
against dsv4_kernels.fp8_experts.fp8_moe_ref on 256 tokens.

Usage: dsv4 bench kernels moe-fp8-grouped [--tokens 2048 8192] [--experts 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.timing import bench
from benchmarks.timing import try_bench_graph as bench_graph

H, INTER, TOP_K = 4096, 2048, 6


def fp8_roof_tflops(n: int = 8192) -> float:
    """DeepGEMM's dense FP8 GEMM rate at n^3 (the FP8 roof of this run)."""
    from dsv4_kernels.gpu import import_deep_gemm
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128

    dg = import_deep_gemm()
    w = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    ws = torch.ones(n // 128, n // 128, device="cuda")
    xq, xs = quant_act_1x128(torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    dg.fp8_gemm_nt((xq, xs), (w, ws), out)
    return 2 * n**3 / bench_graph(lambda: dg.fp8_gemm_nt((xq, xs), (w, ws), out)) / 1e6


def _experts(e: int, gen: torch.Generator):
    packed = {}
    for name, (n, k) in (("w1", (INTER, H)), ("w3", (INTER, H)), ("w2", (H, INTER))):
        packed[name] = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        packed["s" + name[1]] = torch.randint(
            119, 123, (e, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen
        )
    return packed


def measure(t: int, pk: dict, ex, ogs, e: int, roof: float, gen: torch.Generator) -> dict:
    from dsv4_kernels import deepgemm_moe, mxfp4_ogs

    x = torch.randn(t, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(TOP_K, dim=1).indices
    w = torch.rand(t, TOP_K, device="cuda", generator=gen)
    exact, bound = (_gemms(x, ids, ex, e, kind) for kind in (True, False))
    flops = 2 * t * TOP_K * (H * 2 * INTER + INTER * H)
    rows = {
        "tokens": t,
        "rows": {
            "fp8 GEMMs exact": exact[1],
            "fp8 GEMMs bound": bound[1],
            "fp8 MoE bound": bound[1],
            "fp8 MoE exact": exact[1],
            "mxfp4 MoE": t * TOP_K,
        },
    }
    for name, fn in (
        ("fp8 GEMMs exact", exact[0]),
        ("fp8 GEMMs bound", bound[0]),
        ("fp8 MoE bound", lambda: deepgemm_moe.deepgemm_moe(x, w, ids, ex, 10.0)),
        ("fp8 MoE exact", lambda: deepgemm_moe.deepgemm_moe(x, w, ids, ex, 10.0, exact=True)),
        ("mxfp4 MoE", lambda: mxfp4_ogs.ogs_moe(x, w, ids, ogs, 10.0)),
    ):
        fn()  # compile
        us = bench(fn) if name == "fp8 MoE exact" else bench_graph(fn)
        rows[name] = us
        if us:
            print(
                f"T={t:5d} {name:15s} {us:9.1f} us {flops / us / 1e6:7.0f} TFLOP/s {100 * flops / us / 1e6 / roof:5.1f}%"
                f" of the FP8 roof",
                flush=True,
            )
    rows["flops"] = flops
    return rows


def _gemms(x, ids, ex, e: int, exact: bool):
    """-> (the two grouped GEMMs on the layout's quantised rows, as one callable; the layout's row count)."""
    from dsv4_kernels import deepgemm_moe
    from dsv4_kernels.fp8_experts import contiguous_layout
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128

    lay = contiguous_layout(ids, e, deepgemm_moe.m_alignment(), exact=exact)
    xq, xs = deepgemm_moe._gather_rows(*quant_act_1x128(x, True), lay.src_token)  # noqa: SLF001 - timing the GEMMs
    aq, as_ = quant_act_1x128(torch.randn(lay.rows, INTER, device="cuda").to(torch.bfloat16), True)

    def gemms():
        deepgemm_moe.grouped_gemm(xq, xs, ex.w13, ex.s13, lay.m_indices)
        deepgemm_moe.grouped_gemm(aq, as_, ex.w2, ex.s2, lay.m_indices)

    return gemms, lay.rows


def table(results: list[dict], roof: float, err: float, command: str) -> str:
    lines = [
        "## Routed experts for prefill: FP8 grouped (DeepGEMM) vs MXFP4 (triton_kernels)",
        "",
        f"- command: `{command}`; {torch.cuda.get_device_name()}, torch {torch.__version__}",
        f"- FP8 roof measured here: `deep_gemm.fp8_gemm_nt` 8192^3 = {roof:.0f} TFLOP/s; device us in a CUDA "
        "graph after an L2 flush (`fp8 MoE exact`: eager wall us, its host sync included); TFLOP/s over the "
        "useful FLOPs (padding rows not counted); rows: the GEMMs' M (the pairs for MXFP4)",
        f"- FP8 MoE vs fp8_moe_ref (256 tokens): relative error {err:.1e}",
        "",
        "| tokens | rows | path | us | TFLOP/s | % of FP8 roof |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in results:
        for name, m in r["rows"].items():
            us = r[name]
            tf = r["flops"] / us / 1e6 if us else 0.0
            lines.append(f"| {r['tokens']} | {m} | {name} | {us or 0:.1f} | {tf:.0f} | {100 * tf / roof:.1f}% |")
    return "\n".join(lines)


def check_error(ex, e: int, gen: torch.Generator) -> float:
    from dsv4_kernels import deepgemm_moe
    from dsv4_kernels.fp8_experts import fp8_moe_ref

    x = torch.randn(256, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(256, e, device="cuda", generator=gen).topk(TOP_K, dim=1).indices
    w = torch.rand(256, TOP_K, device="cuda", generator=gen)
    got, want = deepgemm_moe.deepgemm_moe(x, w, ids, ex, 10.0), fp8_moe_ref(x, w, ids, ex, 10.0)
    return float((got.float() - want.float()).norm() / want.float().norm())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4 bench kernels moe-fp8-grouped", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--write", action="store_true", help="put the table into BENCHMARKS.md (section moe_fp8_grouped)")
    args = ap.parse_args(argv)
    from dsv4_kernels.gpu import has_deep_gemm, has_triton_kernels

    if not torch.cuda.is_available() or not has_deep_gemm() or not has_triton_kernels():
        print("needs a CUDA GPU with deep_gemm and triton_kernels", file=sys.stderr)
        return 1
    from dsv4_kernels import fp8_experts, mxfp4_fp8, mxfp4_ogs

    gen = torch.Generator(device="cuda").manual_seed(0)
    pk = _experts(args.experts, gen)
    report = mxfp4_fp8.ConversionReport()
    ex = fp8_experts.from_packed(pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"], report)
    print(report.describe(), flush=True)
    ogs = mxfp4_ogs.prepare(pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"])
    roof = fp8_roof_tflops()
    print(f"FP8 roof (fp8_gemm_nt 8192^3): {roof:.0f} TFLOP/s", flush=True)
    err = check_error(ex, args.experts, gen)
    results = [measure(t, pk, ex, ogs, args.experts, roof, gen) for t in args.tokens]
    md = table(results, roof, err, "dsv4 bench kernels moe-fp8-grouped " + " ".join(argv or sys.argv[1:]))
    print(md)
    if args.out:
        Path(args.out).write_text(md)
    if args.write:
        from service.benchmarks_md import write_section

        write_section("moe_fp8_grouped", md)
    return 0
