"""GPU kernel micro-benchmarks at V4-Flash decode shapes (CUDA only; a script, never run by CI).

For each Triton kernel in dsv4_kernels/triton_*.py and each batch size it reports:
- us: median time of the public wrapper (triton.testing.do_bench, L2 flushed before every call, so the
  rows really come from HBM; includes the wrapper's Python launch overhead, as eager decode pays it);
- GB/s: the bytes the op must read (inputs, gathered rows, weights; not its writes) / time, and that
  as a share of a device-to-device copy measured in the same run ((read + write) / time of a 1 GiB copy);
- TFLOP/s: for the two ops with real matmul work (attention 4*T*H*K*D, indexer 2*T*S*Hi*Di), and the
  share of a large bf16 matmul measured in the same run;
- graph us / GB/s (attention): the wrapper replayed in a CUDA graph, each call after an L2 flush whose own
  time is subtracted: the kernels' device time without Python launch overhead (what a graph-captured decode
  pays; eager wrapper overhead dominates small batches);
- speed-up over the plain-torch reference on the same inputs (the reference gathers [T, K, D] first),
  and whether the two agree (bf16 tolerance, or exact -1 pattern + close scores for the top-k).
The cache-writing kernels (SWA insert, indexer query prologue, compressor state / quantised entries) have
their cases in benchmarks/kernels/triton_decode_cache.py; they count read + write bytes (marked "r+w").
The markdown table is printed and written to BENCHMARKS.md under '## GPU kernels' (replacing that
section if present). `--sweep` also tries attention tile / split configurations (ranked by graph time),
lists the best, and prints the registers / spills / shared memory of every compiled attention variant.

Usage: dsv4 bench kernels triton [--batches 1 16 64 128] [--only GROUPS] [--sweep] [--no-write]
       (`attention` and `cache` are this op with --only preset to those groups)
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.timing import bench, bench_graph, measure_roofs
from service.benchmarks_md import BENCHMARKS_MD, write_section

# V4-Flash decode shapes (../shared/docs/deepseek_v4.md).
HEADS, HEAD_DIM, ROPE_DIM, WINDOW, TOPK = 64, 512, 64, 128, 512
INDEX_HEADS, INDEX_DIM, HIDDEN, HC = 64, 128, 4096, 4
INDEX_CANDIDATES = (2048, 8192)  # visible compressed entries: 8K and 32K tokens of context
EPS = 1e-6
# Attention launch configurations tried by --sweep (the defaults are block_h 64, block_k 64,
# 8 warps, 2 stages); each is timed with the default split heuristic and a few fixed splits.
ATTN_SWEEP = [
    dict(block_k=64, num_stages=2),
    dict(block_k=64, num_stages=3),
    dict(block_k=32, num_stages=2),
    dict(block_k=32, num_stages=3),
    dict(block_k=32, num_stages=4),
    dict(block_k=16, num_stages=4),
    dict(block_k=64, num_stages=2, block_h=32),
]
SPLIT_SWEEP = [None, 1, 2, 4]
DEVICE = "cuda"  # a module constant so the case builders can be smoke-tested on CPU under the interpreter


@dataclass
class Case:
    kernel: str
    shape: str
    run: Callable[[], object]
    reference: Callable[[], object]
    read_bytes: int
    flops: int = 0
    check: Callable[[object, object], str] | None = None
    graph: bool = False  # also time it replayed in a CUDA graph (no Python launch overhead)


def close(out, ref, tol=2e-2) -> str:
    """bf16-level agreement; atol scales with the output's magnitude (ops that round to bf16 before a
    rotation or a sum carry an error of ~|x| * 2^-8 into outputs that may be near zero)."""
    out, ref = out.float(), ref.float()
    if torch.allclose(out, ref, atol=tol * max(1.0, ref.abs().max().item()), rtol=tol):
        return "ok"
    return f"MISMATCH max|d|={(out - ref).abs().max().item():.3g}"


def rand(*shape, dtype=torch.bfloat16, scale=1.0, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def distinct_rows(t: int, k: int, pool: int, seed: int = 0) -> torch.Tensor:
    """int32 [T, K] row ids, all distinct (different requests share no rows), from a pool of `pool` rows."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randperm(pool, generator=gen, device=DEVICE)[: t * k].view(t, k).to(torch.int32)


