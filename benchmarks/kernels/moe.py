"""Routed-expert MoE at V4-Flash shapes: the MXFP4 Triton kernel vs grouped_mm on bf16 vs the reference.

For each token count (default 1/16/64/128; hidden 4096, moe_inter 2048, 256 experts, top-6, bf16) it times
- `mxfp4 triton_kernels`: dsv4_kernels.mxfp4_ogs.ogs_moe, OpenAI's triton_kernels matmul on the same packed bytes
  moved into its Hopper layouts (sort + gate/up + SwiGLU + down + sum; when triton_kernels imports);
- `mxfp4 gemv`: dsv4_kernels.triton_mxfp4_gemv.gemv_moe, split-K GEMVs reading the same triton_kernels storage
  (tokens * top-k <= its MAX_ROUTES; gate|up + SwiGLU + down + sum; weight MB counts distinct experts, the
  GEMV reads a shared expert once a route);
- `mxfp4 marlin`: dsv4_kernels.marlin_moe.marlin_moe, Marlin's W4A16 grouped GEMM (vLLM's and SGLang's Hopper
  path) on the same bytes repacked into its tiles (route sort + gate/up + SwiGLU + down + sum; when its wheels,
  tools/device_wheels/marlin_wheel.py, are installed);
- `mxfp4`: dsv4_kernels.triton_moe.mxfp4_moe on packed e2m1 + UE8M0 experts (sort + gate/up + down + sum);
- `grouped_mm`: dsv4_kernels.moe.moe_experts_grouped on the same experts dequantised to bf16;
- `reference`: dsv4_kernels.moe.moe_experts (one matmul per used expert, host sync) on the bf16 experts;
- `route`: dsv4_kernels.triton_moe.route vs dsv4_kernels.moe.route (router matmul + scoring + top-k).
`us` is triton.testing.do_bench's median with the L2 flushed before every call (weights come from HBM;
includes Python launch overhead); `graph us` replays the wrapper in a CUDA graph, each call after an L2
flush whose own time is subtracted (n/a when the wrapper cannot be captured). Weight bytes are those of
the distinct experts the routing touches (3 matrices each: 0.5 + 1/32 bytes per MXFP4 element, 2 per
bf16 one); GB/s = bytes / time (the graph time where there is one), and % is that over a device-to-device
copy measured in the same run ((read + write) / time). `err` is max |out - grouped_mm| / max |grouped_mm|.

Usage: dsv4 bench kernels moe [--tokens 1 16 64 128] [--sweep] [--out FILE] [--merge FILE]
`--out` also writes the table as a BENCHMARKS.md section (with the aim line computed from the rows: the MXFP4
MoE at 64 tokens >= 60% of copy bandwidth); `--merge FILE` puts such a file into BENCHMARKS.md
(section mxfp4_moe) without running anything.
`--sweep` also times MXFP4 launch configurations per token count and prints the best ones (several
minutes: each configuration compiles).
`--gemv-sweep` runs only the GEMV's launch sweep (benchmarks/kernels/moe_gemv_sweep.py: staged, under
--gemv-budget-s, the best config per token count as JSON in --gemv-best-out, tables in --gemv-out).
Smoke test without a GPU: TRITON_INTERPRET=1 dsv4 bench kernels moe --device cpu --hidden 64 --inter 32
--experts 8 --topk 2 --tokens 1 5.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from benchmarks.timing import bench, copy_gbps
from benchmarks.timing import try_bench_graph as bench_graph
from dsv4_kernels import moe as ref
from dsv4_kernels.quant import dequant_mxfp4

SWEEP_TILES = [{"block_n": n, "block_k": k} for n in (32, 64, 128) for k in (128, 256)]
SWEEP_LAUNCH = [{"num_warps": w, "num_stages": s} for w, s in ((4, 2), (4, 3), (4, 4), (8, 3))]


def make_experts(e: int, h: int, inter: int, device: str, gen: torch.Generator, dense: bool = True):
    """Random packed experts (uniform e2m1 codes, scales near 2**-6) and their bf16 dequantisation ({} if not
    `dense`: the GEMV sweep needs none, and 256 experts' bf16 copy takes 13 GB and seconds)."""
    packed, dense = {}, {}
    for name, (n, k) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
        w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
        s = torch.randint(119, 123, (e, n, k // 32), dtype=torch.uint8, device=device, generator=gen)
        packed[name], packed["s" + name[1]] = w, s
        if not dense:
            continue
        d = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
        for e0 in range(0, e, 16):  # fp32 intermediate per 16 experts keeps the peak small
            d[e0 : e0 + 16] = dequant_mxfp4(w[e0 : e0 + 16], s[e0 : e0 + 16]).to(torch.bfloat16)
        dense[name] = d
    return packed, dense


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def row(tokens, path, us, graph_us, nbytes, copy, err="") -> str:
    best = graph_us if graph_us else us
    gbs = nbytes / best / 1e3
    g = f"{graph_us:.1f}" if graph_us else "n/a"
    return f"| {tokens} | {path} | {us:.1f} | {g} | {nbytes / 1e6:.1f} | {gbs:.0f} | {100 * gbs / copy:.0f}% | {err} |"


def gemv_max_routes() -> int:
    from dsv4_kernels.triton_mxfp4_gemv import MAX_ROUTES

    return MAX_ROUTES


def run_tokens(t, args, packed, dense, gate, bias, copy, tm, ogs=None, marlin=None, gemv=None) -> list[str]:
    dev, h, inter, k = args.device, args.hidden, args.inter, args.topk
    gen = torch.Generator(device=dev).manual_seed(t)
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    weights, ids = ref.route(x, gate, k, 1.5, bias=bias)
    used = int(ids.unique().numel())
    mx_bytes = used * 3 * inter * h * (0.5 + 1 / 32)
    bf_bytes = used * 3 * inter * h * 2
    pk, dn = packed, dense

    def mxfp4():
        return tm.mxfp4_moe(x, weights, ids, pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"], 10.0)

    def grouped():
        return ref.moe_experts_grouped(x, weights, ids, dn["w1"], dn["w2"], dn["w3"], 10.0)

    def reference():
        return ref.moe_experts(x, weights, ids, dn["w1"], dn["w2"], dn["w3"], 10.0)

    want = grouped()
    cuda = dev == "cuda"
    rows = []
    if ogs is not None:
        from dsv4_kernels import mxfp4_ogs

        def tk():
            return mxfp4_ogs.ogs_moe(x, weights, ids, ogs, 10.0)

        rows.append(
            row(
                t, "mxfp4 triton_kernels", bench(tk, dev), bench_graph(tk), mx_bytes, copy, f"{rel_err(tk(), want):.1e}"
            )
        )
    if gemv is not None and t * k <= gemv_max_routes():
        from dsv4_kernels import triton_mxfp4_gemv

        def gv():
            return triton_mxfp4_gemv.gemv_moe(x, weights, ids, gemv, 10.0)

        rows.append(
            row(
                t,
                "mxfp4 gemv",
                bench(gv, dev),
                bench_graph(gv) if cuda else None,
                mx_bytes,
                copy,
                f"{rel_err(gv(), want):.1e}",
            )
        )
    if marlin is not None:
        from dsv4_kernels import marlin_moe

        def mar():
            return marlin_moe.marlin_moe(x, weights, ids, marlin, 10.0)

        try:
            rows.append(
                row(t, "mxfp4 marlin", bench(mar, dev), bench_graph(mar), mx_bytes, copy, f"{rel_err(mar(), want):.1e}")
            )
        except Exception as exc:  # noqa: BLE001 - a candidate's failure is a table row, not the end of the bench
            rows.append(f"| {t} | mxfp4 marlin | failed: {type(exc).__name__}: {str(exc)[:120]} | | | | | |")
    rows += [
        row(
            t,
            "mxfp4",
            bench(mxfp4, dev),
            bench_graph(mxfp4) if cuda else None,
            mx_bytes,
            copy,
            f"{rel_err(mxfp4(), want):.1e}",
        ),
        row(t, "grouped_mm bf16", bench(grouped, dev), None, bf_bytes, copy, "0"),
        row(t, "reference bf16", bench(reference, dev), None, bf_bytes, copy, f"{rel_err(reference(), want):.1e}"),
    ]
    gate_f32 = gate.float()
    r_bytes = gate_f32.numel() * 4
    rows.append(
        row(
            t,
            "route triton",
            bench(lambda: tm.route(x, gate_f32, k, 1.5, bias=bias), dev),
            bench_graph(lambda: tm.route(x, gate_f32, k, 1.5, bias=bias)) if cuda else None,
            r_bytes,
            copy,
        )
    )
    rows.append(
        row(
            t,
            "route torch",
            bench(lambda: ref.route(x, gate, k, 1.5, bias=bias), dev),
            None,
            gate.numel() * gate.element_size(),
            copy,
        )
    )
    if args.sweep:
        sweep(t, x, weights, ids, pk, mx_bytes, copy, tm, dev)
    return rows


def sweep(t, x, weights, ids, pk, nbytes, copy, tm, dev) -> None:
    """Time SWEEP_TILES x SWEEP_LAUNCH (and block_m 32/64 where it applies); print the best five."""
    results = []
    for tiles, launch in itertools.product(SWEEP_TILES, SWEEP_LAUNCH):
        for bm in (None, 32, 64) if ids.numel() >= 256 else (None,):
            opts = {**tiles, **launch, "block_m": bm}
            try:
                us = bench(
                    lambda o=opts: tm.mxfp4_moe(
                        x, weights, ids, pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"], 10.0, **o
                    ),
                    dev,
                )
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for a large tile
                print(f"  tokens {t} {opts}: failed ({type(exc).__name__})")
                continue
            results.append((us, opts))
    results.sort(key=lambda r: r[0])
    print(f"\nsweep, tokens {t} (defaults {tm.DEFAULTS}, block_m {tm.pick_block_m(ids.numel(), pk['w1'].shape[0])}):")
    for us, opts in results[:5]:
        print(f"  {us:8.1f} us  {nbytes / us / 1e3:6.0f} GB/s ({100 * nbytes / us / 1e3 / copy:.0f}%)  {opts}")


OGS_SWEEP = [
    {},
    {"is_persistent": True},
    {"is_persistent": False},
    {"num_stages": 3},
    {"num_stages": 5},
    {"block_k": 256},
    {"block_n": 128},
    {"block_m": 32},
    {"is_persistent": True, "block_n": 128},
]
# Prefill-sized steps (thousands of tokens: ~100+ rows an expert at V4-Flash's 256 experts) also try the M tiles.
OGS_SWEEP_PREFILL = [
    {"is_persistent": False, "block_m": 64},
    {"is_persistent": False, "block_m": 128},
    {"is_persistent": True, "block_m": 128},
    {"is_persistent": False, "block_m": 128, "block_n": 128},
    {"is_persistent": False, "block_m": 128, "num_stages": 3},
]
PREFILL_TOKENS = 1024  # from here on a sweep adds OGS_SWEEP_PREFILL and reports TFLOP/s
# Batch-1-sized steps (6 experts x 1 row: ~96 programs a matmul, each streaming 4096 of K) also try splitting K
# and narrower N tiles, for more programs in flight.
OGS_SWEEP_SMALL = [
    {"is_persistent": False, "split_k": 2},
    {"is_persistent": False, "split_k": 4},
    {"is_persistent": False, "block_n": 64},
    {"is_persistent": False, "block_k": 256, "split_k": 2},
]
SMALL_TOKENS = 8  # up to here a sweep adds OGS_SWEEP_SMALL


def ogs_sweep(t, args, ogs, gate, bias, copy) -> dict:
    """Graph-timed dsv4_kernels.mxfp4_ogs.ogs_moe under each OGS_SWEEP constraint set at `t` tokens -> the fastest."""
    from dsv4_kernels import mxfp4_ogs

    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, args.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = ref.route(x, gate, args.topk, 1.5, bias=bias)
    nbytes = int(ids.unique().numel()) * 3 * args.inter * args.hidden * (0.5 + 1 / 32)
    want = mxfp4_ogs.ogs_moe(x, weights, ids, ogs, 10.0, {})
    results = []
    flops = 2 * t * args.topk * 3 * args.inter * args.hidden
    extra = OGS_SWEEP_PREFILL if t >= PREFILL_TOKENS else OGS_SWEEP_SMALL if t <= SMALL_TOKENS else []
    for c in OGS_SWEEP + extra:
        try:
            err = rel_err(mxfp4_ogs.ogs_moe(x, weights, ids, ogs, 10.0, c), want)
            us = bench_graph(lambda c=c: mxfp4_ogs.ogs_moe(x, weights, ids, ogs, 10.0, c))
        except Exception as exc:  # noqa: BLE001 - an inapplicable constraint: report, go on
            print(f"  ogs tokens {t} {c}: failed ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        if us is not None:
            results.append((us, err, c))
    results.sort(key=lambda r: r[0])
    lines = [f"ogs sweep, tokens {t}:"] + [
        f"  {us:8.1f} us  {nbytes / us / 1e3:6.0f} GB/s ({100 * nbytes / us / 1e3 / copy:.0f}%)  "
        f"{flops / us / 1e6:6.0f} TFLOP/s  err {err:.1e}  {c}"
        for us, err, c in results
    ]
    print("\n" + "\n".join(lines))
    return (results[0][2] if results else {}), lines


def sweep_section(device_name: str, lines: list[str], command: str) -> str:
    """The `mxfp4_moe_sweep` section: the command and the sweep's own ranked lines."""
    import datetime

    return "\n".join(
        [
            "## triton_kernels MXFP4 MoE launch constraints: `dsv4 bench kernels moe --ogs-sweep`",
            "",
            f"- command: `{command}`, "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {device_name}; times = "
            "CUDA-graph device time of the whole dsv4_kernels.mxfp4_ogs.ogs_moe call after an L2 flush; "
            "err = "
            "against the same call with triton_kernels' own heuristics",
            "",
            "```",
            *lines,
            "```",
        ]
    )


def section(device_name: str, copy: float, args, table: list[str]) -> str:
    """The BENCHMARKS.md section: command, setup, the table and the 64-token aim judged from its rows."""
    import datetime

    lines = (
        [
            "## Routed MXFP4 experts (V4-Flash shapes): `dsv4 bench kernels moe`",
            "",
            f"- command: `{args.command}`",
            f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {device_name}, torch "
            f"{torch.__version__}; copy bandwidth {copy:.0f} GB/s (read + write, measured in this run)",
            f"- hidden {args.hidden}, moe_inter {args.inter}, {args.experts} experts top-{args.topk}, bf16 activations; "
            "weight MB = the distinct experts the routing touches; `graph us` = device time in a CUDA graph after "
            "an L2 flush; GB/s from the graph time where there is one",
            "",
        ]
        + table
        + [""]
    )
    for path in ("mxfp4 triton_kernels", "mxfp4 marlin", "mxfp4"):
        rows = [r for r in table if r.split("|")[1].strip() == "64" and r.split("|")[2].strip() == path]
        if rows:
            share = float(rows[0].split("|")[7].strip().rstrip("%"))
            verdict = "met" if share >= 60 else f"missed by {60 - share:.0f} points"
            lines.append(f"- {path} at 64 tokens: {share:.0f}% of copy bandwidth (aim >= 60%): {verdict}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4 bench kernels moe", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--ogs-sweep",
        action="store_true",
        help="time triton_kernels launch constraints (OGS_SWEEP) per token count; print the best",
    )
    ap.add_argument("--ogs-best-out", default=None, help="write the best constraints (JSON) at the last token count")
    ap.add_argument("--ogs-out", default=None, help="write the sweep's section text here (merge with --merge-sweep)")
    ap.add_argument(
        "--gemv-sweep",
        action="store_true",
        help="only sweep the MXFP4 GEMV's launch configs (GemvConfig) at --tokens (moe_gemv_sweep.py)",
    )
    ap.add_argument("--gemv-budget-s", type=float, default=80.0, help="the GEMV sweep's time for configs")
    ap.add_argument("--gemv-out", default=None, help="write the GEMV sweep's tables (markdown) here")
    ap.add_argument("--gemv-best-out", default=None, help="write the GEMV sweep's best configs (one JSON line) here")
    ap.add_argument("--gemv-no-ogs", action="store_true", help="GEMV sweep: skip the triton_kernels reference")
    ap.add_argument("--merge", default=None, help="put this --out file into BENCHMARKS.md (section mxfp4_moe) and exit")
    ap.add_argument("--merge-sweep", default=None, help="put this --ogs-out file into section mxfp4_moe_sweep and exit")
    args = ap.parse_args(argv)
    args.command = "dsv4 bench kernels moe " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.merge or args.merge_sweep:
        from service.benchmarks_md import write_section

        if args.merge:
            write_section("mxfp4_moe", Path(args.merge).read_text())
        if args.merge_sweep:
            write_section("mxfp4_moe_sweep", Path(args.merge_sweep).read_text())
        return 0
    from dsv4_kernels import triton_moe as tm

    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    packed, dense = make_experts(args.experts, args.hidden, args.inter, dev, gen, dense=not args.gemv_sweep)
    gate = (torch.randn(args.experts, args.hidden, device=dev, generator=gen) * args.hidden**-0.5).to(torch.bfloat16)
    bias = torch.randn(args.experts, device=dev, generator=gen) * 0.1
    copy = copy_gbps(dev)
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    print(
        f"{name}: copy {copy:.0f} GB/s; hidden {args.hidden}, moe_inter {args.inter}, {args.experts} experts "
        f"top-{args.topk}, bf16 activations\n"
    )
    if args.gemv_sweep:
        from benchmarks.kernels import moe_gemv_sweep

        return moe_gemv_sweep.main(args, packed, gate, bias, copy, name)
    ogs = None
    from dsv4_kernels.gpu import has_triton_kernels, why_not

    if dev == "cuda" and has_triton_kernels():
        from dsv4_kernels import mxfp4_ogs

        ogs = mxfp4_ogs.prepare(packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"], packed["s3"])
    else:
        print(f"(no triton_kernels rows: {why_not('triton_kernels.matmul') or 'needs CUDA'})")
    gemv = None  # the split-K GEMV on triton_kernels' storage (views) or, on the CPU, on the torch swizzles
    if ogs is not None or dev == "cpu":
        from dsv4_kernels import triton_mxfp4_gemv

        gemv = (
            triton_mxfp4_gemv.from_ogs(ogs)
            if ogs is not None
            else triton_mxfp4_gemv.from_checkpoint(
                packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"], packed["s3"]
            )
        )
    marlin = None
    from dsv4_kernels.gpu import has_marlin_moe, why_not_marlin_moe

    if dev == "cuda" and has_marlin_moe():
        from dsv4_kernels import marlin_moe

        try:
            marlin = marlin_moe.prepare(
                packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"], packed["s3"]
            )
        except Exception as exc:  # noqa: BLE001 - report and bench the rest
            print(f"(no Marlin rows: its repack failed: {type(exc).__name__}: {str(exc)[:200]})")
    else:
        print(f"(no Marlin rows: {why_not_marlin_moe()}; tools/device_wheels/marlin_wheel.py builds its wheels)")
    head = ["| tokens | path | us | graph us | weight MB | GB/s | % copy | err |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(head))
    table = []
    for t in args.tokens:
        for line in run_tokens(t, args, packed, dense, gate, bias, copy, tm, ogs, marlin, gemv):
            print(line, flush=True)
            table.append(line)
    if args.out:
        Path(args.out).write_text(section(name, copy, args, head + table))
    if args.ogs_sweep and ogs is not None:
        best, sweep_lines = None, []
        for t in args.tokens:
            best, lines = ogs_sweep(t, args, ogs, gate, bias, copy)
            sweep_lines += lines + [""]
        if args.ogs_best_out and best is not None:
            Path(args.ogs_best_out).write_text(json.dumps(best))
        if args.ogs_out:
            Path(args.ogs_out).write_text(sweep_section(name, sweep_lines, args.command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
