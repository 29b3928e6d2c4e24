"""Top-k columns of each row of fp32 scores by counting ranks: one launch, many programs a row (Triton).

Why: at batch 1 the decode step's indexer picks 512 of 1-2K candidates twice, and the radix kernels
(dsv4_kernels.triton_topk, triton_topk_split) spend ~20 us on it: their five passes over the row are a chain of
dependent reductions, in one program (a row on one SM) or in six launches meeting through global histograms.
For short rows the work is small enough to do it the other way: every score's rank is the number of scores
that come before it, counted by comparing it with the whole row. That is S^2 comparisons a row (4M at 2048
candidates), spread over S / BLOCK_I programs with no pass depending on another, so a row takes one launch
whatever k is. The work grows as rows x S^2, so the engine takes this kernel only for steps under a work bound
(dsv4_kernels.triton_indexer.takes_rank_topk, $DSV4_TOPK_RANK_MAX_WORK; BENCHMARKS.md, "Indexer top-k").

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
    scores, out, S, K, stride_s, stride_o, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr
):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    src = scores + row * stride_s
    dst = out + row * stride_o
    mine = part * BLOCK_I + tl.arange(0, BLOCK_I)
    inside = mine < S
    key = order_keys(tl.load(src + mine, mask=inside, other=0.0))
    # Counts kept per (score, lane) and summed once at the end: a reduction per block of the row would cost more
    # than the comparisons.
    ahead = tl.zeros([BLOCK_I, BLOCK_J], dtype=tl.int32)
    others = tl.arange(0, BLOCK_J)
    for start in range(0, S, BLOCK_J):
        col = start + others
        # Past S: -inf, the smallest key, in a column above every score's: never ahead of one.
        other = order_keys(tl.load(src + col, mask=col < S, other=float("-inf")))
        # `other` comes before a score when larger, or equal in a lower column (ties to the lowest columns)
        before = (other[None, :] > key[:, None]) | ((other[None, :] == key[:, None]) & (col[None, :] < mine[:, None]))
        ahead += before.to(tl.int32)
    rank = tl.sum(ahead, axis=1)
    pick = tl.where(key == NEG_INF_KEY, -1, mine).to(tl.int64)
    tl.store(dst + rank, pick, mask=inside & (rank < K))
    if part == 0:  # rows shorter than k: the slots past S
        for start in range(S, K, BLOCK_I):
            slot = start + tl.arange(0, BLOCK_I)
            tl.store(dst + slot, tl.full([BLOCK_I], -1, tl.int64), mask=slot < K)


def topk_columns_ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: fp32 [T, S] (-inf = invalid) -> int64 [T, k]: the columns of each row's k largest scores, -1 for
    invalid picks and past S (module docstring). Equal as a set to torch.topk's picks up to ties."""
    scores, out = topk_arguments(scores, k, "topk_columns_ranked")
    t, s = scores.shape
    if t == 0:
        return out
    _rank_topk_kernel[(t, max(1, triton.cdiv(s, BLOCK_I)))](
        scores,
        out,
        s,
        k,
        scores.stride(0),
        out.stride(0),
        BLOCK_I=BLOCK_I,
        BLOCK_J=BLOCK_J,
        num_warps=NUM_WARPS,
        **pdl_kwargs(scores),
    )
    return out
