"""Top-k columns of each row of fp32 scores by counting ranks: one launch, many programs a row (Triton).

Why: at batch 1 the decode step's indexer picks 512 of 1-2K candidates twice, and the radix kernels
(dsv4_kernels.triton_topk, triton_topk_split) spend ~20 us on it: their five passes over the row are a chain of
dependent reductions, in one program (a row on one SM) or in six launches meeting through global histograms.
For short rows the work is small enough to do it the other way: every score's rank is the number of scores
that come before it, counted by comparing it with the whole row. That is S^2 comparisons a row (4M at 2048
candidates), spread over S / BLOCK_I programs with no pass depending on another, so a row takes one launch
whatever k is. The work grows as rows x S^2, so the engine takes this kernel only for steps under a work bound
(dsv4_kernels.triton_indexer.rank_topk_segment, $DSV4_TOPK_RANK_MAX_WORK; BENCHMARKS.md, "Indexer top-k").
Longer rows may take it in two launches ($DSV4_TOPK_RANK_SEGMENT, 2048: batch 1 at 8192 candidates, a 32K context,
15.2 us against ~20 on an H100): each piece keeps its k best, then those are ranked (`topk_columns_ranked(segment=)`).

Contract: the radix kernels' (dsv4_kernels.triton_topk's docstring). int64 [T, k], the columns of the k largest
scores of each row; here they come out ordered (slot r holds the score of rank r) because a score's rank is where
it is written, but callers must not rely on it (the engine asks for ordered=False). Ties go to the lowest columns
(a score is ahead of an equal one in a higher column), -0.0 below +0.0 (keys, as the radix kernels), -1 where the
pick is -inf and past S when S < k.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait
from dsv4_kernels.triton_topk import NEG_INF_KEY, order_keys, topk_arguments

triton, tl = import_triton()

BLOCK_I = 16  # scores a program ranks
BLOCK_J = 256  # scores it compares them with at a time
NUM_WARPS = 4  # (dsv4 bench kernels topk --sweep sets these three)


@triton.jit
def _rank_topk_kernel(
    scores,
    cols,
    out,
    S,
    SEG,
    K,
    stride_s,
    stride_c,
    stride_o,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
    INDIRECT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Each SEG-long segment of a row (SEG a multiple of BLOCK_I; SEG >= S: the whole row) ranked on its own: its k
    best go to out[row, seg * K + rank]. INDIRECT: entry j of a row is column cols[row, j] of scores (-1: -inf), and
    the pick written is that column."""
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_I
    seg_start = (first // SEG) * SEG
    seg_end = tl.minimum(seg_start + SEG, S)
    src = scores + row * stride_s
    dst = out + row * stride_o + (first // SEG) * K
    mine = first + tl.arange(0, BLOCK_I)
    inside = mine < seg_end
    if INDIRECT:
        col_i = tl.load(cols + row * stride_c + mine, mask=inside, other=-1)
        key = order_keys(tl.load(src + col_i, mask=col_i >= 0, other=float("-inf")))
    else:
        col_i = mine
        key = order_keys(tl.load(src + mine, mask=inside, other=0.0))
    # Counts kept per (score, lane) and summed once at the end: a reduction per block of the row would cost more
    # than the comparisons.
    ahead = tl.zeros([BLOCK_I, BLOCK_J], dtype=tl.int32)
    others = tl.arange(0, BLOCK_J)
    for start in range(seg_start, seg_end, BLOCK_J):
        at = start + others
        # Past the segment: -inf, the smallest key, at a position above every score's: never ahead of one.
        if INDIRECT:
            col_j = tl.load(cols + row * stride_c + at, mask=at < seg_end, other=-1)
            other = order_keys(tl.load(src + col_j, mask=col_j >= 0, other=float("-inf")))
        else:
            other = order_keys(tl.load(src + at, mask=at < seg_end, other=float("-inf")))
        # `other` comes before a score when larger, or equal at a lower position (ties to the lowest columns: an
        # indirect row lists its columns so that equal scores stand in column order, topk_columns_ranked)
        before = (other[None, :] > key[:, None]) | ((other[None, :] == key[:, None]) & (at[None, :] < mine[:, None]))
        ahead += before.to(tl.int32)
    rank = tl.sum(ahead, axis=1)
    pick = tl.where(key == NEG_INF_KEY, -1, col_i).to(tl.int64)
    tl.store(dst + rank, pick, mask=inside & (rank < K))
    if first == seg_start:  # segments shorter than k: the slots past their length
        for start in range(seg_end - seg_start, K, BLOCK_I):
            slot = start + tl.arange(0, BLOCK_I)
            tl.store(dst + slot, tl.full([BLOCK_I], -1, tl.int64), mask=slot < K)


def topk_columns_ranked(scores: torch.Tensor, k: int, segment: int = 0) -> torch.Tensor:
    """scores: fp32 [T, S] (-inf = invalid) -> int64 [T, k]: the columns of each row's k largest scores, -1 for
    invalid picks and past S (module docstring). Equal as a set to torch.topk's picks up to ties.

    segment > 0 (a multiple of BLOCK_I) and S > segment: two launches. The first ranks each segment-long piece of
    a row on its own and keeps its k best (a score outside its piece's k best is outside the row's); the second
    ranks those survivors, listed piece by piece each in rank order, so equal scores stand in column order and its
    tie-break by position is the row's by column. Comparisons: S x segment + (pieces x k)^2 a row instead of S^2."""
    scores, out = topk_arguments(scores, k, "topk_columns_ranked")
    t, s = scores.shape
    if segment and segment % BLOCK_I:
        raise ValueError(f"topk_columns_ranked: segment must be a multiple of {BLOCK_I}, got {segment}")
    if t == 0:
        return out
    if not segment or s <= segment:
        _launch(scores, scores, out, s, max(s, 1), k, indirect=False)
        return out
    survivors = torch.empty((t, triton.cdiv(s, segment) * k), dtype=torch.int64, device=scores.device)
    _launch(scores, scores, survivors, s, segment, k, indirect=False)
    n = survivors.shape[1]
    _launch(scores, survivors, out, n, n, k, indirect=True)
    return out


def _launch(scores, cols, out, s: int, seg: int, k: int, indirect: bool) -> None:
    blocks = triton.cdiv(max(s, 1), BLOCK_I)
    _rank_topk_kernel[(scores.shape[0], blocks)](
        scores,
        cols,
        out,
        s,
        seg,
        k,
        scores.stride(0),
        cols.stride(0),
        out.stride(0),
        BLOCK_I=BLOCK_I,
        BLOCK_J=BLOCK_J,
        INDIRECT=indirect,
        num_warps=NUM_WARPS,
        **pdl_kwargs(scores),
    )
