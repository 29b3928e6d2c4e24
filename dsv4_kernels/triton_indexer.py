"""Triton lightning-indexer logits over paged key rows, then top-k with -1 padding.

Reference: `dsv4_kernels.indexer.indexer_scores` + `topk_visible`. For query t and candidate s (row rows[t, s]
of a key store, -1 = not visible; or, as the engine passes them, rows[seg[t], s] for s < count[t]: per-request
candidates and per-token visible counts, dsv4_kernels.indexer's module docstring):
    score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . key[rows[t, s]]) * Di^-0.5,   -inf when invalid.
One program scores BLOCK_S candidates of one token against all its index heads with a single
[BLOCK_S, Di] x [Di, Hi] dot, so keys are read once per token straight from the store (no [T, S, Di]
gather). Decode has few tokens but thousands of candidates, so the grid is (T, S / BLOCK_S).

Key stores (plain rows or the paged FP8 / MXFP4 indexer cache, dequantised in registers): see
dsv4_kernels/triton_index_keys.py. Prefill-shaped steps (many queries per sequence, all seeing one prefix of
the same keys) go to dsv4_kernels/triton_indexer_prefill.py when `indexer_topk` is given the step's cu_seqlens.

Selection: unordered picks on CUDA of decode-sized steps over at most 8192 candidates take the radix-select kernel
(dsv4_kernels/triton_topk.py), where it measured 1.0-1.4x torch.topk; ordered picks, longer rows and prefill
chunks take torch.topk. As in the reference, near-ties may order differently
from another implementation whose scores differ in the last bits.

Interpreter note: bf16 values are converted to fp32 right after loading (triton 3.x's interpreter does
bf16 arithmetic on the raw bits); the GPU path feeds bf16 operands to tl.dot.
"""

from __future__ import annotations

import torch

from dsv4_kernels.geometry import IndexerKeyLayout
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.indexer import SCORES_BUDGET, check_candidates, query_blocks, token_candidates
from dsv4_kernels.settings import settings
from dsv4_kernels.triton_index_keys import bf16_dot, check_index_keys, key_format, tl_load_index_keys
from dsv4_kernels.triton_indexer_prefill import indexer_prefill_scores
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


