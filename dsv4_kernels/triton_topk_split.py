"""Top-k columns of a few long rows: radix select with each row split over many programs (Triton).

Why: at batch 1 the indexer picks 512 of 8192 candidates (context 32K) or more. torch.topk and the one-program
radix kernel (dsv4_kernels.triton_topk) both run such a row on one SM: ~50 us a CSA layer on the H200, two of
the largest items of a batch-1 decode step. Here P programs share a row, each over a contiguous chunk of its
columns, and the passes meet through global histograms: five launches of one kernel (PASS 0-3 histogram, PASS 4
writes) after one memset, each short at small batches.

Contract: that of triton_topk.topk_columns (int64 [T, k], the columns of each row's k largest scores as a set in
no particular order; ties at the k-th value go to the lowest columns; -1 where the pick is -inf and past the
row's length when S < k), so either kernel serves `triton_indexer.topk_of_scores`.

Method (keys and digits as in triton_topk: fp32 -> order-preserving uint32 keys, four 8-bit digits from the top):
- PASS p < 4: every program derives the digits of passes < p from the global histograms (each program the same
  scalars), histograms digit p of its chunk's keys that match them, and adds its bins into histogram p of the row
  (atomics; a zeroed work buffer). The k-th largest key K is fixed once PASS 3 is summed, and with it `remaining`:
  how many keys equal to K are picked (the ties).
- PASS 4: keys above K, and keys equal to K when all of them are picked, take output slots from the row's
  atomic counter, a block at a time. When more keys equal K than are picked, the ties go by column: a program
  first counts the ties in the chunks before its own (rare: only when equal scores straddle the k-th place).
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait
from dsv4_kernels.triton_topk import NEG_INF_KEY, order_keys, topk_arguments

triton, tl = import_triton()

BINS = 256  # one 8-bit digit; the kernel's histograms carry an extra bin for keys that do not match
WORK = 4 * BINS + 1  # int32 per row: four digit histograms + the output slot counter
MIN_CHUNK = 256  # columns a program takes at least
MAX_PROGRAMS = 128  # programs a call spreads its rows over (few rows only: see programs_per_row)


@triton.jit
def _descend(work, want, PASSES: tl.constexpr):
    """The digits of the first PASSES passes from the row's histograms -> (prefix, chosen bits, remaining wanted
    at or below the prefix, how many keys match the prefix)."""
    bins = tl.arange(0, 256)
    remaining = want
    prefix = tl.full([], 0, tl.uint32)
    chosen = tl.full([], 0, tl.uint32)
    matched = tl.full([], 0, tl.int32)
    for p in tl.static_range(PASSES):
        shift = 24 - 8 * p
        hist = tl.load(work + p * 256 + bins)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # keys with this digit or a larger one
        pick = tl.maximum(tl.max(tl.where(at_or_above >= remaining, bins, -1)), 0)
        remaining -= tl.sum(tl.where(bins == pick, at_or_above - hist, 0))  # those above `pick` are all in
        matched = tl.sum(tl.where(bins == pick, hist, 0))
        prefix = prefix | (pick.to(tl.uint32) << shift)
        chosen = chosen | tl.full([], 255 << shift, tl.uint32)
    return prefix, chosen, remaining, matched


@triton.jit
def _split_topk_kernel(
    scores, out, work, S, K, CHUNK, stride_s, stride_o, PASS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    prog = tl.program_id(1)
    src = scores + row * stride_s
    dst = out + row * stride_o
    wrk = work + row * (4 * 256 + 1)
    offs = tl.arange(0, BLOCK)
    lo = prog * CHUNK
    hi = tl.minimum(lo + CHUNK, S)
    want = tl.minimum(K, S)
    prefix, chosen, remaining, matched = _descend(wrk, want, PASS)
    if PASS < 4:
        shift = 24 - 8 * PASS
        bins = tl.arange(0, 512)
        hist = tl.zeros([512], dtype=tl.int32)
        for start in range(lo, hi, BLOCK):
            inside = start + offs < hi
            key = order_keys(tl.load(src + start + offs, mask=inside, other=0.0))
            match = inside & ((key & chosen) == prefix)
            hist += tl.histogram(tl.where(match, ((key >> shift) & 255).to(tl.int32), 256), 512)
        tl.atomic_add(wrk + PASS * 256 + bins, hist, mask=(bins < 256) & (hist > 0))
    else:
        # prefix is the k-th largest key; `remaining` of the `matched` keys equal to it are picked
        above = want - remaining
        all_ties = matched <= remaining
        tied_before = tl.full([], 0, tl.int32)
        if not all_ties:  # ties go by column: count those in the chunks before this one
            for start in range(0, lo, BLOCK):
                key = order_keys(tl.load(src + start + offs, mask=start + offs < lo, other=0.0))
                tied_before += tl.sum(((start + offs < lo) & (key == prefix)).to(tl.int32))
        for start in range(lo, hi, BLOCK):
            inside = start + offs < hi
            key = order_keys(tl.load(src + start + offs, mask=inside, other=0.0))
            eq = inside & (key == prefix)
            take = inside & (key > prefix)
            if all_ties:
                take = take | eq
            n = tl.sum(take.to(tl.int32))
            base = tl.atomic_add(wrk + 4 * 256, n)  # slots [base, base + n) of the row's output
            at = base + tl.cumsum(take.to(tl.int32), 0) - 1
            col = tl.where(key == NEG_INF_KEY, -1, start + offs).to(tl.int64)
            tl.store(dst + at, col, mask=take)
            if not all_ties:
                eq_at = tied_before + tl.cumsum(eq.to(tl.int32), 0) - 1
                tl.store(dst + above + eq_at, col, mask=eq & (eq_at < remaining))
                tied_before += tl.sum(eq.to(tl.int32))
        if prog == 0:  # rows shorter than k
            for start in range(want, K, BLOCK):
                tl.store(dst + start + offs, tl.full([BLOCK], -1, tl.int64), mask=start + offs < K)


def programs_per_row(rows: int, candidates: int) -> int:
    """P: up to MAX_PROGRAMS programs over the call, each over at least MIN_CHUNK columns."""
    return max(1, min(triton.cdiv(candidates, MIN_CHUNK), MAX_PROGRAMS // max(rows, 1)))


def topk_columns_split(scores: torch.Tensor, k: int, programs: int | None = None) -> torch.Tensor:
    """scores: fp32 [T, S] (-inf = invalid) -> int64 [T, k], as triton_topk.topk_columns (module docstring).
    programs: per row (default programs_per_row). Six launches (a memset, five passes), no host sync."""
    scores, out = topk_arguments(scores, k, "topk_columns_split")
    t, s = scores.shape
    if t == 0:
        return out
    p = programs or programs_per_row(t, s)
    chunk = triton.cdiv(max(s, 1), p)
    p = triton.cdiv(max(s, 1), chunk)  # no empty programs
    block = min(1024, triton.next_power_of_2(max(chunk, 16)))
    work = torch.zeros((t, WORK), dtype=torch.int32, device=scores.device)
    extra = {"num_warps": 4} if scores.is_cuda else {}
    for pass_ in range(5):
        _split_topk_kernel[(t, p)](
            scores,
            out,
            work,
            s,
            k,
            chunk,
            scores.stride(0),
            out.stride(0),
            PASS=pass_,
            BLOCK=block,
            **extra,
            **pdl_kwargs(scores),
        )
    return out
