"""Prefill-shaped Triton indexer logits: blocks of queries of one sequence share each key tile (tensor cores).

Reference: `dsv4_kernels.indexer.indexer_scores` on each query's candidates, -inf where rows < 0 (the contract of
dsv4_kernels/triton_indexer.py's `indexer_scores`):
    score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . key[rows[t, s]]) * Di^-0.5.
In prefill every query of a sequence sees a prefix of the same compressed entries, so the per-token kernel
(which re-reads and re-dots each key row once per query) wastes the sharing. Here one program takes BT
consecutive queries of one sequence (M = BT * Hi_p rows of q, e.g. 2 x 64 heads = 128) and walks key
tiles of BLOCK_N candidates: each tile is loaded (dequantised in registers for FP8 / MXFP4 stores) once,
multiplied as [M, Di] x [Di, BLOCK_N] with tl.dot, then ReLU, the per-(query, head) weight, and a sum over
heads give the [BT, BLOCK_N] logits, -inf where rows[t, s] < 0 (causality, padding).

Contract beyond the per-token kernel's: within one sequence, every valid candidate of a column s names
the same key row (true of the engine's visible entries: one row of per-request candidates per sequence, each
token seeing a prefix of it); the tile's key row of column s is the largest valid candidate of the block. Sequences are cu_seqlens' ranges (varlen steps, chunks
starting mid-sequence: only rows matter, not positions).

Work per program is bounded by its extent: the candidates past its last valid column (causal prefill:
about half of them) get -inf without a dot, found by a scan of the block's rows. The grid is (query
blocks, candidate chunks): a block table [G, 2] of (t0, t1) built on the device from cu_seqlens with a
static upper bound G = ceil(T / BT) + B (no host sync; unused entries are empty), run longest-first, and
the candidate axis split into chunks when there are too few blocks to fill the GPU.
"""

from __future__ import annotations

import functools

import torch

from dsv4_kernels.geometry import IndexerKeyLayout
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.indexer import check_candidates, token_candidates
from dsv4_kernels.triton_index_keys import bf16_dot, check_index_keys, key_format, tl_load_index_keys
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


@triton.jit
def _block_rows(rows_ptr, row_off, n, tmask, cand, hi):
    """rows[seg[tq], cand] (int64 [BT, BLOCK_N]; row_off = seg[tq] * stride), -1 outside the block's queries,
    past `hi` or past each query's visible count n."""
    ok = tmask[:, None] & (cand < hi)[None, :] & (cand[None, :] < n[:, None])
    return tl.load(rows_ptr + row_off[:, None] + cand[None, :], mask=ok, other=-1).to(tl.int64)


