"""Triton fused RMSNorm + interleaved partial RoPE (the q and kv prologue of V4 attention).

Reference: `dsv4_kernels.rope.apply_rope(norm(x), cos, sin)` with norm = `dsv4_kernels.norm.rms_norm` (kv, weighted)
or `dsv4_kernels.norm.unweighted_rms_norm` (q, per head). Rounding to x.dtype happens at the same points as
in the references (so bf16 results differ from them by about one ulp, not by accumulated drift):
- weighted: y = (w * (x * rsqrt(mean(x^2) + eps))).to(dtype), all fp32 before the cast;
- unweighted: y = (x * rsqrt(...).to(dtype)).to(dtype) (the reference multiplies in x.dtype);
- RoPE on the trailing rope_dim channels of y, pairs (2i, 2i+1), in fp32, cast back once.
One program normalises BLOCK_R rows (a row is one head of one token, or one token's kv). The rope
channels are re-loaded as separate even / odd vectors (cache hits) rather than de-interleaved in
registers, which keeps the kernel free of reshape/split layout shuffles.
Interpreter note: bf16 loads are converted to fp32 before any arithmetic, and the interpreter's fp32 -> bf16
cast truncates where the GPU rounds to nearest even (see dsv4_kernels/triton_attention_kernels.py).
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_cache_codecs import tl_round_to
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    N,
    H,
    D,
    HALF,
    eps,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_st,
    HAS_WEIGHT: tl.constexpr,
    D_P: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = n < N
    tok = (n // H).to(tl.int64)
    x_row = x_ptr + tok * stride_xt + (n % H) * stride_xh
    o_row = out_ptr + tok * stride_ot + (n % H) * stride_oh
    cols = tl.arange(0, D_P)
    nope = D - 2 * HALF
    x = tl.load(x_row[:, None] + cols[None, :], mask=rmask[:, None] & (cols < D)[None, :], other=0.0)
    x = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_R]
    if not HAS_WEIGHT:
        r = r.to(out_ptr.dtype.element_ty).to(tl.float32)  # the unweighted reference rounds the factor
    y = x * r[:, None]
    if HAS_WEIGHT:
        y = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :] * y
    tl.store(
        o_row[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < nope)[None, :]
    )

    # RoPE channels: even = nope + 2i, odd = nope + 2i + 1, normalised the same way, rounded, rotated.
    p = tl.arange(0, HALF_P)
    pm = rmask[:, None] & (p < HALF)[None, :]
    ev_col = nope + 2 * p
    ev = tl.load(x_row[:, None] + ev_col[None, :], mask=pm, other=0.0).to(tl.float32) * r[:, None]
    od = tl.load(x_row[:, None] + ev_col[None, :] + 1, mask=pm, other=0.0).to(tl.float32) * r[:, None]
    if HAS_WEIGHT:
        ev = tl.load(w_ptr + ev_col, mask=p < HALF, other=0.0).to(tl.float32)[None, :] * ev
        od = tl.load(w_ptr + ev_col + 1, mask=p < HALF, other=0.0).to(tl.float32)[None, :] * od
    ev = ev.to(out_ptr.dtype.element_ty).to(tl.float32)
    od = od.to(out_ptr.dtype.element_ty).to(tl.float32)
    c = tl.load(cos_ptr + tok[:, None] * stride_ct + p[None, :], mask=pm, other=1.0)
    s = tl.load(sin_ptr + tok[:, None] * stride_st + p[None, :], mask=pm, other=0.0)
    tl.store(o_row[:, None] + ev_col[None, :], (ev * c - od * s).to(out_ptr.dtype.element_ty), mask=pm)
    tl.store(o_row[:, None] + ev_col[None, :] + 1, (od * c + ev * s).to(out_ptr.dtype.element_ty), mask=pm)


def _rows_of(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int, int]:
    """Check x [T, D] / [T, H, D] (last dim contiguous) against cos / sin [T, rope_dim // 2] -> (T, H, D)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] or [T, H, D] with unit stride on the last dim, got {tuple(x.shape)}")
    t, d = x.shape[0], x.shape[-1]
    h = x.shape[1] if x.dim() == 3 else 1
    if cos.dim() != 2 or cos.shape[0] != t or sin.shape != cos.shape or 2 * cos.shape[1] > d:
        raise ValueError(
            f"cos/sin must be [T={t}, rope_dim // 2 <= {d // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    return t, h, d


def rms_norm_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None = None,
    *,
    block_r: int | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim, then interleaved RoPE on its trailing 2 * cos.shape[-1] channels.

    x: [T, D] (kv, pass `weight` [D]) or [T, H, D] (q, weight None = per-head unweighted norm; a weight
    is applied to every head if given); last dim contiguous. cos, sin: fp32 [T, rope_dim // 2] at each
    token's position. -> same shape as x, x.dtype. Equals
    `apply_rope(rms_norm(x, weight, eps), cos, sin)` or `apply_rope(unweighted_rms_norm(x, eps), cos, sin)`.
    """
    t, h, d = _rows_of(x, cos, sin)
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"weight must be [D={d}], got {tuple(weight.shape)}")
    require_triton(x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = t * h
    if n == 0:
        return out
    x3, o3 = x.view(t, h, d) if x.dim() == 2 else x, out.view(t, h, d)
    cos, sin = cos.float(), sin.float()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    half = cos.shape[1]
    d_p = triton.next_power_of_2(d)
    block_r = block_r or max(1, min(16, 8192 // d_p))  # ~8K values per program
    extra = {"num_warps": 4} if x.is_cuda else {}
    _norm_rope_kernel[(triton.cdiv(n, block_r),)](
        x3,
        weight if weight is not None else x3,
        cos,
        sin,
        o3,
        n,
        h,
        d,
        half,
        eps,
        x3.stride(0),
        x3.stride(1),
        o3.stride(0),
        o3.stride(1),
        cos.stride(0),
        sin.stride(0),
        HAS_WEIGHT=weight is not None,
        D_P=d_p,
        HALF_P=max(1, triton.next_power_of_2(half)),
        BLOCK_R=block_r,
        **extra,
        **pdl_kwargs(x3),
    )
    return out


# ---- RoPE alone (the attention output's inverse rotation, the indexer queries) --------------------------------
@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    N,
    H,
    D,
    HALF,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_st,
    SIGN: tl.constexpr,
    NOPE_P: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BF16: tl.constexpr,
    COPY_NOPE: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = n < N
    tok = (n // H).to(tl.int64)
    x_row = x_ptr + tok * stride_xt + (n % H) * stride_xh
    o_row = out_ptr + tok * stride_ot + (n % H) * stride_oh
    dt = out_ptr.dtype.element_ty
    nope = D - 2 * HALF
    if COPY_NOPE:  # (in place the non-rotated channels are already where they belong)
        cn = tl.arange(0, NOPE_P)
        nm = rmask[:, None] & (cn < nope)[None, :]
        tl.store(o_row[:, None] + cn[None, :], tl.load(x_row[:, None] + cn[None, :], mask=nm, other=0.0), mask=nm)
    p = tl.arange(0, HALF_P)
    pm = rmask[:, None] & (p < HALF)[None, :]
    ce = nope + 2 * p
    ev = tl.load(x_row[:, None] + ce[None, :], mask=pm, other=0.0).to(tl.float32)
    od = tl.load(x_row[:, None] + ce[None, :] + 1, mask=pm, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + tok[:, None] * stride_ct + p[None, :], mask=pm, other=1.0)
    s = tl.load(sin_ptr + tok[:, None] * stride_st + p[None, :], mask=pm, other=0.0) * SIGN
    tl.store(o_row[:, None] + ce[None, :], tl_round_to(ev * c - od * s, BF16, dt).to(dt), mask=pm)
    tl.store(o_row[:, None] + ce[None, :] + 1, tl_round_to(od * c + ev * s, BF16, dt).to(dt), mask=pm)


@triton.jit
def _rope_pairs_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    N,
    H,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    SIGN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """In place, rows [BLOCK_R] x the 2*HALF rope channels as one contiguous tile: whole-row vector loads and
    stores, the (even, odd) pairs split in registers (the strided even / odd loads of _rope_kernel issue one narrow
    access per element)."""
    tl_pdl_wait(PDL)
    n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = n < N
    tok = (n // H).to(tl.int64)
    row = x_ptr + tok * stride_xt + (n % H) * stride_xh + NOPE
    c2 = tl.arange(0, 2 * HALF)
    dt = x_ptr.dtype.element_ty
    v = tl.load(row[:, None] + c2[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    ev, od = tl.split(tl.reshape(v, [BLOCK_R, HALF, 2]))
    p = tl.arange(0, HALF)
    c = tl.load(cos_ptr + tok[:, None] * stride_ct + p[None, :], mask=rmask[:, None], other=1.0)
    s = tl.load(sin_ptr + tok[:, None] * stride_st + p[None, :], mask=rmask[:, None], other=0.0) * SIGN
    new_ev = tl_round_to(ev * c - od * s, BF16, dt)
    new_od = tl_round_to(od * c + ev * s, BF16, dt)
    out = tl.reshape(tl.join(new_ev, new_od), [BLOCK_R, 2 * HALF])
    tl.store(row[:, None] + c2[None, :], out.to(dt), mask=rmask[:, None])


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    *,
    block_r: int | None = None,
    inplace: bool = False,
    num_warps: int = 4,
    pairs: bool | None = None,
) -> torch.Tensor:
    """`dsv4_kernels.rope.apply_rope(x, cos, sin, inverse)` in one launch: x [T, D] or [T, H, D] (last dim contiguous),
    cos / sin fp32 [T, rope_dim // 2]. -> a new tensor of x's shape and dtype (bf16 rounded by bits), or with
    inplace x itself, only its rope channels read and written (the attention output's inverse rotation: 64 of 512
    channels, where a copy moved all of them, 0.37 ms a layer at 8K tokens on the H200). block_r: rows (token x
    head) a program, default 16 (a copy moves whole rows); in place (only the rope pairs) rows / 128 rounded up to
    a power of two within [4, 32] (pairs kernel) or [4, 128] (strided kernel): few rows a program at decode sizes
    (a batch-1 step's 64 rows in one program took 8.7 us a layer). num_warps: the launch's warps on CUDA.
    pairs (in place, a power-of-two rope width; None = there): _rope_pairs_kernel, the rope channels as one
    contiguous tile, bit-equal to the strided kernel; at 8K tokens x 64 heads on an H100 it takes 52 us (85% of copy
    bandwidth) against the strided kernel's 562 us at its old default of 128 rows (111 us at its best, 8 rows)
    (`dsv4 bench kernels rope`: its best configs at 8, 32 and 64 rows within 1%)."""
    t, h, d = _rows_of(x, cos, sin)
    require_triton(x.device)
    out = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = cos.shape[1]
    pow2 = half > 0 and half == triton.next_power_of_2(half)
    if pairs is None:
        pairs = inplace and pow2
    if block_r is None:
        cap = 32 if pairs else 128
        block_r = min(cap, max(4, triton.next_power_of_2(triton.cdiv(t * h, 128)))) if inplace else 16
    if t * h == 0:
        return out
    x3, o3 = (x.view(t, 1, d), out.view(t, 1, d)) if x.dim() == 2 else (x, out)
    cos = cos if cos.dtype == torch.float32 and cos.stride(-1) == 1 else cos.float().contiguous()
    sin = sin if sin.dtype == torch.float32 and sin.stride(-1) == 1 else sin.float().contiguous()
    extra = {"num_warps": num_warps} if x.is_cuda else {}
    if pairs and inplace and pow2:
        _rope_pairs_kernel[(triton.cdiv(t * h, block_r),)](
            x3,
            cos,
            sin,
            t * h,
            h,
            x3.stride(0),
            x3.stride(1),
            cos.stride(0),
            sin.stride(0),
            NOPE=d - 2 * half,
            HALF=half,
            SIGN=-1.0 if inverse else 1.0,
            BLOCK_R=block_r,
            BF16=x.dtype == torch.bfloat16,
            **extra,
            **pdl_kwargs(x3),
        )
        return out
    _rope_kernel[(triton.cdiv(t * h, block_r),)](
        x3,
        cos,
        sin,
        o3,
        t * h,
        h,
        d,
        half,
        x3.stride(0),
        x3.stride(1),
        o3.stride(0),
        o3.stride(1),
        cos.stride(0),
        sin.stride(0),
        SIGN=-1.0 if inverse else 1.0,
        NOPE_P=max(1, triton.next_power_of_2(d - 2 * half)),
        HALF_P=max(1, triton.next_power_of_2(half)),
        BLOCK_R=block_r,
        BF16=x.dtype == torch.bfloat16,
        COPY_NOPE=not inplace,
        **extra,
        **pdl_kwargs(x3),
    )
    return out
