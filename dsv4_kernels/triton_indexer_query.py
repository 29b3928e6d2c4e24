"""Triton indexer query prologue: RoPE, Walsh-Hadamard rotation, MXFP4 / FP8 quantisation, fused.

Reference: `dsv4_kernels.indexer.quantize_query`: q [T, Hi, Di] -> apply_rope on the trailing rope channels
(interleaved pairs, rounded to q.dtype) -> `dsv4_kernels.hadamard.hadamard` (x @ H / sqrt(Di), fp32 math rounded
once to q.dtype; the keys get the same rotation, so q . k is unchanged) -> the indexer-key quantisation of
dsv4_kernels/geometry.py (MXFP4: e2m1 nibbles, element 2i in the low nibble, one UE8M0 scale per 32 values; FP8:
e4m3 with one power-of-two fp32 scale per 128 values). Outputs use the key packing: values [T, Hi, value_bytes]
and scales [T, Hi, num_scales], whose concatenation is `geometry.pack_rows` of the rotated q.

One program takes BLOCK_R (token, head) rows. The rotation is tensor-core work: the rotated columns are
Xnope @ H[nope rows, cols] + Xeven @ H[even rope rows, cols] + Xodd @ H[odd rope rows, cols], with the +-1
blocks of H generated in registers from the row / column ids, so the RoPE pairs never need an in-register
de-interleave (H's sign structure lets the odd rope rows and the odd output columns reuse the even blocks). For MXFP4 the even and odd output columns come out of separate dots and pair up into bytes
directly; a 32-value scale group is 16 consecutive even + 16 odd columns, reduced through a [BLOCK_R, groups,
16] reshape (the pattern dsv4_kernels/triton_attention_kernels.py uses). Without the rotation the same dots run against the
identity, which is exact.
Rounding: bf16 roundings are by bits (`tl_round_bf16`), so interpreter and GPU agree and the bytes equal
`pack_rows(rotated q the kernel returns)` exactly; against the torch reference the rotated q may differ by one
ulp (fp32 sums in another order), and so may the codes of values on a rounding boundary.
"""

from __future__ import annotations

import torch

from dsv4_kernels import triton_cache_codecs as tc
from dsv4_kernels.geometry import IndexerKeyLayout
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
    tl_round_to,
    tl_ue8m0,
)
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

_MXFP4, _FP8 = 1, 2


@triton.jit
def _dot(a, b, BF16_DOT: tl.constexpr):
    """fp32 [M, K] (model-dtype values) x +-1/0 fp32 [K, N] -> fp32; bf16 operands are exact on the GPU path."""
    if BF16_DOT:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        c = tl.dot(a, b, input_precision="ieee")
    return c


@triton.jit
def _rotate(xn, xe, xo, cn, ce, oc, DI, HADAMARD: tl.constexpr, LOG2D: tl.constexpr, BF16_DOT: tl.constexpr):
    """Columns oc of [nope | rope] @ H (or @ I): the three column groups of the input against H's matching rows.

    With H, row ce + 1 (ce even) is row ce times (-1) ** (oc & 1), so the odd-rope block reuses the even one.
    """
    hn = tl_rotation(cn, oc, DI, HADAMARD, LOG2D)
    he = tl_rotation(ce, oc, DI, HADAMARD, LOG2D)
    y = _dot(xn, hn, BF16_DOT) + _dot(xe, he, BF16_DOT)
    if HADAMARD:
        y += _dot(xo, he, BF16_DOT) * (1.0 - 2.0 * (oc & 1).to(tl.float32))[None, :]
    else:
        y += _dot(xo, tl_rotation(ce + 1, oc, DI, HADAMARD, LOG2D), BF16_DOT)
    return y


@triton.jit
def _rotate_pairs(xn, xe, xo, cn, ce, i, DI, HADAMARD: tl.constexpr, LOG2D: tl.constexpr, BF16_DOT: tl.constexpr):
    """(columns 2i, columns 2i + 1) of [nope | rope] @ H (or @ I), the MXFP4 nibble pairs.

    With H both come from the blocks at columns 2i: H[j, 2i + 1] = H[j, 2i] * (-1) ** (j & 1), so
    odd = (xn * (-1) ** cn) @ Hn + xe @ He - xo @ He, and even = xn @ Hn + xe @ He + xo @ He.
    """
    if HADAMARD:
        hn = tl_rotation(cn, 2 * i, DI, HADAMARD, LOG2D)
        he = tl_rotation(ce, 2 * i, DI, HADAMARD, LOG2D)
        a = _dot(xe, he, BF16_DOT)
        b = _dot(xo, he, BF16_DOT)
        ye = _dot(xn, hn, BF16_DOT) + a + b
        yo = _dot(xn * (1.0 - 2.0 * (cn & 1).to(tl.float32))[None, :], hn, BF16_DOT) + a - b
    else:
        ye = _rotate(xn, xe, xo, cn, ce, 2 * i, DI, HADAMARD, LOG2D, BF16_DOT)
        yo = _rotate(xn, xe, xo, cn, ce, 2 * i + 1, DI, HADAMARD, LOG2D, BF16_DOT)
    return ye, yo


