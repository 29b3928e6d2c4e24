"""Triton compressor pooling: softmax over slots, weighted sum, RMSNorm, optional compress RoPE, fused.

Reference: `dsv4_kernels.norm.rms_norm(dsv4_kernels.compressor.pool_windows(kv, score), weight, eps)`, then (if cos/sin
are given) `dsv4_kernels.rope.apply_rope(., cos, sin)` at each entry's window start, as engine/model/attention.py
chains them. kv and score are the slot rows already arranged per entry (`overlap_slots` for ratio 4,
the plain window for ratio 128); a slot whose score is -inf gets weight 0.

The softmax runs per channel over the slots, so channels are independent until the norm. One program
per entry pools three column groups separately: the NoPE channels, then the even and the odd RoPE
channels (pairs (2i, 2i+1)); the norm sums squares over all three and RoPE rotates even against odd
without any in-register de-interleave. Each group takes two passes over the slots (max/sum, then the
weighted sum) so the weights are final before they are rounded to kv.dtype, as in the reference.
Interpreter note: bf16 loads are converted to fp32 before any arithmetic (see dsv4_kernels/triton_attention_kernels.py).

Also here, for the quantised caches (engine `--kv-cache-dtype fp8`): `pool_norm_rope_quant`, the same pooling, then
each entry quantised into the paged uint8 entry cache (fp8_ds_mla KV entries, or MXFP4 / FP8 indexer keys after the
Hadamard rotation), bytes placed as geometry.write_rows places them. Its roundings to bf16 are by bits
(dsv4_kernels/triton_cache_codecs.py), so the bytes equal geometry's pack of the entries it returns exactly, in the
interpreter and on the GPU. One entry per program: the indexer keys' Hadamard is a [d, d / 2] broadcast sum per nibble
half, not a dot (tl.dot needs 16 rows; a step closes few windows). The compressor's state ring rows are written by
dsv4_kernels.triton_state_save.
"""

from __future__ import annotations

import torch

from dsv4_kernels import triton_cache_codecs as tc
from dsv4_kernels.geometry import FP8_DS_MLA_QUANT_BLOCK, Fp8DsMlaLayout, IndexerKeyLayout
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_cache_codecs import (
    CODEC_AMAX_FLOOR,
    E2M1_EXP,
    E2M1_MANT,
    FP8_EXP,
    FP8_GROUP,
    FP8_INDEXER_FLOOR,
    FP8_MANT,
    MX_HALF,
    tl_e2m1_code,
    tl_e4m3_bits,
    tl_exp2i,
    tl_pow2_exponent,
    tl_rotation,
    tl_round_bf16,
    tl_round_to,
    tl_row_offsets,
    tl_store_fp8_ds_mla,
    tl_ue8m0,
)
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