@triton.jit(do_not_specialize=["num_blocks", "S"])  # (chunk: a multiple of BLOCK_N, kept specialised)
def _prefill_scores_kernel(
    q_ptr,
    k_ptr,
    rows_ptr,
    seg_ptr,
    count_ptr,
    w_ptr,
    out_ptr,
    blocks_ptr,
    num_blocks,
    HI,
    DI,
    S,
    chunk,
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
    BT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    BF16_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    # Blocks late in a sequence see the most keys: the table runs backwards so they start first.
    tl_pdl_wait(PDL)
    g = num_blocks - 1 - tl.program_id(0)
    t0 = tl.load(blocks_ptr + 2 * g)
    t1 = tl.load(blocks_ptr + 2 * g + 1)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, S)
    tq = (t0 + tl.arange(0, BT)).to(tl.int64)
    tmask = tq < t1
    row_off = tl.load(seg_ptr + tq, mask=tmask, other=0).to(tl.int64) * stride_rt
    n = tl.load(count_ptr + tq, mask=tmask, other=0).to(
        tl.int32
    )  # int32: the loops carry it (compiled Triton keeps types)
    # Extent: one past the block's last valid candidate in [lo, hi) (lo when none); nothing past the
    # largest visible count is scanned.
    ext = lo
    for start in range(lo, tl.minimum(hi, tl.max(n)), BLOCK_N):
        cand = start + tl.arange(0, BLOCK_N)
        rt = _block_rows(rows_ptr, row_off, n, tmask, cand, hi)
        ext = tl.maximum(ext, tl.max(tl.where(rt >= 0, cand[None, :] + 1, 0)))

    # q of the block as [M, Di]: row i is query t0 + i // HI_P, head i % HI_P (padding rows load 0, w = 0).
    M: tl.constexpr = BT * HI_P
    i = tl.arange(0, M)
    qt = (t0 + i // HI_P).to(tl.int64)
    head = i % HI_P
    qmask = (qt < t1) & (head < HI)
    cols = tl.arange(0, DI_P)
    cmask = cols < DI
    q = tl.load(
        q_ptr + qt[:, None] * stride_qt + head[:, None] * stride_qh + cols[None, :],
        mask=qmask[:, None] & cmask[None, :],
        other=0.0,
    ).to(tl.float32)
    w = tl.load(w_ptr + qt * stride_wt + head, mask=qmask, other=0.0).to(tl.float32)
    if BF16_DOT:
        q_dot = q.to(tl.bfloat16)
    else:
        q_dot = q
    for start in range(lo, ext, BLOCK_N):
        cand = start + tl.arange(0, BLOCK_N)
        rt = _block_rows(rows_ptr, row_off, n, tmask, cand, hi)
        r = tl.max(rt, axis=0)  # the column's key row (valid rows of a sequence agree), -1 when none is valid
        ok = r >= 0
        keys = tl_load_index_keys(
            k_ptr,
            tl.where(ok, r, 0),
            ok,
            cols,
            cmask,
            DI,
            stride_kr,
            block_size,
            VALUE_BYTES,
            SCALE_BYTES,
            FMT,
            DI_P,
            BLOCK_N,
        )
        if BF16_DOT:
            dots = tl.dot(q_dot, tl.trans(keys.to(tl.bfloat16)))
        else:
            dots = tl.dot(q_dot, tl.trans(keys), input_precision="ieee")
        score = tl.sum(tl.reshape(tl.maximum(dots, 0.0) * w[:, None], [BT, HI_P, BLOCK_N]), axis=1) * scale
        score = tl.where(rt >= 0, score, float("-inf"))
        tl.store(out_ptr + tq[:, None] * stride_ot + cand[None, :], score, mask=tmask[:, None] & (cand < hi)[None, :])
    # Past the extent nothing is visible to the block: -inf without a dot.
    tail = lo + tl.cdiv(ext - lo, BLOCK_N) * BLOCK_N
    for start in range(tail, hi, BLOCK_N):
        cand = start + tl.arange(0, BLOCK_N)
        fill = tl.full([BT, BLOCK_N], float("-inf"), tl.float32)
        tl.store(out_ptr + tq[:, None] * stride_ot + cand[None, :], fill, mask=tmask[:, None] & (cand < hi)[None, :])


def prefill_blocks(cu_seqlens: torch.Tensor, num_tokens: int, bt: int) -> torch.Tensor:
    """Query blocks of at most `bt` consecutive tokens of one sequence, on cu_seqlens' device, no host sync.

    cu_seqlens: int [B + 1], 0 = cu[0] <= ... <= cu[B] = num_tokens. -> int32 [ceil(T / bt) + B, 2] rows
    (t0, t1): every sequence's blocks in order, then empty (0, 0) rows up to the static bound.
    """
    cu = cu_seqlens.long()
    b = cu.numel() - 1
    counts = cu[1:] - cu[:-1]
    nblk = (counts + bt - 1) // bt
    ends = torch.cumsum(nblk, 0)
    g = torch.arange(triton.cdiv(num_tokens, bt) + b, device=cu.device)
    seg = torch.searchsorted(ends, g, right=True)
    used = seg < b
    seg = seg.clamp(max=b - 1)
    t0 = cu[seg] + (g - (ends[seg] - nblk[seg])) * bt
    t1 = torch.minimum(t0 + bt, cu[seg + 1])
    zero = torch.zeros_like(t0)
    t0 = torch.where(used, t0, zero).clamp(0, num_tokens)
    t1 = torch.where(used, t1, zero).clamp(0, num_tokens)
    return torch.stack([t0, t1], dim=1).to(torch.int32).contiguous()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _chunk(s: int, blocks: int, block_n: int, device: torch.device, split: int | None) -> int:
    """Candidates per program: all of them, unless too few query blocks would leave SMs idle."""
    if split is None:
        split = 1 if device.type != "cuda" else max(1, triton.cdiv(4 * _sm_count(device.index or 0), blocks))
    tiles = triton.cdiv(s, block_n)
    return triton.cdiv(tiles, max(1, min(split, tiles))) * block_n


# Tile defaults: the best of `dsv4 bench kernels indexer-prefill --sweep` at V4-Flash's 64 heads x 128 (4 queries x
# 64 heads a program, 64 candidates a tile, 8 warps, 2 stages; BENCHMARKS.md, "Prefill indexer: shared-key kernel
# vs per-token kernel").
def indexer_prefill_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: torch.Tensor,
    layout: IndexerKeyLayout | None = None,
    *,
    block_m: int = 256,
    block_n: int = 64,
    split: int | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
    seg: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer logits of a varlen step whose queries share their sequence's keys (module docstring).

    q: [T, Hi, Di] fp32/bf16 (last dim contiguous); keys, layout, rows [R, S] (-1 = invalid), seg / count
    (token t's candidates: rows[seg[t], :count[t]]), weights [T, Hi] as dsv4_kernels.triton_indexer.indexer_scores; cu_seqlens: int [B + 1] query offsets of the B sequences
    (cu[0] = 0, cu[B] = T; on q's device). block_m: q rows a program (BT = block_m // Hi_p queries, at least
    1); block_n: candidates a tile; split: candidate chunks (None: enough programs for the GPU).
    -> fp32 [T, S], -inf where rows < 0; equal to indexer_scores on inputs that meet the contract.
    """
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, Hi, Di] with unit stride on the last dim, got {tuple(q.shape)}")
    t, hi, di = q.shape
    check_index_keys(keys, layout, di)
    check_candidates(rows, t, seg, count)
    if weights.shape != (t, hi):
        raise ValueError(f"weights must be [T={t}, Hi={hi}], got {tuple(weights.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be int32/int64 [B + 1 >= 2], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {block_n}")
    require_triton(q.device)
    s = rows.shape[1]
    out = torch.empty(t, s, dtype=torch.float32, device=q.device)
    if t == 0 or s == 0:
        return out
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    hi_p = triton.next_power_of_2(hi)
    bt = max(1, block_m // hi_p, triton.next_power_of_2(triton.cdiv(16, hi_p)))  # tl.dot needs M >= 16
    seg, count = token_candidates(rows, t, seg, count)
    blocks = prefill_blocks(cu_seqlens.to(q.device), t, bt)
    chunk = _chunk(s, blocks.shape[0], block_n, q.device, split)
    fmt, value_bytes, scale_bytes, block_size = key_format(layout)
    extra = {"num_warps": num_warps, "num_stages": num_stages} if q.is_cuda else {}
    _prefill_scores_kernel[(blocks.shape[0], triton.cdiv(s, chunk))](
        q,
        keys,
        rows,
        seg,
        count,
        weights,
        out,
        blocks,
        blocks.shape[0],
        hi,
        di,
        s,
        chunk,
        di**-0.5,
        block_size,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        rows.stride(0),
        weights.stride(0),
        out.stride(0),
        HI_P=hi_p,
        DI_P=max(16, triton.next_power_of_2(di)),
        BT=bt,
        BLOCK_N=block_n,
        FMT=fmt,
        VALUE_BYTES=value_bytes,
        SCALE_BYTES=scale_bytes,
        BF16_DOT=bf16_dot(q, keys, layout),
        **extra,
        **pdl_kwargs(q),
    )
    return out
