"""Top-k columns of each row of fp32 scores by radix select, one program a row (Triton).

Why: the indexer picks 512 of its candidates per query, and torch.topk runs a row as one thread block. This
kernel also runs a row on one SM, and each of its five passes costs the same whatever the row count, so it wins
on many rows of few candidates and not on one long row (small batches at long contexts: those take
dsv4_kernels.triton_topk_split); the engine uses it only where it measured faster
(dsv4_kernels.triton_indexer.topk_of_scores; BENCHMARKS.md, "Indexer top-k: radix select vs torch.topk").
Holding the whole row in one block with more warps did not help at batch 1; a wider first digit or a
multi-program first pass are what is left.

Contract (what the attention kernels take, `topk_of_scores(..., ordered=False)`): int64 [T, k], the columns of
the k largest scores of each row as a set in no particular order; ties at the k-th value go to the lowest
columns (-0.0 orders below +0.0: their keys differ); -1 where the pick is -inf (an invalid candidate) and in the slots
past the row's length when S < k.

Method: an fp32 score maps to a uint32 key whose unsigned order is the float order (flip the sign bit of a
positive, every bit of a negative). Four passes of 8-bit radix select find the k-th largest key: each pass
histograms one digit of the keys that match the digits chosen so far (tl.histogram; keys that do not match go
to an extra bin), and keeps the digit where the count from the top reaches what is still wanted. A fifth pass
writes the columns above that key in column order, then the first ties.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

MAX_BLOCK = 4096  # scores a program holds at once; longer rows loop over blocks of this size
NUM_WARPS: int | None = None  # None: 8 warps from 2048-score blocks, else 4 (dsv4 bench kernels topk --sweep sets it)
NEG_INF_KEY = tl.constexpr(0x007FFFFF)  # the key of -inf (a constexpr: read inside the kernel)


@triton.jit
def order_keys(x):
    """fp32 -> uint32 keys in the same order (unsigned)."""
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # all ones for a negative, the sign bit for a positive
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _topk_kernel(scores, out, S, K, stride_s, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = scores + row * stride_s
    dst = out + row * stride_o
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 512)
    want = tl.minimum(K, S)
    remaining = want  # picks still to place at or below the prefix chosen so far
    prefix = tl.full([], 0, tl.uint32)
    chosen = tl.full([], 0, tl.uint32)  # bits of the key fixed by earlier passes
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # the digit's lowest bit (a constexpr, as p is)
        hist = tl.zeros([512], dtype=tl.int32)
        for start in range(0, S, BLOCK):
            inside = start + offs < S
            key = order_keys(tl.load(src + start + offs, mask=inside, other=0.0))
            match = inside & ((key & chosen) == prefix)
            digit = tl.where(match, ((key >> shift) & 255).to(tl.int32), 256)
            hist += tl.histogram(digit, 512)
        real = bins < 256
        matched = tl.sum(tl.where(real, hist, 0))
        at_or_above = matched - tl.cumsum(hist, 0) + hist  # keys with this digit or a larger one
        pick = tl.maximum(tl.max(tl.where(real & (at_or_above >= remaining), bins, -1)), 0)
        remaining -= tl.sum(tl.where(bins == pick, at_or_above - hist, 0))  # those above `pick` are all in
        prefix = prefix | (pick.to(tl.uint32) << shift)
        chosen = chosen | tl.full([], 255 << shift, tl.uint32)
    # prefix is now the k-th largest key; `remaining` of the keys equal to it are picked
    above = want - remaining
    n_above = tl.full([], 0, tl.int32)
    n_tied = tl.full([], 0, tl.int32)
    for start in range(0, S, BLOCK):
        inside = start + offs < S
        key = order_keys(tl.load(src + start + offs, mask=inside, other=0.0))
        gt = inside & (key > prefix)
        eq = inside & (key == prefix)
        gt_at = n_above + tl.cumsum(gt.to(tl.int32), 0) - 1
        eq_at = n_tied + tl.cumsum(eq.to(tl.int32), 0) - 1
        col = tl.where(key == NEG_INF_KEY, -1, start + offs).to(tl.int64)
        tl.store(dst + gt_at, col, mask=gt)
        tl.store(dst + above + eq_at, col, mask=eq & (eq_at < remaining))
        n_above += tl.sum(gt.to(tl.int32))
        n_tied += tl.sum(eq.to(tl.int32))
    for start in range(want, K, BLOCK):  # rows shorter than k
        tl.store(dst + start + offs, tl.full([BLOCK], -1, tl.int64), mask=start + offs < K)


def topk_arguments(scores: torch.Tensor, k: int, caller: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The radix top-k kernels' checks (a ValueError naming `caller`) -> (scores with unit column stride, the
    int64 [T, k] output to fill)."""
    require_triton(scores.device)
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"{caller} takes fp32 [T, S] scores, got {scores.dtype} {tuple(scores.shape)}")
    if k < 1:
        raise ValueError(f"{caller} needs k >= 1, got {k}")
    out = torch.empty((scores.shape[0], k), dtype=torch.int64, device=scores.device)
    return (scores if scores.stride(1) == 1 else scores.contiguous()), out


def topk_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: fp32 [T, S] (-inf = invalid) -> int64 [T, k]: the columns of each row's k largest scores, unordered,
    -1 for invalid picks and past S (module docstring). Equal as a set to torch.topk's picks up to ties."""
    scores, out = topk_arguments(scores, k, "topk_columns")
    t, s = scores.shape
    if t == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(max(s, k, 16)))
    _topk_kernel[(t,)](
        scores,
        out,
        s,
        k,
        scores.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=NUM_WARPS or (8 if block >= 2048 else 4),
        **pdl_kwargs(scores),
    )
    return out