@triton.jit
def _pool_cols(
    kv_row,
    sc_row,
    cols,
    cmask,
    SLOTS,
    stride_kvs,
    stride_scs,
    OUT_DTYPE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BF16_BITS: tl.constexpr = False,
):
    """Softmax-over-slots weighted sum of the given columns -> fp32 values rounded to OUT_DTYPE.

    BF16_BITS: round to bf16 by bits (nearest even in the interpreter too; the cache writers need it)."""
    m = tl.full(cols.shape, float("-inf"), dtype=tl.float32)
    l = tl.zeros(cols.shape, dtype=tl.float32)
    for s0 in range(0, SLOTS, BLOCK_S):
        sl = s0 + tl.arange(0, BLOCK_S)
        mask = (sl < SLOTS)[:, None] & cmask[None, :]
        sc = tl.load(sc_row + sl[:, None] * stride_scs + cols[None, :], mask=mask, other=float("-inf"))
        sc = sc.to(tl.float32)
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk of only -inf slots so far
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(sc - m_safe[None, :]), axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    inv_l = 1.0 / tl.where(cmask, l, 1.0)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s0 in range(0, SLOTS, BLOCK_S):
        sl = s0 + tl.arange(0, BLOCK_S)
        mask = (sl < SLOTS)[:, None] & cmask[None, :]
        sc = tl.load(sc_row + sl[:, None] * stride_scs + cols[None, :], mask=mask, other=float("-inf"))
        kv = tl.load(kv_row + sl[:, None] * stride_kvs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl_round_to(tl.exp(sc.to(tl.float32) - m[None, :]) * inv_l[None, :], BF16_BITS, OUT_DTYPE)
        acc += tl.sum(tl_round_to(kv * w, BF16_BITS, OUT_DTYPE), axis=0)  # the reference multiplies in kv.dtype
    return tl_round_to(acc, BF16_BITS, OUT_DTYPE)


@triton.jit
def _pool_norm_rope_kernel(
    kv_ptr,
    score_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    SLOTS,
    D,
    HALF,
    eps,
    stride_kvn,
    stride_kvs,
    stride_scn,
    stride_scs,
    stride_on,
    stride_cn,
    stride_sn,
    NOPE_P: tl.constexpr,
    HALF_P: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    kv_row = kv_ptr + n * stride_kvn
    sc_row = score_ptr + n * stride_scn
    o_row = out_ptr + n * stride_on
    dt = out_ptr.dtype.element_ty
    nope = D - 2 * HALF
    ca = tl.arange(0, NOPE_P)
    ma = ca < nope
    p = tl.arange(0, HALF_P)
    mp = p < HALF
    ce = nope + 2 * p
    a = _pool_cols(kv_row, sc_row, ca, ma, SLOTS, stride_kvs, stride_scs, dt, BLOCK_S)
    e = _pool_cols(kv_row, sc_row, ce, mp, SLOTS, stride_kvs, stride_scs, dt, BLOCK_S)
    o = _pool_cols(kv_row, sc_row, ce + 1, mp, SLOTS, stride_kvs, stride_scs, dt, BLOCK_S)
    a = tl.where(ma, a, 0.0)
    e = tl.where(mp, e, 0.0)
    o = tl.where(mp, o, 0.0)
    r = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(e * e, axis=0) + tl.sum(o * o, axis=0)) / D + eps)
    a = tl.load(w_ptr + ca, mask=ma, other=0.0).to(tl.float32) * (a * r)
    e = (tl.load(w_ptr + ce, mask=mp, other=0.0).to(tl.float32) * (e * r)).to(dt).to(tl.float32)
    o = (tl.load(w_ptr + ce + 1, mask=mp, other=0.0).to(tl.float32) * (o * r)).to(dt).to(tl.float32)
    tl.store(o_row + ca, a.to(dt), mask=ma)
    if HAS_ROPE:
        c = tl.load(cos_ptr + n * stride_cn + p, mask=mp, other=1.0)
        s = tl.load(sin_ptr + n * stride_sn + p, mask=mp, other=0.0)
        e, o = e * c - o * s, o * c + e * s
    tl.store(o_row + ce, e.to(dt), mask=mp)
    tl.store(o_row + ce + 1, o.to(dt), mask=mp)


