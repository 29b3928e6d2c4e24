"""Triton sparse MQA attention with a per-head sink, reading candidate KV rows in place.

Reference: `kernels.attention.sparse_attention`. Every query token attends, with all H heads, to K
candidate rows of one shared latent (K = V) named by row indices into a flat or paged row store, so the
[T, K, D] gather the reference needs is never materialised. Two stores:
- `sparse_mqa_attention`: rows of D values (bf16 / fp32), kv[row];
- `sparse_mqa_attention_fp8`: fp8_ds_mla bytes (kernels/geometry.py), dequantised on the fly: e4m3 NoPE
  values times a UE8M0 scale per 64, then raw bf16 RoPE values. Works directly on the paged cache
  (value rows first, scale rows after all of them); packed [R, row_bytes] rows are the block_size=1 case.

Algorithm: one program per (token, block of heads, split of K). It walks its K range in tiles with an
fp32 online softmax in base 2. The running max starts at the sink logit, not -inf, which keeps every
exponent finite (no NaN for all-invalid tiles) and folds the sink into the normaliser for free; an
all-invalid query ends with acc = 0, i.e. the zero vector, as in the reference. Decode has few tokens, so
K is split across programs (flash-decoding) and a second kernel merges the partial (max, sum, acc).

D is processed as two column segments [0, D0) and [D0, D) (NoPE / RoPE for fp8 rows, two halves or a
power-of-two head + tail for plain rows) because tl.arange needs power-of-two widths.

Interpreter note: triton 3.x's CPU interpreter stores bf16 as raw uint16 and does integer arithmetic and
matmuls on the bits, so kernels here convert every bf16 load to fp32 before arithmetic and only use bf16
dot operands when compiled for the GPU (`bf16_dot`); the interpreter runs the same dots in fp32. Its
fp32 -> bf16 cast also truncates (the GPU rounds to nearest even), so interpreted bf16 outputs can be
one ulp lower in magnitude than compiled ones; bf16 tolerances cover both.
"""

from __future__ import annotations

import math

import torch

from kernels.geometry import Fp8DsMlaLayout
from kernels.gpu import import_triton, require_triton

triton, tl = import_triton()

LOG2E = 1.4426950408889634
FP8_SCALE_BLOCK = 64  # NoPE values per UE8M0 scale in fp8_ds_mla


@triton.jit
def _dot(a, b, BF16_DOT: tl.constexpr):
    """fp32 [M, K] x [K, N] -> fp32; bf16 tensor-core operands on GPU, exact fp32 in the interpreter."""
    if BF16_DOT:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        c = tl.dot(a, b, input_precision="ieee")
    return c


