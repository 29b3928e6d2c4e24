"""Triton hc_head + final RMSNorm: the residual streams of the logit rows -> the LM head's input, in two launches.

Reference: `rms_norm(dsv4_kernels.mhc.hc_head(streams[rows], fn, base, scale, hc_eps, norm_eps), norm_weight,
out_eps).to(out_dtype)`, which torch runs as ~20 small kernels (the row gather, the mixing norm's pow / mean /
add / rsqrt / mul, cuBLAS's dot, sigmoid, the collapse's mul / sum, then the final norm's six): at batch-1 decode
they were ~37 us of a 1.2 ms step. Here, per logit row n (token r = rows[n]) with hc streams of width D:
- launch 1, `_head_mix_kernel`, grid (N, splits): split-K over the flattened streams (K = hc * D), each program
  writes its hc partial dots with fn and its partial sum of squares (the mixing RMSNorm's statistic; the norm
  has no weight, so the logits are rsqrt(mean(x^2) + eps) * (x @ fn^T)). Splitting spreads a decode step's one
  token (16K-long dots, fn 256 KB) over ~128 programs; one program a token would be latency-bound;
- launch 2, `_head_norm_kernel`, one program a row: adds the partials, pre = sigmoid(logit * scale + base) + eps,
  then collapses y = sum_i pre_i * stream_i (rounded to the streams' dtype, as the reference returns it) in
  two passes over D: the sum of squares of y, then out = weight * y * rsqrt(mean(y^2) + out_eps), rounded to
  the streams' dtype and then to out_dtype (the reference's two casts). The second pass recomputes y from the
  streams (bitwise the same, and in cache) rather than re-reading memory other threads wrote.
The row gather is the kernels' own index load (`rows`), so the gathered copy of the streams is never written.
All math is fp32. Interpreter note: loads are converted to fp32 before any arithmetic.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

# Split K until about this many programs run (as dsv4_kernels.triton_mhc_mix.MIX_PROGRAMS for the layers' mix).
MIX_PROGRAMS = 128
MIX_BLOCK_K = 128
# The norm kernel adds a row's partials this many splits a load.
SPLITS_PER_LOAD = 128


@triton.jit(do_not_specialize=["N", "k_per_split", "stride_ps", "stride_pn"])
def _head_mix_kernel(
    streams_ptr,
    rows_ptr,
    fn_ptr,
    part_ptr,
    N,
    D,
    K,
    HC,
    k_per_split,
    stride_st,
    stride_sh,
    stride_fn,
    stride_ps,
    stride_pn,
    HC_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATHER: tl.constexpr,
    PDL: tl.constexpr,
):
    """part[s, n, m < HC] = this split's sum of x[k] * fn[m, k]; part[s, n, HC] = its sum of x[k]^2, where x is
    the flattened streams of token rows[n] (token n without GATHER)."""
    tl_pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    r = n
    if GATHER:
        r = tl.load(rows_ptr + n).to(tl.int64)
    m = tl.arange(0, HC_P)
    mmask = m < HC
    k_lo = tl.program_id(1) * k_per_split
    acc = tl.zeros([HC_P], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(streams_ptr + r * stride_st + (k // D) * stride_sh + (k % D), mask=kmask, other=0.0)
        x = x.to(tl.float32)
        w = tl.load(fn_ptr + m[:, None] * stride_fn + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        sq += x * x
    acc = tl.where(m == HC, tl.sum(sq, axis=0), acc)  # (HC < HC_P: the column is free)
    tl.store(part_ptr + tl.program_id(1) * stride_ps + n * stride_pn + m, acc, mask=m <= HC)


@triton.jit
def _partials(part_ptr, n, m, mask, splits, stride_ps, stride_pn, SB: tl.constexpr):
    """Row n's partials at columns `m` summed over the splits, SB splits a load."""
    acc = tl.zeros(m.shape, dtype=tl.float32)
    for s0 in range(0, splits, SB):
        s = s0 + tl.arange(0, SB)
        acc += tl.sum(
            tl.load(
                part_ptr + s[:, None] * stride_ps + n * stride_pn + m[None, :],
                mask=(s < splits)[:, None] & mask[None, :],
                other=0.0,
            ),
            axis=0,
        )
    return acc


@triton.jit
def _collapse(s_row, pre, h, imask, cols, dmask, stride_sh):
    """sum_i pre_i * stream_i over the columns `cols`, rounded to the streams' dtype, back as fp32."""
    x = tl.load(s_row + h[:, None] * stride_sh + cols[None, :], mask=imask[:, None] & dmask[None, :], other=0.0)
    y = tl.sum(pre[:, None] * x.to(tl.float32), axis=0)
    return y.to(s_row.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["splits", "stride_ps", "stride_pn"])