@triton.jit
def _indexer_scores_kernel(
    q_ptr,
    k_ptr,
    rows_ptr,
    seg_ptr,
    count_ptr,
    w_ptr,
    out_ptr,
    HI,
    DI,
    S,
    scale,
    block_size,
    stride_qt,
    stride_qh,
    stride_kr,
    stride_rt,
    stride_wt,
    stride_ot,
    HI_P: tl.constexpr,
    DI_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FMT: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BF16_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cand = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    heads = tl.arange(0, HI_P)
    cols = tl.arange(0, DI_P)
    hmask = heads < HI
    cmask = cols < DI
    # token t's candidates: row seg[t] of rows, its first count[t] columns (module docstring)
    b = tl.load(seg_ptr + t).to(tl.int64)
    n = tl.load(count_ptr + t)
    r = tl.load(rows_ptr + b * stride_rt + cand, mask=(cand < S) & (cand < n), other=-1).to(tl.int64)
    ok = r >= 0
    r = tl.where(ok, r, 0)
    keys = tl_load_index_keys(
        k_ptr, r, ok, cols, cmask, DI, stride_kr, block_size, VALUE_BYTES, SCALE_BYTES, FMT, DI_P, BLOCK_S
    )
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :],
        mask=hmask[:, None] & cmask[None, :],
        other=0.0,
    ).to(tl.float32)
    if BF16_DOT:
        dots = tl.dot(keys.to(tl.bfloat16), tl.trans(q.to(tl.bfloat16)))
    else:
        dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
    # Padded heads load w = 0, so they add nothing.
    w = tl.load(w_ptr + t * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    score = tl.sum(tl.maximum(dots, 0.0) * scale * w[None, :], axis=1)
    score = tl.where(ok, score, float("-inf"))
    tl.store(out_ptr + t * stride_ot + cand, score, mask=cand < S)


def indexer_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    layout: IndexerKeyLayout | None = None,
    *,
    block_s: int = 64,
    seg: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer logits of each token's candidates, read from a key store.

    q: [T, Hi, Di] fp32/bf16 (last dim contiguous); rows: int32/int64 [R, S], -1 = invalid; token t's candidates
    are row seg[t] of rows (seg: int [T], default arange: R = T), its first count[t] columns (count: int [T],
    default S; the rest are invalid): the engine passes each request's entry rows once ([B, S]) and each token's
    visible count, never a [T, S] list (module docstring);
    weights: [T, Hi] (already times Hi^-0.5); keys, by `layout`:
    - None: plain rows [R, Di] (row stride free, last dim contiguous), rows index them;
    - IndexerKeyLayout (fmt "fp8" or "mxfp4"): uint8 paged cache [blocks, >= layout.block_bytes()],
      rows are global slots (slot s = block s // block_size, position s % block_size).
    -> fp32 [T, S], -inf where rows < 0. Equals `dsv4_kernels.indexer.indexer_scores(q, K, weights)` on the
    valid entries, K = the (dequantised) keys of rows.clamp(min=0).
    """
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, Hi, Di] with unit stride on the last dim, got {tuple(q.shape)}")
    t, hi, di = q.shape
    check_index_keys(keys, layout, di)
    check_candidates(rows, t, seg, count)
    if weights.shape != (t, hi):
        raise ValueError(f"weights must be [T={t}, Hi={hi}], got {tuple(weights.shape)}")
    if block_s < 16:
        raise ValueError(f"block_s must be >= 16 (tl.dot), got {block_s}")
    require_triton(q.device)
    s = rows.shape[1]
    out = torch.empty(t, s, dtype=torch.float32, device=q.device)
    if t == 0 or s == 0:
        return out
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    fmt, value_bytes, scale_bytes, block_size = key_format(layout)
    # sm_90 compiles at Hi=64, Di=128, BLOCK_S=64: plain keys fit 4 warps; dequantising needs 8 to not spill.
    extra = {"num_warps": 4 if layout is None else 8, "num_stages": 2} if q.is_cuda else {}
    seg, count = token_candidates(rows, t, seg, count)
    _indexer_scores_kernel[(t, triton.cdiv(s, block_s))](
        q,
        keys,
        rows,
        seg,
        count,
        weights,
        out,
        hi,
        di,
        s,
        di**-0.5,
        block_size,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        rows.stride(0),
        weights.stride(0),
        out.stride(0),
        HI_P=max(16, triton.next_power_of_2(hi)),
        DI_P=max(16, triton.next_power_of_2(di)),
        BLOCK_S=block_s,
        FMT=fmt,
        VALUE_BYTES=value_bytes,
        SCALE_BYTES=scale_bytes,
        BF16_DOT=bf16_dot(q, keys, layout),
        **extra,
        **pdl_kwargs(q),
    )
    return out


def indexer_topk(
    q: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    layout: IndexerKeyLayout | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ordered: bool = True,
    *,
    seg: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    budget: int = SCORES_BUDGET,
) -> torch.Tensor:
    """Top-k candidates of each token by indexer score. Inputs as `indexer_scores` (rows [R, S], seg, count).

    The queries go a block at a time (dsv4_kernels.indexer.query_blocks): no scores tensor exceeds `budget`
    bytes (fp32 [block, S]) whatever T and S, e.g. an 8K-token chunk at 1M context (S = 262144) is 32 blocks
    of 256 queries at the default 256 MiB instead of one 8 GiB tensor. The split depends on (T, S) only.

    cu_seqlens: optional int [B + 1] query offsets of the step's sequences (the StepBatch's `cu`). When it is
    given and the step has more queries than sequences (prefill / chunked prefill), the scores come from the
    prefill kernel (dsv4_kernels.triton_indexer_prefill: one key tile shared by a block of queries of a sequence,
    tensor-core dots), which requires that within a sequence every valid rows[t, s] of a column s is the same
    row (true of the engine's visible entries); decode steps (T == B, CUDA graphs) keep the per-token kernel.
    The choice depends on shapes only, and neither path syncs with the host.
    -> int64 [T, k] candidate positions (columns of `rows`, not row ids), best first, -1 where fewer
    than k candidates are valid: the contract of `dsv4_kernels.indexer.topk_visible(scores, rows >= 0, k)`.
    Selection is torch.topk on the fp32 scores (see the module docstring). ordered=False: the same set in no
    particular order, -1 anywhere (what the attention kernels take: -1 skips a slot wherever it is); on CUDA
    that drops topk's sort of the picks (a large part of the layer's top-k time at batch 1).
    """
    t = q.shape[0]
    check_candidates(rows, t, seg, count)
    seg, count = token_candidates(rows, t, seg, count)
    prefill_cu = cu_seqlens if cu_seqlens is not None and t > cu_seqlens.numel() - 1 else None

    def block_topk(t0: int, t1: int) -> torch.Tensor:
        # A function a block: its scores are freed before the next block's exist (rebinding in a loop would keep
        # two blocks, twice the budget, alive at once).
        args = (q[t0:t1], keys, rows, weights[t0:t1])
        if prefill_cu is not None:  # the block's own sequences: cu_seqlens shifted to t0 and clamped, no sync
            cu = (prefill_cu.to(q.device, torch.int64) - t0).clamp(0, t1 - t0)
            scores = indexer_prefill_scores(*args, cu, layout, seg=seg[t0:t1], count=count[t0:t1])
        else:
            scores = indexer_scores(*args, layout, seg=seg[t0:t1], count=count[t0:t1])
        return topk_of_scores(scores, k, ordered)

    blocks = query_blocks(t, rows.shape[1], budget)
    if len(blocks) == 1:
        return block_topk(*blocks[0])
    out = torch.empty(t, k, dtype=torch.int64, device=q.device)
    for t0, t1 in blocks:
        out[t0:t1] = block_topk(t0, t1)
    return out


# Where the radix kernel measured at least as fast as torch.topk (BENCHMARKS.md, "Indexer top-k: radix select vs
# torch.topk"): decode-sized steps over at most 8192 candidates. Longer rows (its passes cost a fixed time per 4096
# scores) and prefill chunks keep torch.topk.
TOPK_KERNEL_MAX_ROWS = 256
TOPK_KERNEL_MAX_CANDIDATES = 8192
# Few rows of many candidates (small decode batches at long contexts) split each row over several programs
# (dsv4_kernels.triton_topk_split), where the kernels above run a row on one SM: about 2x torch.topk up to 32 rows
# of 4096+ candidates; more rows, fewer candidates or more scores in all lose or tie (same BENCHMARKS.md section).
TOPK_SPLIT_MAX_ROWS = 32
TOPK_SPLIT_MIN_CANDIDATES = 4096
TOPK_SPLIT_MAX_SCORES = 32 * 8192  # rows x candidates


def rank_topk_segment(rows: int, candidates: int, k: int) -> int | None:
    """How a step of `rows` x `candidates` scores takes the rank-counting kernel (on CUDA, unordered picks): 0 in one
    launch, a segment length in two (dsv4_kernels.triton_topk_rank), None not at all. Up to TOPK_KERNEL_MAX_ROWS
    rows whose comparisons (rows x candidates^2, or in two launches rows x (candidates x segment + (pieces x k)^2))
    are at most $DSV4_TOPK_RANK_MAX_WORK; two launches only with $DSV4_TOPK_RANK_SEGMENT set (2048 by default;
    rounded up to the kernel's blocks)."""
    from dsv4_kernels.triton_topk_rank import BLOCK_I

    work = settings().topk_rank_max_work
    segment = -(-settings().topk_rank_segment // BLOCK_I) * BLOCK_I  # whole blocks of the kernel
    if rows > TOPK_KERNEL_MAX_ROWS:
        return None
    if rows * candidates * candidates <= work:
        return 0
    if segment and candidates > segment:
        survivors = -(-candidates // segment) * k
        if survivors < candidates and rows * (candidates * segment + survivors * survivors) <= work:
            return segment
    return None


def takes_sort_topk(rows: int, candidates: int) -> bool:
    """Does a step of `rows` x `candidates` scores take the bitonic sort kernel (on CUDA, unordered picks)? Up to
    TOPK_KERNEL_MAX_ROWS rows of at most $DSV4_TOPK_SORT_MAX_CANDIDATES candidates (a row must fit one program)."""
    from dsv4_kernels.triton_topk_sort import HAS_TOPK, SORT_MAX_CANDIDATES

    limit = min(settings().topk_sort_max_candidates, SORT_MAX_CANDIDATES)
    return HAS_TOPK and rows <= TOPK_KERNEL_MAX_ROWS and candidates <= limit


def takes_split_topk(rows: int, candidates: int) -> bool:
    """Does a step of `rows` x `candidates` scores take the split radix kernel (on CUDA, unordered picks)?"""
    return (
        rows <= TOPK_SPLIT_MAX_ROWS
        and candidates >= TOPK_SPLIT_MIN_CANDIDATES
        and rows * candidates <= TOPK_SPLIT_MAX_SCORES
    )


def topk_of_scores(scores: torch.Tensor, k: int, ordered: bool = True) -> torch.Tensor:
    """scores: fp32 [T, S], -inf = invalid -> int64 [T, k] best columns first (ordered; else the same set in no
    particular order), -1 for invalid picks."""
    rows, candidates = scores.shape
    segment = rank_topk_segment(rows, candidates, k) if not ordered and scores.is_cuda else None
    if segment is not None:
        from dsv4_kernels.triton_topk_rank import topk_columns_ranked

        return topk_columns_ranked(scores, k, segment=segment)
    if not ordered and scores.is_cuda and takes_sort_topk(rows, candidates):
        from dsv4_kernels.triton_topk_sort import topk_columns_sorted

        return topk_columns_sorted(scores, k)
    if not ordered and scores.is_cuda and takes_split_topk(rows, candidates):
        from dsv4_kernels.triton_topk_split import topk_columns_split

        return topk_columns_split(scores, k)
    if not ordered and scores.is_cuda and rows <= TOPK_KERNEL_MAX_ROWS and candidates <= TOPK_KERNEL_MAX_CANDIDATES:
        from dsv4_kernels.triton_topk import topk_columns

        return topk_columns(scores, k)
    if scores.shape[1] < k:  # pad the candidate axis so topk always returns k columns
        scores = torch.nn.functional.pad(scores, (0, k - scores.shape[1]), value=float("-inf"))
    top = scores.topk(k, dim=-1, sorted=ordered)
    # Valid scores are finite, so -inf marks exactly the invalid (or padding) picks.
    return torch.where(top.values > float("-inf"), top.indices, torch.full_like(top.indices, -1))