@triton.jit
def _load_plain(kv_ptr, r, ok, stride_row, cols, col_mask, col0):
    """Rows r (int64 [BK]) of a [R, D] store, columns col0 + cols -> fp32 [BK, P] (0 where masked)."""
    ptrs = kv_ptr + r[:, None] * stride_row + (col0 + cols)[None, :]
    return tl.load(ptrs, mask=ok[:, None] & col_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _load_fp8(cache_ptr, r, ok, block_size, stride_block, c0, m0, c1, m1,
              NOPE: tl.constexpr, TOKEN_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr,
              SCALE_BLOCK: tl.constexpr, P0: tl.constexpr):
    """fp8_ds_mla slots r (int64 [BK]) of a paged byte cache -> (fp32 NoPE [BK, P0], fp32 RoPE [BK, P1])."""
    blk = r // block_size
    pos = r - blk * block_size
    base = blk * stride_block
    vrow = base + pos * TOKEN_STRIDE
    srow = base + block_size * TOKEN_STRIDE + pos * SCALE_STRIDE
    codes = tl.load(cache_ptr + vrow[:, None] + c0[None, :], mask=ok[:, None] & m0[None, :], other=0)
    # One scale byte per 64 columns, loaded once as [BK, P0 / 64] and broadcast over its block (a
    # per-column gather would need a second [BK, P0] tensor of 64-bit addresses: register spills).
    NB: tl.constexpr = P0 // SCALE_BLOCK
    sidx = tl.arange(0, NB)
    sbyte = tl.load(cache_ptr + srow[:, None] + sidx[None, :], mask=ok[:, None] & (sidx < NOPE // SCALE_BLOCK)[None, :],
                    other=127)
    # UE8M0 byte b is 2**(b - 127): build the fp32 from its exponent bits (exact, unlike ex2.approx).
    scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    nope = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    BK: tl.constexpr = codes.shape[0]
    nope = tl.reshape(tl.reshape(nope, [BK, NB, SCALE_BLOCK]) * scale[:, :, None], [BK, P0])
    rope_ptrs = (cache_ptr + vrow[:, None] + NOPE + 2 * c1[None, :]).to(tl.pointer_type(tl.bfloat16))
    rope = tl.load(rope_ptrs, mask=ok[:, None] & m1[None, :], other=0.0).to(tl.float32)
    return nope, rope


@triton.jit
def _sparse_attn_kernel(
    q_ptr, kv_ptr, rows_ptr, sink_ptr, out_ptr, pacc_ptr, pml_ptr,
    H, K, tiles_per_split, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_rt,
    stride_row, block_size, stride_block, scale_log2,
    D0: tl.constexpr, D1: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
    FP8: tl.constexpr, TOKEN_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, BF16_DOT: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    c0 = tl.arange(0, P0)
    c1 = tl.arange(0, P1)
    m0 = c0 < D0
    m1 = c1 < D1

    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q0 = tl.load(q_row + c0[None, :], mask=hmask[:, None] & m0[None, :], other=0.0)
    q1 = tl.load(q_row + D0 + c1[None, :], mask=hmask[:, None] & m1[None, :], other=0.0)
    # Convert q to the dot operand type once, outside the K loop.
    q0 = q0.to(tl.bfloat16) if BF16_DOT else q0.to(tl.float32)
    q1 = q1.to(tl.bfloat16) if BF16_DOT else q1.to(tl.float32)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634

    # Running state in base 2. m starts at the sink so it is always finite; without a split the sink's
    # own exp2(sink - m) = 1 is already in l, with a split the merge kernel adds it once.
    m_i = sink
    if SPLIT:
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, P0], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, P1], dtype=tl.float32)

    num_tiles = tl.cdiv(K, BLOCK_K)
    tile_begin = sp * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    for tile in range(tile_begin, tile_end):
        ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        r = tl.load(rows_ptr + t.to(tl.int64) * stride_rt + ks, mask=ks < K, other=-1).to(tl.int64)
        ok = r >= 0
        r = tl.where(ok, r, 0)
        if FP8:
            k0, k1 = _load_fp8(kv_ptr, r, ok, block_size, stride_block, c0, m0, c1, m1,
                               D0, TOKEN_STRIDE, SCALE_STRIDE, SCALE_BLOCK, P0)
        else:
            k0 = _load_plain(kv_ptr, r, ok, stride_row, c0, m0, 0)
            k1 = _load_plain(kv_ptr, r, ok, stride_row, c1, m1, D0)
        s = _dot(q0, tl.trans(k0), BF16_DOT) + _dot(q1, tl.trans(k1), BF16_DOT)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = acc0 * alpha[:, None] + _dot(p, k0, BF16_DOT)
        acc1 = acc1 * alpha[:, None] + _dot(p, k1, BF16_DOT)
        m_i = m_new

    if SPLIT:
        # Partials: acc [T, H, S, D] fp32 and (m, l) [T, H, S, 2] fp32, merged by _merge_kernel.
        row = (t.to(tl.int64) * H + heads) * num_splits + sp
        d = D0 + D1
        pmask = hmask[:, None]
        tl.store(pacc_ptr + row[:, None] * d + c0[None, :], acc0, mask=pmask & m0[None, :])
        tl.store(pacc_ptr + row[:, None] * d + D0 + c1[None, :], acc1, mask=pmask & m1[None, :])
        tl.store(pml_ptr + row * 2, m_i, mask=hmask)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=hmask)
    else:
        inv = 1.0 / l_i
        o_row = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        tl.store(o_row + c0[None, :], (acc0 * inv[:, None]).to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None] & m0[None, :])
        tl.store(o_row + D0 + c1[None, :], (acc1 * inv[:, None]).to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None] & m1[None, :])