def pool_norm_rope(
    kv: torch.Tensor,
    score: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    block_s: int | None = None,
) -> torch.Tensor:
    """Compressed entries from their slot rows.

    kv: [N, slots, d] (bf16/fp32, last dim contiguous); score: [N, slots, d] (fp32; -inf = empty slot);
    weight: [d] RMSNorm weight; cos, sin: optional fp32 [N, rope_dim // 2] at each entry's window start.
    -> [N, d] in kv.dtype = rms_norm(pool_windows(kv, score), weight, eps), then apply_rope(., cos, sin)
    on the trailing rope_dim channels when cos/sin are given.
    """
    if kv.dim() != 3 or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [N, slots, d] with unit stride on the last dim, got {tuple(kv.shape)}")
    n, slots, d = kv.shape
    if score.shape != kv.shape or score.stride(-1) != 1:
        raise ValueError(f"score must match kv {tuple(kv.shape)} with unit last stride, got {tuple(score.shape)}")
    if weight.shape != (d,):
        raise ValueError(f"weight must be [d={d}], got {tuple(weight.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    if (
        cos is not None
        and sin is not None
        and (cos.dim() != 2 or cos.shape[0] != n or sin.shape != cos.shape or 2 * cos.shape[1] > d)
    ):
        raise ValueError(
            f"cos/sin must be [N={n}, rope_dim // 2 <= {d // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    require_triton(kv.device)
    out = torch.empty(n, d, dtype=kv.dtype, device=kv.device)
    if n == 0:
        return out
    half = 0 if cos is None else cos.shape[1]
    if cos is not None and sin is not None:
        cos, sin = cos.float(), sin.float()
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    else:
        cos = sin = out  # unused
    block_s = block_s or max(1, min(16, triton.next_power_of_2(slots)))
    extra = {"num_warps": 4} if kv.is_cuda else {}
    _pool_norm_rope_kernel[(n,)](
        kv,
        score,
        weight,
        cos,
        sin,
        out,
        slots,
        d,
        half,
        eps,
        kv.stride(0),
        kv.stride(1),
        score.stride(0),
        score.stride(1),
        out.stride(0),
        cos.stride(0),
        sin.stride(0),
        NOPE_P=max(1, triton.next_power_of_2(d - 2 * half)),
        HALF_P=max(1, triton.next_power_of_2(half)),
        HAS_ROPE=half > 0,
        BLOCK_S=block_s,
        **extra,
        **pdl_kwargs(kv),
    )
    return out


# ---- pooled entries straight into the quantised entry cache ---------------------------------------------
@triton.jit
def _rotate_1d(a, e, o, ca, ce, oc, D, HADAMARD: tl.constexpr, LOG2D: tl.constexpr):
    """Columns oc of [nope a | rope pairs (e, o)] @ H (or @ I) for one entry: broadcast sums, not dots (one row)."""
    y = tl.sum(a[:, None] * tl_rotation(ca, oc, D, HADAMARD, LOG2D), axis=0)
    y += tl.sum(e[:, None] * tl_rotation(ce, oc, D, HADAMARD, LOG2D), axis=0)
    y += tl.sum(o[:, None] * tl_rotation(ce + 1, oc, D, HADAMARD, LOG2D), axis=0)
    return y


@triton.jit
def tl_store_indexer_key(
    cache_ptr,
    out_row,
    vrow,
    srow,
    ok,
    a,
    e,
    o,
    ca,
    ce,
    D,
    hscale,
    FMT: tl.constexpr,
    LD: tl.constexpr,
    NS: tl.constexpr,
    OUT_P: tl.constexpr,
    HADAMARD: tl.constexpr,
    LOG2D: tl.constexpr,
    BF16: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """Rotate one key (optional Hadamard), store it (model dtype) at out_row, quantise it into the cache row."""
    dt = out_row.dtype.element_ty
    i = tl.arange(0, OUT_P)
    if FMT == 1:  # MXFP4: even / odd columns -> low / high nibbles; 16 + 16 of them share a scale
        ye = tl_round_to(_rotate_1d(a, e, o, ca, ce, 2 * i, D, HADAMARD, LOG2D) * hscale, BF16, dt)
        yo = tl_round_to(_rotate_1d(a, e, o, ca, ce, 2 * i + 1, D, HADAMARD, LOG2D) * hscale, BF16, dt)
        tl.store(out_row + 2 * i, ye.to(dt), mask=2 * i < D)
        tl.store(out_row + 2 * i + 1, yo.to(dt), mask=2 * i < D)
        GM: tl.constexpr = OUT_P // MX_HALF
        ye2 = tl.reshape(ye, [GM, MX_HALF])
        yo2 = tl.reshape(yo, [GM, MX_HALF])
        amax = tl.maximum(tl.max(tl.abs(ye2), axis=1), tl.max(tl.abs(yo2), axis=1))
        ex = tl.minimum(tl.maximum(tl_pow2_exponent(amax, CODEC_AMAX_FLOOR, E2M1_EXP, E2M1_MANT), -127), 127)
        inv = tl_exp2i(-ex)[:, None]
        byte = tl_e2m1_code(tl.reshape(ye2 * inv, [OUT_P])) | (tl_e2m1_code(tl.reshape(yo2 * inv, [OUT_P])) << 4)
        tl.store(cache_ptr + vrow + i[None, :], byte.to(tl.uint8)[None, :], mask=ok[:, None] & (i < LD // 2)[None, :])
        g = tl.arange(0, GM)
        tl.store(cache_ptr + srow + g[None, :], tl_ue8m0(ex)[None, :], mask=ok[:, None] & (g < NS)[None, :])
    else:  # FP8: columns in order, one power-of-two fp32 scale per 128
        y = tl_round_to(_rotate_1d(a, e, o, ca, ce, i, D, HADAMARD, LOG2D) * hscale, BF16, dt)
        tl.store(out_row + i, y.to(dt), mask=i < D)
        GF: tl.constexpr = OUT_P // FP8_GROUP
        y2 = tl.reshape(y, [GF, FP8_GROUP])
        ex = tl_pow2_exponent(tl.max(tl.abs(y2), axis=1), FP8_INDEXER_FLOOR, FP8_EXP, FP8_MANT)
        codes = tl_e4m3_bits(tl.reshape(y2 * tl_exp2i(-ex)[:, None], [OUT_P]), HW_FP8)
        tl.store(cache_ptr + vrow + i[None, :], codes[None, :], mask=ok[:, None] & (i < LD)[None, :])
        g = tl.arange(0, GF)
        sp = (cache_ptr + srow).to(tl.pointer_type(tl.float32))
        tl.store(sp + g[None, :], tl_exp2i(ex)[None, :], mask=ok[:, None] & (g < NS)[None, :])


@triton.jit
def _pool_quant_kernel(
    kv_ptr,
    score_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    out_ptr,
    cache_ptr,
    SLOTS,
    D,
    HALF,
    eps,
    hscale,
    block_size,
    block_stride,
    stride_kvn,
    stride_kvs,
    stride_scn,
    stride_scs,
    stride_on,
    stride_cn,
    stride_sn,
    FMT: tl.constexpr,
    NOPE_P: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    LD: tl.constexpr,
    NB: tl.constexpr,
    OUT_P: tl.constexpr,
    HADAMARD: tl.constexpr,
    LOG2D: tl.constexpr,
    BF16: tl.constexpr,
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One entry: pool + RMSNorm + RoPE (as _pool_norm_rope_kernel, rounding by bits), then its cache row."""
    tl_pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    kv_row = kv_ptr + n * stride_kvn
    sc_row = score_ptr + n * stride_scn
    o_row = out_ptr + n * stride_on
    dt = out_ptr.dtype.element_ty
    nope = D - 2 * HALF
    ca = tl.arange(0, NOPE_P)
    ma = ca < nope
    p = tl.arange(0, HALF_P)
    mp = p < HALF
    ce = nope + 2 * p
    a = tl.where(ma, _pool_cols(kv_row, sc_row, ca, ma, SLOTS, stride_kvs, stride_scs, dt, BLOCK_S, BF16), 0.0)
    e = tl.where(mp, _pool_cols(kv_row, sc_row, ce, mp, SLOTS, stride_kvs, stride_scs, dt, BLOCK_S, BF16), 0.0)
    o = tl.where(mp, _pool_cols(kv_row, sc_row, ce + 1, mp, SLOTS, stride_kvs, stride_scs, dt, BLOCK_S, BF16), 0.0)
    r = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(e * e, axis=0) + tl.sum(o * o, axis=0)) / D + eps)
    a = tl_round_to(tl.load(w_ptr + ca, mask=ma, other=0.0).to(tl.float32) * (a * r), BF16, dt)
    e = tl_round_to(tl.load(w_ptr + ce, mask=mp, other=0.0).to(tl.float32) * (e * r), BF16, dt)
    o = tl_round_to(tl.load(w_ptr + ce + 1, mask=mp, other=0.0).to(tl.float32) * (o * r), BF16, dt)
    c = tl.load(cos_ptr + n * stride_cn + p, mask=mp, other=1.0)
    s = tl.load(sin_ptr + n * stride_sn + p, mask=mp, other=0.0)
    e, o = tl_round_to(e * c - o * s, BF16, dt), tl_round_to(o * c + e * s, BF16, dt)

    slot = tl.load(rows_ptr + n + tl.arange(0, 1)).to(tl.int64)  # [1]: the interpreter needs vector masks
    ok = slot >= 0
    vrow, srow = tl_row_offsets(tl.maximum(slot, 0), block_size, block_stride, VALUE_BYTES, SCALE_BYTES)
    if FMT == 0:  # fp8_ds_mla KV entry: NoPE blocks of 64 -> rows of a [blocks, 64] view
        tl.store(o_row + ca, a.to(dt), mask=ma)
        tl.store(o_row + ce, e.to(dt), mask=mp)
        tl.store(o_row + ce + 1, o.to(dt), mask=mp)
        nope2 = tl.reshape(tl_round_bf16(a), [NOPE_P // 64, 64])
        tl_store_fp8_ds_mla(
            cache_ptr,
            vrow,
            srow,
            ok,
            nope2,
            tl_round_bf16(e),
            tl_round_bf16(o),
            p,
            HALF,
            NB,
            NOPE_P // 64,
            64,
            LD,
            SCALE_BYTES - NB,
            HW_FP8,
        )
    else:
        tl_store_indexer_key(
            cache_ptr,
            o_row,
            vrow,
            srow,
            ok,
            a,
            e,
            o,
            ca,
            ce,
            D,
            hscale,
            FMT,
            LD,
            NB,
            OUT_P,
            HADAMARD,
            LOG2D,
            BF16,
            HW_FP8,
        )


def entry_quant_format(layout, d: int, rope_dim: int, hadamard: bool) -> int:
    """Validate the entry layout against entries of d channels (rope_dim of them RoPE) -> FMT code."""
    if isinstance(layout, Fp8DsMlaLayout):
        if hadamard:
            raise ValueError("the Hadamard rotation applies to indexer keys, not to fp8_ds_mla KV entries")
        if layout.rope_dim != rope_dim or not 0 <= layout.nope_dim - (d - rope_dim) < FP8_DS_MLA_QUANT_BLOCK:
            raise ValueError(
                f"layout (head_dim {layout.head_dim}, rope {layout.rope_dim}) does not hold entries of "
                f"d={d} with rope {rope_dim} (NoPE may only be zero-padded to the next multiple of 64)"
            )
        return 0
    if isinstance(layout, IndexerKeyLayout):
        if layout.index_head_dim < d:
            raise ValueError(f"layout.index_head_dim {layout.index_head_dim} < entry width {d}")
        if hadamard and d & (d - 1):
            raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {d}")
        return 1 if layout.fmt == "mxfp4" else 2
    raise TypeError(f"layout must be an Fp8DsMlaLayout or IndexerKeyLayout, got {type(layout).__name__}")


def pool_norm_rope_quant(
    kv: torch.Tensor,
    score: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    rows: torch.Tensor,
    layout: Fp8DsMlaLayout | IndexerKeyLayout,
    *,
    hadamard: bool | None = None,
    block_s: int | None = None,
) -> torch.Tensor:
    """`pool_norm_rope`, then each entry quantised into the paged entry cache at `rows` (-1 = skip).

    kv, score, weight, eps, cos, sin: as `pool_norm_rope` (cos / sin required); rows: int32/int64 [N] global
    entry rows (slot s = block s // block_size, position s % block_size; not range-checked); cache: uint8
    [blocks, >= layout.block_bytes()] or the engine's [rows, layout.row_bytes] view of one layer; layout:
    - Fp8DsMlaLayout (compressed KV): the row of `geometry.pack_fp8_ds_mla`, NoPE zero-padded up to
      layout.nope_dim like engine.model.cache's RowCodec;
    - IndexerKeyLayout (indexer keys, "mxfp4" or "fp8"): `geometry.pack_rows` of the entry after the
      Hadamard rotation (`dsv4_kernels.hadamard.hadamard`, the query side's, see dsv4_kernels/triton_indexer_query.py),
      zero-padded up to layout.index_head_dim. hadamard: None = rotate indexer keys (as V4 does); False
      quantises them unrotated (then the queries must not be rotated either).
    -> [N, d] in kv.dtype: the entries as quantised (the pooled, normalised, rotated entries; for rotated
    indexer keys, after the Hadamard rotation).
    """
    n, slots, d = kv.shape if kv.dim() == 3 else (0, 0, 0)
    if kv.dim() != 3 or kv.stride(-1) != 1 or score.shape != kv.shape or score.stride(-1) != 1:
        raise ValueError(
            f"kv and score must be matching [N, slots, d] with unit last stride, got {tuple(kv.shape)}, "
            f"{tuple(score.shape)}"
        )
    if weight.shape != (d,):
        raise ValueError(f"weight must be [d={d}], got {tuple(weight.shape)}")
    if cos.dim() != 2 or cos.shape[0] != n or sin.shape != cos.shape or 2 * cos.shape[1] > d:
        raise ValueError(
            f"cos/sin must be [N={n}, rope_dim // 2 <= {d // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    half = cos.shape[1]
    rotate = isinstance(layout, IndexerKeyLayout) if hadamard is None else hadamard
    fmt = entry_quant_format(layout, d, 2 * half, rotate)
    block_stride, capacity = tc.paged_cache_args(cache, layout)
    rows = tc.check_rows(rows, n, capacity)
    require_triton(kv.device)
    out = torch.empty(n, d, dtype=kv.dtype, device=kv.device)
    if n == 0:
        return out
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if isinstance(layout, Fp8DsMlaLayout):  # fmt 0
        nope_p, width, out_p = triton.next_power_of_2(layout.nope_dim), layout.nope_dim, 1
    else:
        width = layout.index_head_dim
        nope_p, out_p = (
            max(1, triton.next_power_of_2(d - 2 * half)),
            triton.next_power_of_2(width // 2 if fmt == 1 else width),
        )
    block_s = block_s or max(1, min(16, triton.next_power_of_2(slots)))
    extra = {"num_warps": 4} if kv.is_cuda else {}
    _pool_quant_kernel[(n,)](
        kv,
        score,
        weight,
        cos,
        sin,
        rows,
        out,
        cache,
        slots,
        d,
        half,
        eps,
        d**-0.5 if rotate else 1.0,
        layout.block_size,
        block_stride,
        kv.stride(0),
        kv.stride(1),
        score.stride(0),
        score.stride(1),
        out.stride(0),
        cos.stride(0),
        sin.stride(0),
        FMT=fmt,
        NOPE_P=nope_p,
        HALF_P=max(1, triton.next_power_of_2(half)),
        BLOCK_S=block_s,
        VALUE_BYTES=layout.value_bytes,
        SCALE_BYTES=layout.scale_bytes,
        LD=width,
        NB=layout.num_scales,
        OUT_P=out_p,
        HADAMARD=rotate,
        LOG2D=max(1, d.bit_length() - 1),
        BF16=kv.dtype == torch.bfloat16,
        HW_FP8=kv.is_cuda and tc.USE_HW_FP8_CAST,
        **extra,
        **pdl_kwargs(kv),
    )
    return out
