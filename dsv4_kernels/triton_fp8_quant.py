"""Triton per-token 1x128 FP8 activation quantiser (reference: dsv4_kernels.fp8_linear.quant_act_1x128).

One program quantises BLOCK_M rows x one 128-wide K block: amax over the block (floored at 1e-4), scale =
amax / 448 (rounded up to a power of two for UE8M0 checkpoints, computed on the exponent bits so it is
exact), e4m3 codes with round-to-nearest-even and saturation at +-448.

Scales are written MN-major ("column-major" [M, K/128] with the M stride padded to 4 fp32 = 16 bytes), the
layout DeepGEMM's sm90 kernels load with TMA, so DeepGEMM does not transpose them again per call.
"""

from __future__ import annotations

import torch

from dsv4_kernels.fp8_linear import AMAX_FLOOR, BLOCK, FP8_MAX
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_cache_codecs import USE_HW_FP8_CAST, tl_e4m3_bits, tl_round_to
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

BLOCK_M = 16
# jit functions read only constexpr globals
_FLOOR = tl.constexpr(AMAX_FLOOR)
_FMAX = tl.constexpr(FP8_MAX)


@triton.jit
def tl_quant_1x128(x, POW2: tl.constexpr, HW_FP8: tl.constexpr):
    """Rows of one 128-wide block, fp32 [R, 128] (masked lanes 0) -> (e4m3 code bytes [R, 128], fp32 scales [R]):
    the one quantisation every 1x128 writer here shares (this module's kernel, dsv4_kernels.triton_norm_quant and
    dsv4_kernels.triton_moe_glue's fused SwiGLU)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _FLOOR)
    scale = tl.div_rn(amax, _FMAX)  # IEEE division, as torch (the default `/` is approximate on the GPU)
    if POW2:
        # Round up to a power of two on the bits: keep the exponent, add one if any mantissa bit is set.
        bits = scale.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exp << 23).to(tl.float32, bitcast=True)
    # e4m3 bytes, nearest even (the interpreter's fp8 cast is not exact: dsv4_kernels.triton_cache_codecs)
    y = x / scale[:, None] if POW2 else tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))  # pow2: exact
    return tl_e4m3_bits(y, HW_FP8), scale


@triton.jit
def _inverse_rope_pairs(
    x, m64, mmask, k0, cos_ptr, sin_ptr, stride_c, head_dim, nope, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BF16: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """x fp32 [BLOCK_M, BLOCK_K] (columns k0.. of rows m64, each row heads of head_dim channels) with every head's
    rope pairs (channels >= nope, interleaved (2i, 2i+1)) turned back by the row's angle, each result rounded to the
    input dtype: dsv4_kernels.triton_norm_rope's _rope_pairs_kernel (inverse) on those channels, bit for bit."""
    ev, od = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
    ch = (k0 + 2 * tl.arange(0, BLOCK_K // 2)) % head_dim  # each pair's first channel within its head
    live = mmask[:, None] & (ch >= nope)[None, :]
    pair = tl.where(ch >= nope, (ch - nope) // 2, 0)
    c = tl.load(cos_ptr + m64[:, None] * stride_c + pair[None, :], mask=live, other=1.0)
    s = tl.load(sin_ptr + m64[:, None] * stride_c + pair[None, :], mask=live, other=0.0) * -1.0
    new_ev = tl.where(live, tl_round_to(ev * c - od * s, BF16, DT), ev)
    new_od = tl.where(live, tl_round_to(od * c + ev * s, BF16, DT), od)
    return tl.reshape(tl.join(new_ev, new_od), [BLOCK_M, BLOCK_K])


@triton.jit
def _quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_x,
    stride_q,
    stride_sm,
    stride_sk,
    stride_xg,
    stride_qg,
    stride_sg,
    cos_ptr,
    sin_ptr,
    stride_c,
    head_dim,
    nope,
    POW2: tl.constexpr,
    HW_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROPE: tl.constexpr,
    BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)  # group of a grouped projection (0 for a plain one)
    x_ptr += g * stride_xg
    q_ptr += g * stride_qg
    s_ptr += g * stride_sg
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (m < M)[:, None] & (k < K)[None, :]
    m64 = m.to(tl.int64)
    x = tl.load(x_ptr + m64[:, None] * stride_x + k[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        x = _inverse_rope_pairs(x, m64, m < M, kb * BLOCK_K, cos_ptr, sin_ptr, stride_c, head_dim, nope, BLOCK_M,
                                BLOCK_K, BF16, x_ptr.dtype.element_ty)  # fmt: skip
    codes, scale = tl_quant_1x128(x, POW2, HW_FP8)
    tl.store(q_ptr + m64[:, None] * stride_q + k[None, :], codes, mask=mask)
    tl.store(s_ptr + m64 * stride_sm + kb * stride_sk, scale, mask=m < M)


def scale_buffer(m: int, kb: int, device) -> torch.Tensor:
    """An fp32 [m, kb] view with MN-major strides (1, align(m, 4)): DeepGEMM's TMA layout for sm90 scales."""
    m_pad = (m + 3) // 4 * 4
    return torch.empty(kb, m_pad, dtype=torch.float32, device=device).t()[:m]


def quant_act_1x128(x: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (unit last stride) -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)] in MN-major strides)."""
    if x.dim() != 2:
        raise ValueError(f"activations must be [M, K], got shape {tuple(x.shape)}")
    require_triton(x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    kb = triton.cdiv(k, BLOCK)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = scale_buffer(m, kb, x.device)
    if m:
        _launch(x, q, s, m, k, kb, 1, (x.stride(0), 0), (q.stride(0), 0), (s.stride(0), s.stride(1), 0), pow2)
    return q, s


def _launch(x, q, s, m: int, k: int, kb: int, g: int, x_strides, q_strides, s_strides, pow2: bool, rope=None) -> None:
    """One _quant_kernel launch over g groups of m rows x kb blocks: strides (row, group) of x and q, (row, block,
    group) of the scales; the wrappers differ only in where each group's rows live. rope: an InverseRope for the
    rows (dsv4_kernels.rope), applied to x's values before they are quantised."""
    cos, sin = (x, x) if rope is None else _rope_tables(rope, m)
    _quant_kernel[(triton.cdiv(m, BLOCK_M), kb, g)](
        x,
        q.view(torch.uint8),
        s,
        m,
        k,
        x_strides[0],
        q_strides[0],
        s_strides[0],
        s_strides[1],
        x_strides[1],
        q_strides[1],
        s_strides[2],
        cos,
        sin,
        cos.stride(0) if rope is not None else 0,
        rope.head_dim if rope is not None else 1,
        rope.head_dim - 2 * rope.cos.shape[1] if rope is not None else 0,
        POW2=pow2,
        HW_FP8=x.is_cuda and USE_HW_FP8_CAST,
        BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK,
        ROPE=rope is not None,
        BF16=x.dtype == torch.bfloat16,
        **pdl_kwargs(x),
    )


def _rope_tables(rope, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' cos / sin as the kernel reads them: fp32 [M, half] with one shared row stride."""
    cos, sin = rope.cos, rope.sin
    if cos.shape[0] != m or sin.shape != cos.shape or rope.head_dim % 2 or 2 * cos.shape[1] > rope.head_dim:
        raise ValueError(f"rope tables {tuple(cos.shape)} / {tuple(sin.shape)} do not fit {m} rows of {rope.head_dim}")
    cos, sin = cos.float(), sin.float()
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def quant_act_1x128_grouped(
    x: torch.Tensor, pow2: bool = True, rows: int | None = None, rope=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [G, M, K] (unit last stride, any group / row strides: a transposed [M, G, K] view needs no copy) ->
    (e4m3 [G, M, K] contiguous, fp32 scales [G, M, ceil(K/128)]) in one launch; q[g], s[g] are exactly
    `quant_act_1x128(x[g])`'s outputs, each group's scales MN-major with the same padded stride.
    rows (>= M): each group gets `rows` rows of storage and both outputs are [G, rows, ...]; rows M.. are left
    unwritten (DeepGEMM's masked grouped GEMM stores whole M tiles, so its per-group M must be tile-aligned).
    rope: a dsv4_kernels.rope.InverseRope of the M rows (each group's K channels whole heads): the values are turned
    back by it first, as `rope.apply` would (V4's attention output before wo_a), in the same launch."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"activations must be [G, M, K] with a unit last stride, got {tuple(x.shape)} {x.stride()}")
    require_triton(x.device)
    g, m, k = x.shape
    if rope is not None and k % rope.head_dim:
        raise ValueError(f"a group's K={k} must be whole heads of {rope.head_dim} for its rope")
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"rows must be >= M={m}, got {rows}")
    kb = triton.cdiv(k, BLOCK)
    q = torch.empty(g, rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    m_pad = (rows + 3) // 4 * 4
    buf = torch.empty(g, kb, m_pad, dtype=torch.float32, device=x.device)
    s = buf.transpose(1, 2)[:, :rows]  # s[g] = scale_buffer(rows, kb)'s layout
    if m and g:
        x_st, q_st, s_st = (
            (x.stride(1), x.stride(0)),
            (q.stride(1), q.stride(0)),
            (s.stride(1), s.stride(2), s.stride(0)),
        )
        _launch(x, q, s, m, k, kb, g, x_st, q_st, s_st, pow2, rope)
    return q, s


def quant_act_1x128_joined(x: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [G, M, K] (unit last stride, any group / row strides; e.g. a grouped GEMM's per-group outputs) -> the
    quantisation of its groups joined side by side, [M, G*K] (row m = x[0, m] | x[1, m] | ...): (e4m3 [M, G*K], fp32
    scales [M, G*ceil(K/128)] MN-major), exactly `quant_act_1x128(x.transpose(0, 1).reshape(M, -1))` when K is whole
    128-blocks, in one launch and without the joined bf16 copy."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"activations must be [G, M, K] with a unit last stride, got {tuple(x.shape)} {x.stride()}")
    require_triton(x.device)
    g, m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"joined groups need K in whole {BLOCK}-blocks, got K={k}")
    kb = k // BLOCK
    q = torch.empty(m, g * k, dtype=torch.float8_e4m3fn, device=x.device)
    s = scale_buffer(m, g * kb, x.device)  # [M, G*kb]; group j's blocks are columns j*kb..
    if m and g:
        # group j's codes start k columns after group j-1's, and its scales kb columns after
        _launch(
            x, q, s, m, k, kb, g, (x.stride(1), x.stride(0)), (q.stride(0), k), (*s.stride(), kb * s.stride(1)), pow2
        )
    return q, s