@triton.jit
def _indexer_q_kernel(
    q_ptr,
    cos_ptr,
    sin_ptr,
    val_ptr,
    sc_ptr,
    rot_ptr,
    N,
    H,
    DI,
    HALF,
    hscale,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_st,
    FMT: tl.constexpr,
    LD: tl.constexpr,
    NOPE_P: tl.constexpr,
    HALF_P: tl.constexpr,
    OUT_P: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    NUM_SCALES: tl.constexpr,
    HADAMARD: tl.constexpr,
    LOG2D: tl.constexpr,
    BF16: tl.constexpr,
    BF16_DOT: tl.constexpr,
    HW_FP8: tl.constexpr,
    HAS_ROT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = n < N
    n64 = n.to(tl.int64)
    tok = n64 // H
    row = q_ptr + tok * stride_qt + (n64 % H) * stride_qh
    dt = q_ptr.dtype.element_ty
    nope = DI - 2 * HALF
    cn = tl.arange(0, NOPE_P)
    p = tl.arange(0, HALF_P)
    ce = nope + 2 * p
    pm = rm[:, None] & (p < HALF)[None, :]
    xn = tl.load(row[:, None] + cn[None, :], mask=rm[:, None] & (cn < nope)[None, :], other=0.0).to(tl.float32)
    xe = tl.load(row[:, None] + ce[None, :], mask=pm, other=0.0).to(tl.float32)
    xo = tl.load(row[:, None] + ce[None, :] + 1, mask=pm, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + tok[:, None] * stride_ct + p[None, :], mask=pm, other=1.0)
    sn = tl.load(sin_ptr + tok[:, None] * stride_st + p[None, :], mask=pm, other=0.0)
    xe, xo = tl_round_to(xe * cs - xo * sn, BF16, dt), tl_round_to(xo * cs + xe * sn, BF16, dt)

    i = tl.arange(0, OUT_P)
    if FMT == 1:
        # MXFP4: even / odd output columns 2i, 2i + 1 -> the low / high nibble of byte i.
        ye, yo = _rotate_pairs(xn, xe, xo, cn, ce, i, DI, HADAMARD, LOG2D, BF16_DOT)
        ye, yo = tl_round_to(ye * hscale, BF16, dt), tl_round_to(yo * hscale, BF16, dt)
        GM: tl.constexpr = OUT_P // MX_HALF
        ye3 = tl.reshape(ye, [BLOCK_R, GM, MX_HALF])
        yo3 = tl.reshape(yo, [BLOCK_R, GM, MX_HALF])
        amax = tl.maximum(tl.max(tl.abs(ye3), axis=2), tl.max(tl.abs(yo3), axis=2))
        e = tl.minimum(tl.maximum(tl_pow2_exponent(amax, CODEC_AMAX_FLOOR, E2M1_EXP, E2M1_MANT), -127), 127)
        inv = tl_exp2i(-e)[:, :, None]
        lo = tl_e2m1_code(tl.reshape(ye3 * inv, [BLOCK_R, OUT_P]))
        hi = tl_e2m1_code(tl.reshape(yo3 * inv, [BLOCK_R, OUT_P]))
        tl.store(
            val_ptr + n64[:, None] * VALUE_BYTES + i[None, :],
            (lo | (hi << 4)).to(tl.uint8),
            mask=rm[:, None] & (i < LD // 2)[None, :],
        )
        g = tl.arange(0, GM)
        tl.store(
            sc_ptr + n64[:, None] * NUM_SCALES + g[None, :], tl_ue8m0(e), mask=rm[:, None] & (g < NUM_SCALES)[None, :]
        )
        if HAS_ROT:
            om = rm[:, None] & (2 * i < DI)[None, :]
            tl.store(rot_ptr + n64[:, None] * DI + 2 * i[None, :], ye.to(dt), mask=om)
            tl.store(rot_ptr + n64[:, None] * DI + 2 * i[None, :] + 1, yo.to(dt), mask=om)
    else:
        # FP8: all columns in order; one power-of-two fp32 scale per 128.
        y = tl_round_to(_rotate(xn, xe, xo, cn, ce, i, DI, HADAMARD, LOG2D, BF16_DOT) * hscale, BF16, dt)
        GF: tl.constexpr = OUT_P // FP8_GROUP
        y3 = tl.reshape(y, [BLOCK_R, GF, FP8_GROUP])
        e = tl_pow2_exponent(tl.max(tl.abs(y3), axis=2), FP8_INDEXER_FLOOR, FP8_EXP, FP8_MANT)
        codes = tl_e4m3_bits(tl.reshape(y3 * tl_exp2i(-e)[:, :, None], [BLOCK_R, OUT_P]), HW_FP8)
        tl.store(val_ptr + n64[:, None] * VALUE_BYTES + i[None, :], codes, mask=rm[:, None] & (i < LD)[None, :])
        g = tl.arange(0, GF)
        tl.store(
            sc_ptr + n64[:, None] * NUM_SCALES + g[None, :], tl_exp2i(e), mask=rm[:, None] & (g < NUM_SCALES)[None, :]
        )
        if HAS_ROT:
            tl.store(rot_ptr + n64[:, None] * DI + i[None, :], y.to(dt), mask=rm[:, None] & (i < DI)[None, :])


def _check(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: IndexerKeyLayout, hadamard: bool) -> None:
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, Hi, Di] with unit stride on the last dim, got {tuple(q.shape)}")
    t, _, di = q.shape
    if cos.dim() != 2 or cos.shape[0] != t or sin.shape != cos.shape or 2 * cos.shape[1] > di:
        raise ValueError(
            f"cos/sin must be [T={t}, rope_dim // 2 <= {di // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if not isinstance(layout, IndexerKeyLayout) or layout.index_head_dim < di:
        raise ValueError(f"layout must be an IndexerKeyLayout with index_head_dim >= Di={di}, got {layout}")
    if hadamard and di & (di - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two Di, got {di}")


def indexer_query(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: IndexerKeyLayout,
    *,
    hadamard: bool = True,
    return_rotated: bool = False,
    block_r: int = 16,
):
    """Quantise the indexer queries in the key format of `layout` (dsv4_kernels.indexer.quantize_query).

    q: [T, Hi, Di] (bf16 / fp32, last dim contiguous); cos, sin: fp32 [T, rope_dim // 2] (compress RoPE at
    each token's position); layout: IndexerKeyLayout, fmt "mxfp4" or "fp8", index_head_dim >= Di (extra
    channels are zero). hadamard: rotate by H / sqrt(Di) after RoPE (Di a power of two); the keys must get
    the same rotation. -> (values uint8 [T, Hi, layout.value_bytes], scales [T, Hi, layout.num_scales]:
    UE8M0 uint8 for mxfp4, fp32 for fp8) and, with return_rotated, the rotated q [T, Hi, Di] in q.dtype
    (the values that were quantised).
    """
    _check(q, cos, sin, layout, hadamard)
    if block_r < 16 or block_r & (block_r - 1):
        raise ValueError(f"block_r must be a power of two >= 16 (tl.dot), got {block_r}")
    t, h, di = q.shape
    mx = layout.fmt == "mxfp4"
    values = torch.empty(t, h, layout.value_bytes, dtype=torch.uint8, device=q.device)
    scales = torch.empty(t, h, layout.num_scales, dtype=torch.uint8 if mx else torch.float32, device=q.device)
    rotated = torch.empty(t, h, di, dtype=q.dtype, device=q.device) if return_rotated else None
    require_triton(q.device)
    n = t * h
    if n:
        half = cos.shape[1]
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        ld = layout.index_head_dim
        extra = {"num_warps": 4} if q.is_cuda else {}
        _indexer_q_kernel[(triton.cdiv(n, block_r),)](
            q,
            cos,
            sin,
            values,
            scales,
            rotated if rotated is not None else values,
            n,
            h,
            di,
            half,
            di**-0.5 if hadamard else 1.0,
            q.stride(0),
            q.stride(1),
            cos.stride(0),
            sin.stride(0),
            FMT=_MXFP4 if mx else _FP8,
            LD=ld,
            NOPE_P=max(16, triton.next_power_of_2(di - 2 * half)),
            HALF_P=max(16, triton.next_power_of_2(half)),
            OUT_P=triton.next_power_of_2(ld // 2 if mx else ld),
            VALUE_BYTES=layout.value_bytes,
            NUM_SCALES=layout.num_scales,
            HADAMARD=hadamard,
            LOG2D=max(1, di.bit_length() - 1),
            BF16=q.dtype == torch.bfloat16,
            BF16_DOT=q.is_cuda and q.dtype == torch.bfloat16,
            HW_FP8=q.is_cuda and tc.USE_HW_FP8_CAST,
            HAS_ROT=rotated is not None,
            BLOCK_R=block_r,
            **extra,
            **pdl_kwargs(q),
        )
    return (values, scales, rotated) if return_rotated else (values, scales)


# ---- the engine's indexer prologue (unquantised queries) -----------------------------------------------------
PROLOGUE_BLOCK_E = 512  # candidate rows a program writes per block
PROLOGUE_MAX_PROGRAMS = 64  # programs a step's candidate rows may spread over (few tokens only)


# E (visible compressed rows) grows with the context, and rows / valid may be views at any offset: neither
# adds compiled variants (engine.execution.warmup); only BLOCK_E follows E, by power-of-two bucket.
@triton.jit(
    do_not_specialize=["E", "stride_rt", "stride_vt", "stride_rot", "NE"],
    do_not_specialize_on_alignment=["rows_ptr", "valid_ptr"],
)
def _prologue_kernel(
    q_ptr,
    cos_ptr,
    sin_ptr,
    w_ptr,
    rows_ptr,
    valid_ptr,
    qo_ptr,
    wo_ptr,
    ro_ptr,
    H,
    DI,
    WIDTH,
    HALF,
    E,
    scale,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_st,
    stride_wt,
    stride_rt,
    stride_vt,
    stride_ot,
    stride_oh,
    stride_rot,
    NE,
    LD_P: tl.constexpr,
    H_P: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)  # this program's candidate blocks: chunk, chunk + NE, ...; chunk 0 also does q
    # candidate rows: -1 where not visible
    for e0 in range(chunk * BLOCK_E, E, NE * BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        em = e < E
        r = tl.load(rows_ptr + t * stride_rt + e, mask=em, other=-1)
        v = tl.load(valid_ptr + t * stride_vt + e, mask=em, other=0)
        tl.store(ro_ptr + t * stride_rot + e, tl.where(v != 0, r, -1), mask=em)
    if chunk == 0:
        _prologue_query(
            q_ptr,
            cos_ptr,
            sin_ptr,
            w_ptr,
            qo_ptr,
            wo_ptr,
            t,
            H,
            DI,
            WIDTH,
            HALF,
            scale,
            stride_qt,
            stride_qh,
            stride_ct,
            stride_st,
            stride_wt,
            stride_ot,
            stride_oh,
            LD_P,
            H_P,
            HALF_P,
            BF16,
        )


@triton.jit
def _prologue_query(
    q_ptr,
    cos_ptr,
    sin_ptr,
    w_ptr,
    qo_ptr,
    wo_ptr,
    t,
    H,
    DI,
    WIDTH,
    HALF,
    scale,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_st,
    stride_wt,
    stride_ot,
    stride_oh,
    LD_P: tl.constexpr,
    H_P: tl.constexpr,
    HALF_P: tl.constexpr,
    BF16: tl.constexpr,
):
    dt = qo_ptr.dtype.element_ty
    hh = tl.arange(0, H_P)
    hm = hh < H
    # head weights: (x @ weights_proj^T).float() * scale
    hw = tl.load(w_ptr + t * stride_wt + hh, mask=hm, other=0.0).to(tl.float32) * scale
    tl.store(wo_ptr + t * H + hh, hw, mask=hm)
    # q: NoPE copied, RoPE pairs rotated, zero padding up to the key width
    nope = DI - 2 * HALF
    c = tl.arange(0, LD_P)
    q_row = q_ptr + t * stride_qt + hh[:, None] * stride_qh
    o_row = qo_ptr + t * stride_ot + hh[:, None] * stride_oh
    keep = hm[:, None] & (c < nope)[None, :]
    x = tl.load(q_row + c[None, :], mask=keep, other=0.0)
    tl.store(o_row + c[None, :], x.to(dt), mask=hm[:, None] & ((c < nope) | ((c >= DI) & (c < WIDTH)))[None, :])
    p = tl.arange(0, HALF_P)
    pm = hm[:, None] & (p < HALF)[None, :]
    ce = nope + 2 * p
    ev = tl.load(q_row + ce[None, :], mask=pm, other=0.0).to(tl.float32)
    od = tl.load(q_row + ce[None, :] + 1, mask=pm, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + t * stride_ct + p, mask=p < HALF, other=1.0)[None, :]
    sn = tl.load(sin_ptr + t * stride_st + p, mask=p < HALF, other=0.0)[None, :]
    tl.store(o_row + ce[None, :], tl_round_to(ev * cs - od * sn, BF16, dt).to(dt), mask=pm)
    tl.store(o_row + ce[None, :] + 1, tl_round_to(od * cs + ev * sn, BF16, dt).to(dt), mask=pm)


def indexer_prologue(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    width: int | None = None,
):
    """The engine indexer's glue before its scoring kernel, one launch (AttentionBlock._indexer's reference):
    q' = apply_rope(q, cos, sin) zero-padded to `width` channels; head weights = weights.float() * scale;
    candidate rows = torch.where(valid, rows, -1).

    q: [T, Hi, Di] (last dim contiguous; token / head strides free); cos, sin: fp32 [T, rope_dim // 2];
    weights: [T, Hi] (model dtype; row stride free); rows: int [T, E]; valid: bool [T, E]; width >= Di (default Di).
    -> (q' [T, Hi, width] q.dtype contiguous, fp32 [T, Hi], rows.dtype [T, E]). Without rows / valid the third
    output is None: the engine passes per-request candidates and visible counts to the scoring kernels instead
    (dsv4_kernels.indexer's module docstring), so no [T, E] list is written."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, Hi, Di] with unit stride on the last dim, got {tuple(q.shape)}")
    t, h, di = q.shape
    width = width or di
    if cos.dim() != 2 or cos.shape[0] != t or sin.shape != cos.shape or 2 * cos.shape[1] > di:
        raise ValueError(f"cos/sin must be [T={t}, rope_dim // 2 <= {di // 2}], got {tuple(cos.shape)}")
    if weights.shape != (t, h) or weights.stride(-1) != 1 or width < di:
        raise ValueError(
            f"weights must be [T={t}, Hi={h}] with unit last stride (and width >= Di), got "
            f"{tuple(weights.shape)}, width {width}"
        )
    no_rows = rows is None and valid is None
    if no_rows:  # zero candidate columns (the engine's dtypes: the same compiled variant): no candidate work
        rows, valid = (
            torch.empty(t, 0, dtype=torch.int64, device=q.device),
            torch.empty(t, 0, dtype=torch.bool, device=q.device),
        )
    elif (
        rows is None
        or valid is None
        or rows.dim() != 2
        or rows.shape[0] != t
        or valid.shape != rows.shape
        or valid.dtype != torch.bool
    ):
        raise ValueError(
            f"rows / valid must be given together as matching int / bool [T={t}, E], got "
            f"{None if rows is None else tuple(rows.shape)}, {None if valid is None else valid.dtype}"
        )
    require_triton(q.device)
    q_out = torch.empty(t, h, width, dtype=q.dtype, device=q.device)
    w_out = torch.empty(t, h, dtype=torch.float32, device=q.device)
    r_out = torch.empty(rows.shape, dtype=rows.dtype, device=q.device)
    if t == 0:
        return q_out, w_out, None if no_rows else r_out
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    valid = valid if valid.stride(-1) == 1 else valid.contiguous()
    cos = cos if cos.dtype == torch.float32 and cos.stride(-1) == 1 else cos.float().contiguous()
    sin = sin if sin.dtype == torch.float32 and sin.stride(-1) == 1 else sin.float().contiguous()
    half, e = cos.shape[1], rows.shape[1]
    extra = {"num_warps": 4} if q.is_cuda else {}
    block_e = min(PROLOGUE_BLOCK_E, triton.next_power_of_2(max(e, 1)))
    # One program walking a batch-1 step's 8192 candidates (32K context) is latency-bound (BENCHMARKS.md, "GPU decode
    # and prefill"): a few tokens split their candidates over up to PROLOGUE_MAX_PROGRAMS // T programs each.
    ne = max(1, min(triton.cdiv(max(e, 1), block_e), PROLOGUE_MAX_PROGRAMS // t))
    _prologue_kernel[(t, ne)](
        q,
        cos,
        sin,
        weights,
        rows,
        valid,
        q_out,
        w_out,
        r_out,
        h,
        di,
        width,
        half,
        e,
        scale,
        q.stride(0),
        q.stride(1),
        cos.stride(0),
        sin.stride(0),
        weights.stride(0),
        rows.stride(0),
        valid.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        r_out.stride(0),
        ne,
        LD_P=triton.next_power_of_2(width),
        H_P=triton.next_power_of_2(h),
        HALF_P=max(1, triton.next_power_of_2(half)),
        BLOCK_E=block_e,
        BF16=q.dtype == torch.bfloat16,
        **extra,
        **pdl_kwargs(q),
    )
    return q_out, w_out, None if no_rows else r_out