@triton.jit
def _merge_kernel(pacc_ptr, pml_ptr, sink_ptr, out_ptr, H, num_splits, stride_ot, stride_oh,
                  D0: tl.constexpr, D1: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """Merge the split partials of one (token, head block); the sink enters once, as the initial state."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    c0 = tl.arange(0, P0)
    c1 = tl.arange(0, P1)
    mask0 = hmask[:, None] & (c0 < D0)[None, :]
    mask1 = hmask[:, None] & (c1 < D1)[None, :]
    m = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    l = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, P0], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, P1], dtype=tl.float32)
    d = D0 + D1
    for sp in range(0, num_splits):
        row = (t.to(tl.int64) * H + heads) * num_splits + sp
        m_s = tl.load(pml_ptr + row * 2, mask=hmask, other=0.0)
        l_s = tl.load(pml_ptr + row * 2 + 1, mask=hmask, other=0.0)
        a0 = tl.load(pacc_ptr + row[:, None] * d + c0[None, :], mask=mask0, other=0.0)
        a1 = tl.load(pacc_ptr + row[:, None] * d + D0 + c1[None, :], mask=mask1, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        l = l * alpha + l_s * beta
        acc0 = acc0 * alpha[:, None] + a0 * beta[:, None]
        acc1 = acc1 * alpha[:, None] + a1 * beta[:, None]
        m = m_new
    inv = 1.0 / l
    o_row = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    tl.store(o_row + c0[None, :], (acc0 * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask0)
    tl.store(o_row + D0 + c1[None, :], (acc1 * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask1)


# ---- host side ---------------------------------------------------------------------------------------
def _segments(d: int) -> tuple[int, int]:
    """Split D plain columns into two non-empty segments whose padded widths waste little."""
    if d < 2:
        raise ValueError(f"head dim must be >= 2, got {d}")
    head = 1 << (d.bit_length() - 1)  # largest power of two <= d
    return (d // 2, d - d // 2) if head == d else (head, d - head)


def _pick_splits(device: torch.device, programs: int, num_tiles: int, min_tiles: int) -> int:
    """Split K until the grid has about one wave of programs, each keeping >= min_tiles tiles."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, math.ceil(sms / max(programs, 1)))
    return max(1, min(want, num_tiles // min_tiles))


def _check_common(q: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor, d: int) -> None:
    if q.dim() != 3 or q.shape[-1] != d or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, H, {d}] with unit stride on the last dim, got {tuple(q.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be fp32/bf16/fp16, got {q.dtype}")
    if rows.dim() != 2 or rows.shape[0] != q.shape[0] or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32/int64 [T={q.shape[0]}, K], got {rows.dtype} {tuple(rows.shape)}")
    if sink.shape != (q.shape[1],):
        raise ValueError(f"sink must be [H={q.shape[1]}], got {tuple(sink.shape)}")
    require_triton(q.device)


def _launch(q, store, rows, sink, scale, *, fp8, d0, d1, stride_row=0, block_size=1, stride_block=0,
            token_stride=1, scale_stride=1, bf16_operands=False, num_splits=None, block_h=None, block_k=None):
    t, h, d = q.shape
    k = rows.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0 or h == 0:
        return out
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    sink = sink.float().contiguous()
    # Defaults from sm_90 compiles at H=64, D=512 (8 warps): the largest tiles that do not spill
    # registers (fp8 rows need extra registers for the byte tiles and scales). tl.dot needs M >= 16.
    block_h = block_h or min(32, max(16, triton.next_power_of_2(h)))
    block_k = block_k or (16 if fp8 else 32)
    if block_h < 16 or block_k < 16:
        raise ValueError(f"block_h and block_k must be >= 16 (tl.dot), got {block_h}, {block_k}")
    head_blocks = triton.cdiv(h, block_h)
    num_tiles = max(1, triton.cdiv(k, block_k))
    if num_splits is None:
        num_splits = _pick_splits(q.device, t * head_blocks, num_tiles, min_tiles=2)
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(num_splits, num_tiles)))
    num_splits = triton.cdiv(num_tiles, tiles_per_split)
    split = num_splits > 1
    if split:
        pacc = torch.empty(t, h, num_splits, d, dtype=torch.float32, device=q.device)
        pml = torch.empty(t, h, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        pacc = pml = out  # unused
    # tl.dot needs every dim >= 16; padded columns are masked to zero.
    p0, p1 = max(16, triton.next_power_of_2(d0)), max(16, triton.next_power_of_2(d1))
    bf16_dot = q.is_cuda and q.dtype == torch.bfloat16 and bf16_operands
    extra = {"num_warps": 8, "num_stages": 2} if q.is_cuda else {}
    _sparse_attn_kernel[(t, head_blocks, num_splits)](
        q, store, rows, sink, out, pacc, pml,
        h, k, tiles_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), rows.stride(0),
        stride_row, block_size, stride_block, scale * LOG2E,
        D0=d0, D1=d1, P0=p0, P1=p1, FP8=fp8, TOKEN_STRIDE=token_stride, SCALE_STRIDE=scale_stride,
        SCALE_BLOCK=FP8_SCALE_BLOCK, BLOCK_H=block_h, BLOCK_K=block_k, SPLIT=split, BF16_DOT=bf16_dot, **extra)
    if split:
        merge_h = min(8, triton.next_power_of_2(h))  # no dot here: small head blocks keep registers low
        _merge_kernel[(t, triton.cdiv(h, merge_h))](pacc, pml, sink, out, h, num_splits, out.stride(0),
                                                    out.stride(1), D0=d0, D1=d1, P0=p0, P1=p1, BLOCK_H=merge_h,
                                                    **({"num_warps": 4} if q.is_cuda else {}))
    return out


def sparse_mqa_attention(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor, scale: float,
                         *, num_splits: int | None = None, block_h: int | None = None,
                         block_k: int | None = None) -> torch.Tensor:
    """Sparse MQA attention with sinks over rows of a flat KV store.

    q: [T, H, D] fp32/bf16/fp16 (last dim contiguous); kv: [R, D] rows, any float dtype, last dim
    contiguous (row stride free, so a paged pool's [pages * page_rows, D] view works); rows: int32/int64
    [T, K], -1 = invalid (window slots and selected compressed entries alike); sink: [H] (fp32);
    scale: softmax scale. -> [T, H, D] in q.dtype.

    Equals `kernels.attention.sparse_attention(q, kv[rows.clamp(min=0)], rows >= 0, sink, scale)`;
    logits, softmax and accumulation run in fp32 (bf16 tensor-core operands on GPU for bf16 inputs).
    Row indices must be < R (not checked: that would need a device sync).
    num_splits / block_h / block_k override the launch heuristics (tests, tuning).
    """
    if kv.dim() != 2 or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [R, D] with unit stride on the last dim, got {tuple(kv.shape)}")
    _check_common(q, rows, sink, kv.shape[1])
    d0, d1 = _segments(kv.shape[1])
    return _launch(q, kv, rows, sink, scale, fp8=False, d0=d0, d1=d1, stride_row=kv.stride(0),
                   bf16_operands=kv.dtype == torch.bfloat16, num_splits=num_splits, block_h=block_h,
                   block_k=block_k)


def sparse_mqa_attention_fp8(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, sink: torch.Tensor,
                             scale: float, layout: Fp8DsMlaLayout, *, num_splits: int | None = None,
                             block_h: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """Sparse MQA attention with sinks over fp8_ds_mla rows, dequantised in the kernel.

    q: [T, H, layout.head_dim]; cache: uint8 [num_blocks, >= layout.block_bytes()] paged cache (value rows
    of a block first, then its scale rows; the block stride may exceed block_bytes), or packed rows
    [R, layout.row_bytes] with a block_size=1 layout; rows: int32/int64 [T, K] global slots
    (slot s = block s // block_size, position s % block_size), -1 = invalid; sink: [H]. -> [T, H, D] q.dtype.

    Equals the reference on `geometry.read_rows` + `unpack_fp8_ds_mla` of the same slots.
    """
    if not isinstance(layout, Fp8DsMlaLayout):
        raise TypeError(f"layout must be an Fp8DsMlaLayout, got {type(layout).__name__}")
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.stride(-1) != 1:
        raise ValueError(f"cache must be uint8 [blocks, bytes] with unit last stride, got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if cache.shape[1] < layout.block_bytes():
        raise ValueError(f"cache rows of {cache.shape[1]} B cannot hold a {layout.block_size}-row block "
                         f"({layout.block_bytes()} B)")
    if cache.stride(0) % 2 or cache.data_ptr() % 2:
        raise ValueError(f"cache must start on an even byte with an even block stride (the RoPE values are "
                         f"read as bf16), got stride {cache.stride(0)}")
    _check_common(q, rows, sink, layout.head_dim)
    return _launch(q, cache, rows, sink, scale, fp8=True, d0=layout.nope_dim, d1=layout.rope_dim,
                   block_size=layout.block_size, stride_block=cache.stride(0),
                   token_stride=layout.token_stride, scale_stride=layout.scale_stride, bf16_operands=True,
                   num_splits=num_splits, block_h=block_h, block_k=block_k)
