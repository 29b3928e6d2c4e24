"""The indexer's top-k: dsv4_kernels.triton_topk (radix select, one program a row), triton_topk_split (a row
over several programs), triton_topk_sort (bitonic) and triton_topk_rank (rank counting) against torch.topk
(sorted=False, with the -1 mask the engine applies), by (rows, candidates) (CUDA only; a script, not a test).

Rows are queries (decode: the batch; prefill: the chunk's tokens), candidates the visible 4:1 entries (context / 4;
a prefill row sees its causal prefix: the rest is -inf). k = 512, V4's index_topk. Each time is the median of
CUDA-graph replays of 20 calls (triton.testing.do_bench_cudagraph), so host launch cost is out, as in decode.
Both outputs are checked equal as sets (sorted picked values) before timing.
--sweep also times the kernel's block size and warps (triton_topk.MAX_BLOCK, NUM_WARPS) at decode shapes.
Usage: dsv4 bench kernels topk [--out FILE] [--sweep]
       dsv4 bench kernels topk --merge FILE   # an --out table -> BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from benchmarks.timing import bench_cudagraph

K = 512
RANK_MAX_WORK = 1 << 28  # rows x candidates^2 the rank-counting kernel is timed up to (its work grows as S^2)
# (rows, candidates, causal): decode at batch 1 / 64 / 128 and contexts 4K / 32K / 128K; prefill chunks
SHAPES = [
    (1, 1024, False),
    (1, 2048, False),
    (1, 4096, False),
    (2, 2048, False),
    (4, 1024, False),
    (4, 2048, False),
    (16, 2048, False),
    (1, 8192, False),
    (1, 8256, False),
    (1, 32768, False),
    (4, 8192, False),
    (16, 8192, False),
    (16, 32768, False),
    (32, 8192, False),
    (64, 1024, False),
    (64, 8192, False),
    (128, 8192, False),
    (128, 32768, False),
    (2048, 2048, True),
    (8192, 2048, True),
]


def scores_for(rows: int, cands: int, causal: bool, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(rows * 7 + cands)
    x = torch.randn(rows, cands, generator=g, device=device)
    if causal:  # row t of a prompt's last `rows` tokens sees (cands - rows + t + 1) / ... entries: its prefix
        seen = torch.linspace(cands / rows, cands, rows, device=device).long()
        x = x.masked_fill(torch.arange(cands, device=device) >= seen[:, None], float("-inf"))
    return x


def torch_topk(x: torch.Tensor) -> torch.Tensor:
    top = x.topk(K, dim=-1, sorted=False)
    return torch.where(top.values > float("-inf"), top.indices, torch.full_like(top.indices, -1))


def same_sets(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    def vals(idx):
        v = torch.where(idx >= 0, x.gather(1, idx.clamp(min=0)), torch.full_like(x[:, :1], float("-inf")))
        return v.sort(dim=1).values

    return torch.equal(vals(a), vals(b))


def section(table: str) -> str:
    return "\n".join(
        [
            "## Indexer top-k: radix select, bitonic sort vs torch.topk (`dsv4 bench kernels topk`)",
            "",
            "k = 512 of each row's candidates (the indexer's picks), fp32 scores; each time the median of CUDA-graph "
            "replays. `dsv4_kernels.triton_topk`: one program a row, four 8-bit radix passes to find the 512th key "
            "and one pass to write the picks (unordered, what the attention kernels take). "
            "`dsv4_kernels.triton_topk_split`: the same passes with each row split over up to 128 programs of 256+ "
            "columns, meeting through global histograms (a memset and five launches). "
            "`dsv4_kernels.triton_topk_sort`: a row of up to 8192 candidates packed as 64-bit (score key, column) "
            'values and cut to its 512 largest by Triton\'s bitonic `tl.topk`, one program a row. "engine rule": '
            "what `triton_indexer.topk_of_scores(ordered=False)` picks for the shape.",
            "",
            table.strip(),
            "",
            "Since 2026-12-06 18:20 a fourth kernel comes first: `dsv4_kernels.triton_topk_rank` counts each "
            "score's rank against its whole row (one launch, 16 scores a program) and takes steps of at most 256 rows "
            "with rows x candidates^2 <= `$DSV4_TOPK_RANK_MAX_WORK` (2^25): 3.0 / 4.4 / 7.0 / 8.3 us at 1 x 1024, "
            "1 x 2048, 4 x 2048, 1 x 4096 on an H100, 20.2 at 1 x 8192 (a tie with the split kernel, so not taken "
            "there); its column is in the table when the run is newer (BENCHMARKS.md decode_launches has the sweep). "
            "The rule taken from these (`triton_indexer.topk_of_scores`) for the other steps: at most 256 rows of at most "
            "1024 candidates take the bitonic sort (8.9 against the radix kernel's 11.4 us at 1 x 1024 on an H100, "
            "9.5 against 11.9 at 64 x 1024; from 2048 candidates it loses, 2x at 8192: its work grows as n log^2 n; "
            "`$DSV4_TOPK_SORT_MAX_CANDIDATES`); at most 32 rows of at least 4096 candidates (and at most 32 x 8192 "
            "scores) take the split kernel (2.0-2.3x torch.topk at 1-16 rows, where torch and the one-program "
            "kernel run a row on one SM: 43-53 us); other steps of at most 256 rows over at most 8192 candidates "
            "take the one-program radix kernel (1.2-1.4x), the rest torch.topk (long prefill chunks: the radix "
            "kernels' passes cost more there). The H200 run of 2026-12-04 16:52 (no sort column) gave the same "
            "order: radix one program 11.6 us at 1 x 1024, split 20.4 at 1 x 8192. The 2026-12-06 12:10 run's "
            '"engine rule" column timed that run\'s provisional rule (the sort up to 2048 candidates: its 1 x 2048 '
            "and 16 x 2048 rows); the rule above was set from the kernels' columns.",
        ]
    )


def sweep(dev) -> None:
    """Radix kernel times by (MAX_BLOCK, NUM_WARPS) at the decode shapes, picks checked against torch.topk."""
    from dsv4_kernels import triton_topk

    saved = triton_topk.MAX_BLOCK, triton_topk.NUM_WARPS
    try:
        for rows, cands in ((1, 8192), (1, 32768), (64, 8192)):
            x = scores_for(rows, cands, False, dev)
            for block in (4096, 8192, 16384):
                for warps in (8, 16, 32):
                    triton_topk.MAX_BLOCK, triton_topk.NUM_WARPS = block, warps
                    same = same_sets(x, triton_topk.topk_columns(x, K), torch_topk(x))
                    us = bench_cudagraph(lambda: triton_topk.topk_columns(x, K), rep=50)
                    print(
                        f"  sweep rows={rows} candidates={cands} MAX_BLOCK={block} NUM_WARPS={warps}: {us:.1f} us, "
                        f"same picks {same}",
                        flush=True,
                    )
    finally:
        triton_topk.MAX_BLOCK, triton_topk.NUM_WARPS = saved


def sweep_rank(dev) -> None:
    """Rank-counting kernel times by (BLOCK_I, BLOCK_J, NUM_WARPS) at batch-1..4 decode shapes, then in two launches
    by segment length at long rows; picks checked."""
    from dsv4_kernels import triton_topk_rank as rank

    saved = rank.BLOCK_I, rank.BLOCK_J, rank.NUM_WARPS
    try:
        for rows, cands in ((1, 1024), (1, 2048), (4, 2048), (1, 4096), (1, 8192)):
            x = scores_for(rows, cands, False, dev)
            for bi, bj, warps in ((8, 128, 2), (16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 8), (64, 128, 8)):
                rank.BLOCK_I, rank.BLOCK_J, rank.NUM_WARPS = bi, bj, warps
                same = same_sets(x, rank.topk_columns_ranked(x, K), torch_topk(x))
                us = bench_cudagraph(lambda: rank.topk_columns_ranked(x, K), rep=50)
                print(
                    f"  sweep rank rows={rows} candidates={cands} BLOCK_I={bi} BLOCK_J={bj} NUM_WARPS={warps}: "
                    f"{us:.1f} us, same picks {same}",
                    flush=True,
                )
    finally:
        rank.BLOCK_I, rank.BLOCK_J, rank.NUM_WARPS = saved
    for rows, cands in ((1, 8192), (2, 8192), (1, 12288), (1, 16384)):  # two launches ($DSV4_TOPK_RANK_SEGMENT)
        x = scores_for(rows, cands, False, dev)
        for segment in (1024, 2048, 4096):
            same = same_sets(x, rank.topk_columns_ranked(x, K, segment=segment), torch_topk(x))
            us = bench_cudagraph(lambda: rank.topk_columns_ranked(x, K, segment=segment), rep=50)
            print(f"  sweep rank rows={rows} candidates={cands} segment={segment}: {us:.1f} us, same picks {same}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4 bench kernels topk", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    ap.add_argument("--merge", default=None, help="put this --out table into BENCHMARKS.md and exit")
    ap.add_argument("--sweep", action="store_true", help="also time the block sizes and warps at decode shapes")
    args = ap.parse_args(argv)
    if args.merge:
        from service.benchmarks_md import write_section

        write_section("indexer_topk", section(Path(args.merge).read_text()))
        print(f"merged {args.merge} into BENCHMARKS.md")
        return 0
    if not torch.cuda.is_available():
        print("dsv4 bench kernels topk: needs a CUDA GPU", file=sys.stderr)
        return 1
    from dsv4_kernels.triton_indexer import topk_of_scores
    from dsv4_kernels.triton_topk import topk_columns
    from dsv4_kernels.triton_topk_rank import topk_columns_ranked
    from dsv4_kernels.triton_topk_sort import SORT_MAX_CANDIDATES, topk_columns_sorted
    from dsv4_kernels.triton_topk_split import topk_columns_split

    dev = torch.device("cuda")
    rows_out = []
    for rows, cands, causal in SHAPES:
        x = scores_for(rows, cands, causal, dev)
        want = torch_topk(x)
        sortable = cands <= SORT_MAX_CANDIDATES
        rankable = rows * cands * cands <= RANK_MAX_WORK
        impls = (topk_columns, topk_columns_split) + ((topk_columns_sorted,) if sortable else ())
        impls += (topk_columns_ranked,) if rankable else ()
        same = all(same_sets(x, f(x, K), want) for f in impls)
        t_torch = bench_cudagraph(lambda: torch_topk(x), rep=50)
        t_radix = bench_cudagraph(lambda: topk_columns(x, K), rep=50)
        t_split = bench_cudagraph(lambda: topk_columns_split(x, K), rep=50)
        t_sort = bench_cudagraph(lambda: topk_columns_sorted(x, K), rep=50) if sortable else float("nan")
        t_rank = bench_cudagraph(lambda: topk_columns_ranked(x, K), rep=50) if rankable else float("nan")
        t_rule = bench_cudagraph(lambda: topk_of_scores(x, K, ordered=False), rep=50)
        rows_out.append((rows, cands, causal, t_torch, t_radix, t_split, t_sort, t_rank, t_rule, same))
        print(
            f"topk rows={rows} candidates={cands}{' causal' if causal else ''}: torch {t_torch:.1f} us, "
            f"radix {t_radix:.1f} us, split {t_split:.1f} us, sort {t_sort:.1f} us, rank {t_rank:.1f} us, "
            f"engine rule {t_rule:.1f} us "
            f"({t_torch / t_rule:.2f}x torch), same picks {same}",
            flush=True,
        )
    if args.sweep:
        sweep_rank(dev)
        sweep(dev)
    lines = [
        "- command: `dsv4 bench kernels topk`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
        "",
        "| rows | candidates | causal | torch.topk us | radix, one program us | radix, split us | bitonic sort us | "
        "rank count us | engine rule us | rule vs torch | same picks |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r} | {c} | {'yes' if cz else 'no'} | {a:.1f} | {b:.1f} | {sp:.1f} | "
        f"{'n/a' if so != so else f'{so:.1f}'} | {'n/a' if rk != rk else f'{rk:.1f}'} | {ru:.1f} | {a / ru:.2f}x | "
        f"{s} |"
        for r, c, cz, a, b, sp, so, rk, ru, s in rows_out
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(r[-1] for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