def _head_norm_kernel(
    streams_ptr,
    rows_ptr,
    part_ptr,
    base_ptr,
    scale_ptr,
    normw_ptr,
    out_ptr,
    D,
    HC,
    hc_eps,
    norm_eps,
    out_eps,
    splits,
    stride_st,
    stride_sh,
    stride_ps,
    stride_pn,
    stride_ot,
    HC_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SB: tl.constexpr,
    GATHER: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    r = n
    if GATHER:
        r = tl.load(rows_ptr + n).to(tl.int64)
    h = tl.arange(0, HC_P)
    imask = h < HC
    sums = _partials(part_ptr, n, h, h <= HC, splits, stride_ps, stride_pn, SB)
    sumsq = tl.sum(tl.where(h == HC, sums, 0.0), axis=0)
    rinv = tl.rsqrt(sumsq / (HC * D) + norm_eps)
    logit = sums * rinv * tl.load(scale_ptr).to(tl.float32) + tl.load(base_ptr + h, mask=imask, other=0.0)
    pre = tl.where(imask, tl.sigmoid(logit) + hc_eps, 0.0)
    s_row = streams_ptr + r * stride_st

    # Pass 1: the collapsed row's sum of squares (the final norm's statistic).
    ysq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        y = _collapse(s_row, pre, h, imask, cols, dmask, stride_sh)
        ysq += tl.where(dmask, y * y, 0.0)
    rn = tl.rsqrt(tl.sum(ysq, axis=0) / D + out_eps)

    # Pass 2: the weighted norm, rounded as the reference rounds it (streams' dtype, then out_dtype).
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        y = _collapse(s_row, pre, h, imask, cols, dmask, stride_sh)
        w = tl.load(normw_ptr + cols, mask=dmask, other=0.0).to(tl.float32)
        out = (w * (y * rn)).to(streams_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + n * stride_ot + cols, out, mask=dmask)


def _check(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight, rows):
    if streams.dim() != 3 or streams.stride(-1) != 1:
        raise ValueError(f"streams must be [T, hc, D] with unit stride on the last dim, got {tuple(streams.shape)}")
    _, hc, d = streams.shape
    if fn.shape != (hc, hc * d) or base.shape != (hc,) or scale.numel() != 1:
        raise ValueError(
            f"fn must be [hc={hc}, hc*D={hc * d}], base [{hc}], scale [1]; got {tuple(fn.shape)}, "
            f"{tuple(base.shape)}, {tuple(scale.shape)}"
        )
    if norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [D={d}], got {tuple(norm_weight.shape)}")
    if rows is not None and (rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"rows must be a 1-D int32 / int64 tensor, got {rows.dtype} {tuple(rows.shape)}")
    require_triton(streams.device)


def hc_head_norm(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    norm_weight: torch.Tensor,
    out_eps: float,
    out_dtype: torch.dtype,
    rows: torch.Tensor | None = None,
    *,
    block_d: int = 1024,
) -> torch.Tensor:
    """streams: [T, hc, D]; fn: [hc, hc*D]; base: [hc]; scale: [1]; norm_weight: [D]; rows: int [N] (token rows
    of `streams` to take; None: all T) -> [N, D] in out_dtype, as
    `rms_norm(hc_head(streams[rows], fn, base, scale, hc_eps, norm_eps), norm_weight, out_eps).to(out_dtype)`.
    Rows are not bounds-checked (no host sync): they must index streams."""
    _check(streams, fn, base, scale, norm_weight, rows)
    _, hc, d = streams.shape
    n = streams.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(n, d, dtype=out_dtype, device=streams.device)
    if n == 0:
        return out
    k = hc * d
    splits = max(1, min(triton.cdiv(k, MIX_BLOCK_K), triton.cdiv(MIX_PROGRAMS, n)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), MIX_BLOCK_K) * MIX_BLOCK_K
    splits = triton.cdiv(k, k_per_split)
    parts = torch.empty(splits, n, hc + 1, dtype=torch.float32, device=streams.device)
    hc_p = triton.next_power_of_2(hc + 1)
    gather = rows is not None
    row_ids = rows.contiguous() if rows is not None else parts  # (an unread placeholder pointer without GATHER)
    fn = fn.float().contiguous()  # (V4 keeps hc_head_fn fp32: no copy)
    cuda = streams.is_cuda
    _head_mix_kernel[(n, splits)](
        streams,
        row_ids,
        fn,
        parts,
        n,
        d,
        k,
        hc,
        k_per_split,
        streams.stride(0),
        streams.stride(1),
        fn.stride(0),
        parts.stride(0),
        parts.stride(1),
        HC_P=hc_p,
        BLOCK_K=MIX_BLOCK_K,
        GATHER=gather,
        **({"num_warps": 4} if cuda else {}),
        **pdl_kwargs(streams),
    )
    _head_norm_kernel[(n,)](
        streams,
        row_ids,
        parts,
        base.float().contiguous(),
        scale.float().contiguous(),
        norm_weight.contiguous(),
        out,
        d,
        hc,
        hc_eps,
        norm_eps,
        out_eps,
        splits,
        streams.stride(0),
        streams.stride(1),
        parts.stride(0),
        parts.stride(1),
        out.stride(0),
        HC_P=hc_p,
        BLOCK_D=min(block_d, triton.next_power_of_2(d)),
        SB=min(SPLITS_PER_LOAD, triton.next_power_of_2(splits)),
        GATHER=gather,
        **({"num_warps": 8} if cuda else {}),
        **pdl_kwargs(streams),
    )
    return out