# ---- cases ---------------------------------------------------------------------------------------
def attention_cases(t: int) -> list[Case]:
    from dsv4_kernels import geometry as g
    from dsv4_kernels.attention import sparse_attention
    from dsv4_kernels.triton_attention import sparse_mqa_attention, sparse_mqa_attention_fp8

    k = WINDOW + TOPK
    q = rand(t, HEADS, HEAD_DIM, scale=0.5, seed=1)
    sink = rand(HEADS, dtype=torch.float32, seed=2)
    rows = distinct_rows(t, k, t * k)
    scale = HEAD_DIM**-0.5
    flops = 4 * t * HEADS * k * HEAD_DIM
    shape = f"T={t} H={HEADS} D={HEAD_DIM} K={k}"

    kv = rand(t * k, HEAD_DIM, seed=3)
    plain = Case(
        "attention bf16 rows",
        shape,
        lambda: sparse_mqa_attention(q, kv, rows, sink, scale),
        lambda: sparse_attention(q, kv[rows.long()], rows >= 0, sink, scale),
        rows.numel() * HEAD_DIM * 2 + q.numel() * 2,
        flops,
        close,
        graph=True,
    )

    layout = g.Fp8DsMlaLayout(HEAD_DIM, ROPE_DIM)
    blocks = -(-t * k // layout.block_size)
    cache = torch.zeros(blocks, layout.block_bytes(), dtype=torch.uint8, device=DEVICE)
    slots = torch.arange(blocks * layout.block_size, device=DEVICE)
    g.write_rows(cache, layout, slots, g.pack_fp8_ds_mla(rand(slots.numel(), HEAD_DIM, seed=4), layout))

    def fp8_reference():
        dense = g.unpack_fp8_ds_mla(g.read_rows(cache, layout, rows.reshape(-1)), layout, torch.bfloat16)
        return sparse_attention(q, dense.view(t, k, HEAD_DIM), rows >= 0, sink, scale)

    fp8 = Case(
        "attention fp8_ds_mla",
        shape,
        lambda: sparse_mqa_attention_fp8(q, cache, rows, sink, scale, layout),
        fp8_reference,
        rows.numel() * layout.row_bytes + q.numel() * 2,
        flops,
        close,
        graph=True,
    )
    return [plain, fp8]


def indexer_cases(t: int) -> list[Case]:
    from dsv4_kernels import geometry as g
    from dsv4_kernels import indexer as ref
    from dsv4_kernels.triton_indexer import indexer_topk

    out = []
    for s in INDEX_CANDIDATES:
        q = rand(t, INDEX_HEADS, INDEX_DIM, seed=5)
        keys = rand(t * s, INDEX_DIM, seed=6)
        rows = distinct_rows(t, s, t * s, seed=7)
        w = rand(t, INDEX_HEADS, dtype=torch.float32, seed=8) * INDEX_HEADS**-0.5
        layout = g.IndexerKeyLayout(INDEX_DIM, "mxfp4")
        blocks = -(-t * s // layout.block_size)
        cache = torch.zeros(blocks, layout.block_bytes(), dtype=torch.uint8, device=DEVICE)
        g.write_rows(cache, layout, torch.arange(t * s, device=DEVICE), g.pack_indexer_mxfp4(keys.float()))
        flat = rows.reshape(-1)
        stores = {  # name -> (store, layout, bytes per row, dense keys of rows for the reference)
            "bf16 rows": (keys, None, INDEX_DIM * 2, lambda keys=keys, rows=rows: keys[rows.long()]),
            "mxfp4 cache": (
                cache,
                layout,
                layout.row_bytes,
                lambda cache=cache, layout=layout, flat=flat, rows=rows: (
                    g.unpack_indexer_mxfp4(g.read_rows(cache, layout, flat)).view(*rows.shape, INDEX_DIM).to(q.dtype)
                ),
            ),
        }
        for name, (store, lay, row_bytes, dense) in stores.items():

            def reference(q=q, rows=rows, w=w, dense=dense):
                return ref.topk_visible(ref.indexer_scores(q, dense(), w), rows >= 0, TOPK)

            def check(picked, expected, q=q, w=w, dense=dense):
                # Near-ties may swap between implementations: compare the -1 pattern and the picked scores.
                scores = ref.indexer_scores(q, dense(), w)
                if not torch.equal(picked < 0, expected < 0):
                    return "MISMATCH -1 padding"
                return close(scores.gather(1, picked.clamp(min=0)), scores.gather(1, expected.clamp(min=0)))

            def run(q=q, store=store, rows=rows, w=w, lay=lay):
                return indexer_topk(q, store, rows, w, TOPK, lay)

            out.append(
                Case(
                    f"indexer scores + topk, {name}",
                    f"T={t} Hi={INDEX_HEADS} Di={INDEX_DIM} S={s} k={TOPK}",
                    run,
                    reference,
                    rows.numel() * row_bytes + q.numel() * 2 + w.numel() * 4,
                    2 * t * s * INDEX_HEADS * INDEX_DIM,
                    check,
                )
            )
    return out


def mhc_cases(t: int) -> list[Case]:
    from dsv4_kernels import mhc as ref
    from dsv4_kernels import triton_mhc

    n_mix = (2 + HC) * HC
    streams = rand(t, HC, HIDDEN, seed=9)
    fn = rand(n_mix, HC * HIDDEN, dtype=torch.float32, scale=0.02, seed=10)
    base = rand(n_mix, dtype=torch.float32, scale=0.5, seed=11)
    scale = torch.tensor([0.7, 1.3, 2.0], device=DEVICE)
    shape = f"T={t} hc={HC} D={HIDDEN}"

    def check_pre(out, expected):
        return "ok" if all(close(a, b) == "ok" for a, b in zip(out, expected)) else "MISMATCH"

    pre = Case(
        "mhc pre (+ torch mixes matmul)",
        shape,
        lambda: triton_mhc.hc_pre(streams, fn, base, scale, 20, EPS, EPS),
        lambda: ref.hc_pre(streams, fn, base, scale, 20, EPS, EPS),
        streams.numel() * 2 + fn.numel() * 4,
        check=check_pre,
    )
    block_out = rand(t, HIDDEN, seed=12)
    post_w = torch.rand(t, HC, device=DEVICE) * 2
    comb = torch.softmax(rand(t, HC, HC, dtype=torch.float32, seed=13), dim=-1)
    post = Case(
        "mhc post",
        shape,
        lambda: triton_mhc.hc_post(block_out, streams, post_w, comb),
        lambda: ref.hc_post(block_out, streams, post_w, comb),
        streams.numel() * 2 + block_out.numel() * 2,
        check=close,
    )
    return [pre, post]


def norm_rope_cases(t: int) -> list[Case]:
    from dsv4_kernels.norm import rms_norm, unweighted_rms_norm
    from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
    from dsv4_kernels.triton_norm_rope import rms_norm_rope

    positions = torch.randint(0, 65536, (t,), device=DEVICE)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(10000.0, ROPE_DIM))
    q = rand(t, HEADS, HEAD_DIM, seed=14)
    kv = rand(t, HEAD_DIM, seed=15)
    weight = rand(HEAD_DIM, dtype=torch.float32, scale=0.1, seed=16) + 1  # norm weights sit near 1
    return [
        Case(
            "norm+rope q (per head)",
            f"T={t} H={HEADS} D={HEAD_DIM} rope={ROPE_DIM}",
            lambda: rms_norm_rope(q, cos, sin, EPS),
            lambda: apply_rope(unweighted_rms_norm(q, EPS), cos, sin),
            q.numel() * 2,
            check=close,
        ),
        Case(
            "norm+rope kv",
            f"T={t} D={HEAD_DIM} rope={ROPE_DIM}",
            lambda: rms_norm_rope(kv, cos, sin, EPS, weight),
            lambda: apply_rope(rms_norm(kv, weight, EPS), cos, sin),
            kv.numel() * 2,
            check=close,
        ),
    ]


def compressor_cases(t: int) -> list[Case]:
    from dsv4_kernels.compressor import pool_windows
    from dsv4_kernels.norm import rms_norm
    from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
    from dsv4_kernels.triton_compressor import pool_norm_rope

    out = []
    for slots, d, what in ((8, HEAD_DIM, "ratio 4"), (128, HEAD_DIM, "ratio 128"), (8, INDEX_DIM, "indexer")):
        kv = rand(t, slots, d, seed=17)
        score = rand(t, slots, d, dtype=torch.float32, seed=18)
        weight = rand(d, dtype=torch.float32, scale=0.1, seed=19) + 1
        cos, sin = rope_cos_sin(torch.randint(0, 65536, (t,), device=DEVICE), rope_inv_freq(160000.0, ROPE_DIM))

        def reference(kv=kv, score=score, weight=weight, cos=cos, sin=sin):
            return apply_rope(rms_norm(pool_windows(kv, score), weight, EPS), cos, sin)

        out.append(
            Case(
                f"compressor pool+norm+rope ({what})",
                f"T={t} slots={slots} d={d}",
                lambda kv=kv, score=score, weight=weight, cos=cos, sin=sin: pool_norm_rope(
                    kv, score, weight, EPS, cos, sin
                ),
                reference,
                kv.numel() * 2 + score.numel() * 4,
                check=close,
            )
        )
    return out


# ---- running and reporting ---------------------------------------------------------------------------
def measure(case: Case, copy_gbs: float, mm_tflops: float) -> dict:
    out = case.run()
    expected = case.reference()
    verdict = case.check(out, expected) if case.check else ""
    t_us = bench(case.run)
    ref_us = bench(case.reference)
    gbs = case.read_bytes / t_us / 1e3
    graph_us = 0.0
    if case.graph:
        try:
            graph_us = bench_graph(case.run)
        except Exception as e:  # noqa: BLE001 - report the eager numbers even if capture fails
            print(f"  graph timing of {case.kernel} {case.shape} failed: {type(e).__name__}: {e}", file=sys.stderr)
    ggbs = case.read_bytes / graph_us / 1e3 if graph_us else 0.0
    # TFLOP/s from the kernel-only (graph) time where there is one.
    tflops = case.flops / (graph_us or t_us) / 1e6 if case.flops else 0.0
    return {
        "kernel": case.kernel,
        "shape": case.shape,
        "us": t_us,
        "ref_us": ref_us,
        "gbs": gbs,
        "copy": gbs / copy_gbs,
        "graph_us": graph_us,
        "ggbs": ggbs,
        "gcopy": ggbs / copy_gbs,
        "tflops": tflops,
        "mm": tflops / mm_tflops,
        "check": verdict,
    }


def sweep_attention(t: int, configs=None, splits=None) -> dict:
    """Graph-timed attention configs at batch t: {variant: [(us, kwargs)] sorted}; failing configs skipped."""
    from dsv4_kernels import geometry as g
    from dsv4_kernels.triton_attention import sparse_mqa_attention, sparse_mqa_attention_fp8

    k = WINDOW + TOPK
    q = rand(t, HEADS, HEAD_DIM, scale=0.5)
    sink = rand(HEADS, dtype=torch.float32)
    rows = distinct_rows(t, k, t * k)
    kv = rand(t * k, HEAD_DIM)
    layout = g.Fp8DsMlaLayout(HEAD_DIM, ROPE_DIM)
    cache = torch.randint(
        0, 100, (-(-t * k // layout.block_size), layout.block_bytes()), dtype=torch.uint8, device=DEVICE
    )  # timing only: any bytes that decode to finite values do
    variants = {
        "plain": lambda **kw: sparse_mqa_attention(q, kv, rows, sink, 0.04, **kw),
        "fp8": lambda **kw: sparse_mqa_attention_fp8(q, cache, rows, sink, 0.04, layout, **kw),
    }
    out = {}
    for name, fn in variants.items():
        results = []
        for cfg in configs or ATTN_SWEEP:
            for ns in splits or SPLIT_SWEEP:
                kw = {**cfg, "num_splits": ns}
                try:
                    results.append((bench_graph(lambda: fn(**kw)), kw))
                except Exception as e:  # noqa: BLE001 - e.g. triton OutOfResources for a big tile
                    print(f"  sweep {name} T={t} {kw}: {type(e).__name__}", file=sys.stderr)
        out[name] = sorted(results, key=lambda r: r[0])
    return out


def sweep_lines(t: int, swept: dict) -> list[str]:
    lines = []
    for name, results in swept.items():
        best = ", ".join(f"{us:.1f} us {kw}" for us, kw in results[:3])
        lines.append(f"- attention {name} T={t} (graph us): best {best}")
        print(lines[-1], flush=True)
    return lines


def tune_attention(batches: list[int]) -> list[str]:
    """Pick each variant's launch defaults (tile, stages; default split heuristic) by the summed graph time
    over `batches`, and install them in dsv4_kernels.triton_attention.DEFAULTS for the rest of this run."""
    from dsv4_kernels import triton_attention as ta

    totals: dict = {}
    lines = []
    for t in batches:
        swept = sweep_attention(t, splits=[None])
        lines += sweep_lines(t, swept)
        for name, results in swept.items():
            for us, kw in results:
                key = tuple(sorted((k, v) for k, v in kw.items() if k != "num_splits"))
                entry = totals.setdefault(name, {}).setdefault(key, [0.0, 0])
                entry[0] += us
                entry[1] += 1
    for name, by_cfg in totals.items():
        complete = {k: v[0] for k, v in by_cfg.items() if v[1] == len(batches)}
        if not complete:
            continue
        best = min(complete, key=complete.get)
        ta.DEFAULTS[name].update({"block_h": None, **dict(best)})
        lines.append(f"- tuned defaults {name}: {ta.DEFAULTS[name]} (sum over T={batches}: {complete[best]:.1f} us)")
        print(lines[-1], flush=True)
    return lines


def compiled_attention_kernels() -> list[str]:
    """Resource use of every compiled attention kernel variant (registers, spills, shared memory)."""
    from dsv4_kernels import triton_attention as ta

    lines = []
    try:
        for dev_cache in ta._sparse_attn_kernel.device_caches.values():
            for key, k in dev_cache[0].items():
                consts = dict(getattr(k.src, "constants", {})) if hasattr(k, "src") else {}
                what = str(consts)[:200] or str(key)[:200]
                lines.append(
                    f"  regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared} warps "
                    f"{k.metadata.num_warps} stages {k.metadata.num_stages} {what}"
                )
    except Exception as e:  # noqa: BLE001 - introspection of triton internals is best effort
        lines.append(f"  (kernel introspection failed: {type(e).__name__}: {e})")
    return lines


def format_table(results: list[dict]) -> str:
    head = (
        "| kernel | shape | triton us | torch us | speed-up | read GB/s | % copy BW | graph us | graph GB/s "
        "| graph % copy BW | TFLOP/s | % bf16 mm | check |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in results:
        tf = f"{r['tflops']:.1f} | {100 * r['mm']:.1f}%" if r["tflops"] else "- | -"
        graph = f"{r['graph_us']:.1f} | {r['ggbs']:.0f} | {100 * r['gcopy']:.0f}%" if r.get("graph_us") else "- | - | -"
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['us']:.1f} | {r['ref_us']:.1f} | "
            f"{r['ref_us'] / r['us']:.1f}x | {r['gbs']:.0f} | {100 * r['copy']:.0f}% | {graph} | {tf} | "
            f"{r['check']} |"
        )
    return "\n".join(lines)


def write_kernels_section(path: Path, body: str) -> None:
    write_section("bench_kernels", f"## GPU kernels\n\n{body.rstrip()}", path)


def main(argv: list[str] | None = None, only: str = "", prog: str = "triton") -> int:
    ap = argparse.ArgumentParser(prog=f"dsv4 bench kernels {prog}", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument(
        "--only",
        default=only,
        help="comma-separated subset: attention,indexer,mhc,norm_rope,compressor,"
        "swa_insert,indexer_query,compressor_cache",
    )
    ap.add_argument("--sweep", action="store_true", help="also sweep attention tiles and splits")
    ap.add_argument(
        "--tune",
        type=int,
        nargs="*",
        default=None,
        metavar="T",
        help="first pick the attention launch defaults by graph time at these batches (default 64 128) "
        "and use them for the run (copy the printed DEFAULTS into dsv4_kernels/triton_attention.py)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--out", type=Path, default=BENCHMARKS_MD)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dsv4 bench kernels triton needs a CUDA GPU", file=sys.stderr)
        return 2
    from dsv4_kernels.gpu import has_triton

    if not has_triton():
        print("dsv4 bench kernels triton needs triton (pip install '.[gpu]')", file=sys.stderr)
        return 2
    import triton

    from benchmarks.kernels.triton_decode_cache import case_groups

    groups = {
        "attention": attention_cases,
        "indexer": indexer_cases,
        "mhc": mhc_cases,
        "norm_rope": norm_rope_cases,
        "compressor": compressor_cases,
        **case_groups(Case, rand, close, DEVICE),
    }
    chosen = [g for g in args.only.split(",") if g] or list(groups)
    torch.manual_seed(0)
    copy_gbs, mm_tflops = measure_roofs(DEVICE)
    print(f"copy {copy_gbs:.0f} GB/s (read + write), bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    tuned = []
    if args.tune is not None:
        tuned = tune_attention(args.tune or [64, 128])
    from dsv4_kernels.triton_attention import DEFAULTS

    results = []
    for name in chosen:
        for t in args.batches:
            for case in groups[name](t):
                results.append(measure(case, copy_gbs, mm_tflops))
                r = results[-1]
                print(
                    f"{r['kernel']:38s} {r['shape']:44s} {r['us']:9.1f} us  torch {r['ref_us']:9.1f} us  "
                    f"{r['gbs']:7.0f} GB/s  graph {r['graph_us']:7.1f} us {r['ggbs']:6.0f} GB/s  {r['check']}",
                    flush=True,
                )
            torch.cuda.empty_cache()
    sweep = []
    if args.sweep:
        for t in args.batches:
            sweep += sweep_lines(t, sweep_attention(t))
        print("\n".join(compiled_attention_kernels()), flush=True)
    props = torch.cuda.get_device_properties(0)
    body = (
        f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.date.today().isoformat()} (`dsv4 bench kernels triton`).\n"
        f"Roofs measured in the same run: device copy {copy_gbs:.0f} GB/s (read + write of 1 GiB), "
        f"bf16 matmul {mm_tflops:.0f} TFLOP/s (8192^3). 'read GB/s' = bytes the op must read / time; "
        "times are medians with a flushed L2 and include the wrappers' launch overhead (eager use). "
        "'graph' columns (attention): the same call replayed in a CUDA graph after an L2 flush, flush time "
        "subtracted, i.e. device time without Python launch overhead; TFLOP/s uses it where present. The "
        "torch reference gathers rows into [T, K, D] before computing. Attention launch defaults: "
        f"{DEFAULTS}.\n\n" + format_table(results)
    )
    if tuned:
        body += "\n\nAttention launch tuning (graph us, default split heuristic):\n" + "\n".join(tuned)
    if sweep:
        body += "\n\nAttention tile / split sweep (top 3):\n" + "\n".join(sweep)
    print("\n" + body)
    if not args.no_write:
        write_kernels_section(args.out, body)
        print(f"\nwrote the '## GPU kernels' section of {args.out}")
    return 0
