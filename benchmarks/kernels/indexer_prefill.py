"""Indexer logits + top-k of one prefill chunk: the prefill kernel vs the per-token kernel (CUDA only; a script).

Shapes: V4-Flash's indexer (64 heads x 128, top-512) over one sequence's chunk of T queries starting at
position `--start` (default an 8K prompt from 0: 2048 entries, each query seeing (p + 1) // 4 of them), keys
in a paged store (bf16 rows, MXFP4 or FP8 cache). Rows are built as engine.model.batch builds its visible entries.
For each store it prints the median time (triton.testing.do_bench) of:
- per-token: dsv4_kernels.triton_indexer.indexer_scores (the decode kernel) + torch.topk (today's prefill path);
- prefill scores: dsv4_kernels.triton_indexer_prefill.indexer_prefill_scores alone, and + torch.topk
  (dsv4_kernels.triton_indexer.indexer_topk with cu_seqlens, what the engine now runs);
- TFLOP/s: 2 * Hi * Di * (visible query-entry pairs) / time (the causal work; the dense T x S figure is twice
  that for a prompt from 0), and the agreement of the two kernels' scores (max |diff| over visible entries)
  and top-k ids (share equal, and share whose scores agree within bf16 tolerance where ids differ).
--sweep times the prefill scores over tile shapes / warps / stages and lists the fastest.

Usage: dsv4 bench kernels indexer-prefill [--tokens 8192] [--start 0] [--stores bf16 mxfp4 fp8] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch

from benchmarks.timing import bench

HEADS, DIM, TOPK, RATIO, PAGE_ROWS = 64, 128, 512, 4, 64
SWEEP = [
    dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
    for m, n, w, s in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3))
]


def step(tokens: int, start: int, device):
    """-> (rows int64 [T, S] (-1 = not visible), cu [2], visible pairs, number of key slots)."""
    from engine.model.batch import paged_rows

    positions = torch.arange(start, start + tokens, device=device)
    entries = (start + tokens) // RATIO
    pages = -(-entries // PAGE_ROWS)
    table = torch.randperm(pages, device=device).unsqueeze(0)  # one sequence, shuffled pages
    w = torch.arange(entries, device=device).unsqueeze(0).expand(tokens, -1)
    valid = w < ((positions + 1) // RATIO).unsqueeze(1)
    rows = torch.where(valid, paged_rows(table, PAGE_ROWS, torch.zeros_like(w), w), -1)
    cu = torch.tensor([0, tokens], device=device)
    return rows, cu, int(valid.sum()), pages * PAGE_ROWS


def store(kind: str, slots: int, device):
    """-> (key store, layout or None)."""
    from dsv4_kernels import geometry as g

    keys = torch.randn(slots, DIM, device=device)
    if kind == "bf16":
        return keys.bfloat16(), None
    layout = g.IndexerKeyLayout(DIM, kind)
    cache = torch.zeros(slots // layout.block_size, layout.block_bytes(), dtype=torch.uint8, device=device)
    g.write_rows(cache, layout, torch.arange(slots, device=device), g.pack_rows(layout, keys))
    return cache, layout


def compare(old_scores, new_scores, old_ids, new_ids, rows) -> str:
    valid = rows >= 0
    diff = (old_scores[valid] - new_scores[valid]).abs().max().item()
    same = (old_ids == new_ids).float().mean().item()
    pick = lambda ids: old_scores.gather(1, ids.clamp(min=0))  # noqa: E731
    a, b = pick(old_ids), pick(new_ids)
    tied = ((a - b).abs() <= 2e-2 + 2e-2 * a.abs()) | (old_ids == new_ids)
    pad_ok = torch.equal(old_ids < 0, new_ids < 0)
    return (
        f"max|d score| {diff:.2e}, ids equal {same:.4f}, equal-or-tied {tied.float().mean().item():.4f}, "
        f"-1 pattern {'same' if pad_ok else 'DIFFERENT'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4 bench kernels indexer-prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--start", type=int, default=0, help="position of the chunk's first query")
    ap.add_argument("--stores", nargs="+", default=["bf16", "mxfp4", "fp8"], choices=["bf16", "mxfp4", "fp8"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None, help="also write this run as a BENCHMARKS.md section file")
    ap.add_argument("--merge", default=None, help="put this section file (--out of a GPU run) into BENCHMARKS.md")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.merge:
        from service.benchmarks_md import write_section

        write_section("indexer_prefill", Path(args.merge).read_text())
        print(f"merged {args.merge} into BENCHMARKS.md")
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from dsv4_kernels.triton_indexer import indexer_scores, indexer_topk, topk_of_scores
    from dsv4_kernels.triton_indexer_prefill import indexer_prefill_scores

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows, cu, pairs, slots = step(args.tokens, args.start, dev)
    t, s = rows.shape
    q = torch.randn(t, HEADS, DIM, device=dev).bfloat16()
    weights = torch.randn(t, HEADS, device=dev) * HEADS**-0.5
    flops = 2 * HEADS * DIM * pairs
    log = []

    def say(line: str = "") -> None:
        print(line)
        log.append(line)

    say(
        f"{torch.cuda.get_device_name()}: T={t} start={args.start} S={s} Hi={HEADS} Di={DIM} k={TOPK}, "
        f"{pairs} visible pairs ({pairs / (t * s):.2f} of T x S), {flops / 1e9:.1f} GFLOP"
    )
    for kind in args.stores:
        keys, layout = store(kind, slots, dev)
        old_scores = indexer_scores(q, keys, rows, weights, layout)
        new_scores = indexer_prefill_scores(q, keys, rows, weights, cu, layout)
        old_ids = topk_of_scores(old_scores, TOPK)
        new_ids = indexer_topk(q, keys, rows, weights, TOPK, layout, cu_seqlens=cu)
        times = {
            "per-token scores + topk": bench(lambda: indexer_topk(q, keys, rows, weights, TOPK, layout)),
            "per-token scores": bench(lambda: indexer_scores(q, keys, rows, weights, layout)),
            "prefill scores": bench(lambda: indexer_prefill_scores(q, keys, rows, weights, cu, layout)),
            "prefill scores + topk": bench(lambda: indexer_topk(q, keys, rows, weights, TOPK, layout, cu_seqlens=cu)),
            "torch.topk alone": bench(lambda: topk_of_scores(new_scores, TOPK)),
        }
        say(f"\n[{kind} keys] {compare(old_scores, new_scores, old_ids, new_ids, rows)}")
        for name, us in times.items():
            rate = "" if "alone" in name else f"  {flops / us / 1e6:7.1f} TFLOP/s"
            say(f"  {name:<26} {us:9.1f} us{rate}")
        if args.sweep:
            results = []
            for cfg in SWEEP:
                try:
                    us = bench(lambda cfg=cfg: indexer_prefill_scores(q, keys, rows, weights, cu, layout, **cfg))
                except Exception as exc:  # a shape that does not compile (shared memory, registers)
                    print(f"  skip {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                    continue
                results.append((us, cfg))
            for us, cfg in sorted(results, key=lambda r: r[0])[:6]:
                say(f"  sweep {us:9.1f} us {flops / us / 1e6:7.1f} TFLOP/s  {cfg}")
    if args.out:
        Path(args.out).write_text(section(log, " ".join(argv)))
    return 0


def section(log: list[str], argv: str) -> str:
    """The run as a BENCHMARKS.md section (merged with --merge)."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"## Prefill indexer: shared-key kernel vs per-token kernel\n\n"
        f"- command: `dsv4 bench kernels indexer-prefill {argv}`\n- date: {when}; torch {torch.__version__}\n"
        f'- "per-token" is the decode kernel (dsv4_kernels/triton_indexer.py) run over every query; '
        f'"prefill" is '
        f"dsv4_kernels/triton_indexer_prefill.py (a block of one sequence's queries shares each key tile through "
        f"tl.dot); the compare line checks its scores and ids against the per-token kernel's\n\n"
        "```\n" + "\n".join(log).strip() + "\n```\n"
    )


if __name__ == "__main__":
    sys.exit(main())
