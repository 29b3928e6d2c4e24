"""mHC pre for long steps (prefill chunks): whole-row collapses, then the mixing weights for blocks of tokens.

`dsv4_kernels.triton_mhc.hc_pre` sends steps longer than `split_max_tokens` here after torch's fp32 matmul
(cuBLAS) has written the mixing logits of the un-normalised streams. Two launches follow:
- `_hc_collapse_kernel`, one token a program with its hc x D streams in registers: the sum of squares (the mixing
  RMSNorm's statistic, stored for the next kernel), pre = sigmoid + eps, collapsed = sum_i pre_i * stream_i
  rounded to the streams' dtype, then the block's optional input RMSNorm over the row, all from one read.
- `_hc_weights_kernel`, BLOCK_T tokens a program, vectorised over them: post = 2 sigmoid, comb = row softmax +
  eps and Sinkhorn (column norm, then iters-1 x (row, column)) -> post [T, hc], comb [T, hc, hc] fp32. (Sinkhorn's
  hc x hc sums in a many-warp program a token are cross-warp reductions, 40 barriers in a row.)
The path this replaced (one program a token reading its streams three times) took 0.49 ms a call at 8K tokens on
the H200 after cuBLAS's 0.27 ms, against a 0.13 ms read of the fp32 streams (BENCHMARKS.md, "mHC pre").
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

WEIGHT_BLOCK_T = 64  # tokens a weights program: [64, hc, hc] tiles, the Sinkhorn sums stay per token
ROW_ELEMS_PER_WARP = 2048  # fp32 stream elements a warp holds in the collapse (64 registers a thread)


@triton.jit(do_not_specialize=["T"])
def _hc_collapse_kernel(
    streams_ptr,
    logits_ptr,
    base_ptr,
    scale_ptr,
    normw_ptr,
    out_ptr,
    sumsq_ptr,
    T,
    HC,
    D,
    hc_eps,
    norm_eps,
    out_eps,
    stride_st,
    stride_sh,
    stride_lt,
    stride_ot,
    HC_P: tl.constexpr,
    D_P: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token t: sumsq[t] = sum of its streams' squares; pre_i = sigmoid(logits[t, i] * rsqrt(sumsq / (HC*D)
    + norm_eps) * scale[0] + base[i]) + hc_eps; out[t] = sum_i pre_i * streams[t, i] (rounded to the streams'
    dtype), then with NORM the block's input RMSNorm: normw * (y * rsqrt(mean(y^2) + out_eps)), fp32 math, one
    rounding to out's dtype."""
    tl_pdl_wait(PDL)
    t = tl.program_id(0)
    i = tl.arange(0, HC_P)
    cols = tl.arange(0, D_P)
    imask = i < HC
    dmask = cols < D
    x = tl.load(
        streams_ptr + t.to(tl.int64) * stride_st + i[:, None] * stride_sh + cols[None, :],
        mask=imask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    sumsq = tl.sum(tl.sum(x * x, axis=1), axis=0)
    rinv = tl.rsqrt(sumsq / (HC * D) + norm_eps)
    logit = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + i, mask=imask, other=0.0)
    pre = tl.sigmoid(logit * rinv * tl.load(scale_ptr).to(tl.float32) + tl.load(base_ptr + i, mask=imask, other=0.0))
    pre = tl.where(imask, pre + hc_eps, 0.0)
    y = tl.sum(pre[:, None] * x, axis=0)
    y = y.to(streams_ptr.dtype.element_ty).to(tl.float32)  # the collapsed row as the reference rounds it
    if NORM:
        r = tl.rsqrt(tl.sum(y * y, axis=0) / D + out_eps)
        w = tl.load(normw_ptr + cols, mask=dmask, other=0.0).to(tl.float32)
        y = w * (y * r)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=dmask)
    tl.store(sumsq_ptr + t, sumsq)


@triton.jit(do_not_specialize=["T", "stride_lt"])
def _hc_weights_kernel(
    logits_ptr,
    sumsq_ptr,
    base_ptr,
    scale_ptr,
    post_ptr,
    comb_ptr,
    T,
    HC,
    D,
    iters,
    hc_eps,
    norm_eps,
    stride_lt,
    HC_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """logits: fp32 [T, (2+HC)*HC] (row stride stride_lt), sumsq: fp32 [T] -> post fp32 [T, HC], comb fp32
    [T, HC, HC]; padded stream entries stay exactly 0 so they never enter a sum."""
    tl_pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    i = tl.arange(0, HC_P)
    j = tl.arange(0, HC_P)
    imask = i < HC
    row_off = rows.to(tl.int64) * stride_lt
    rinv = tl.rsqrt(tl.load(sumsq_ptr + rows, mask=rmask, other=0.0) / (HC * D) + norm_eps)  # [BT]
    s1 = tl.load(scale_ptr + 1).to(tl.float32)
    s2 = tl.load(scale_ptr + 2).to(tl.float32)
    m2 = rmask[:, None] & imask[None, :]
    post = (
        tl.load(logits_ptr + row_off[:, None] + HC + i[None, :], mask=m2, other=0.0) * rinv[:, None] * s1
        + tl.load(base_ptr + HC + i, mask=imask, other=0.0)[None, :]
    )
    post = 2.0 * tl.sigmoid(post)
    cmask2 = imask[:, None] & (j < HC)[None, :]
    cmask = cmask2[None, :, :]  # [1, HC_P, HC_P]
    cidx = 2 * HC + i[:, None] * HC + j[None, :]  # comb[i, j] lives at 2*HC + i*HC + j
    logits = (
        tl.load(logits_ptr + row_off[:, None, None] + cidx[None, :, :], mask=rmask[:, None, None] & cmask, other=0.0)
        * rinv[:, None, None]
        * s2
        + tl.load(base_ptr + cidx, mask=cmask2, other=0.0)[None, :, :]
    )
    logits = tl.where(cmask, logits, float("-inf"))
    row_max = tl.max(logits, axis=2)
    row_max = tl.where(imask[None, :], row_max, 0.0)  # padded rows are all -inf: keep their exponent finite
    e = tl.where(cmask, tl.exp(logits - row_max[:, :, None]), 0.0)
    row_sum = tl.where(imask[None, :], tl.sum(e, axis=2), 1.0)
    comb = tl.where(cmask, e / row_sum[:, :, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(post_ptr + rows[:, None].to(tl.int64) * HC + i[None, :], post, mask=m2)
    tl.store(
        comb_ptr + rows[:, None, None].to(tl.int64) * HC * HC + cidx[None, :, :] - 2 * HC,
        comb,
        mask=rmask[:, None, None] & cmask,
    )


def collapse_and_weights(
    streams: torch.Tensor,
    logits: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    out_eps: float = 1e-6,
) -> None:
    """The rest of `triton_mhc.hc_pre` for a long step, written into out [T, D] (the collapsed row, or with
    norm_weight its RMSNorm), post fp32 [T, hc] and comb fp32 [T, hc, hc]. streams: [T, hc, D] (unit last
    stride); logits: fp32 [T, (2+hc)*hc] (unit last stride), the un-normalised streams @ fn^T."""
    t, hc, d = streams.shape
    n_mix = (2 + hc) * hc
    if logits.shape != (t, n_mix) or logits.stride(-1) != 1 or logits.dtype != torch.float32:
        raise ValueError(
            f"logits must be fp32 [T={t}, {n_mix}] with unit last stride, got {logits.dtype} {tuple(logits.shape)}"
        )
    base = base.float().contiguous()
    scale = scale.float().contiguous()
    sumsq = torch.empty(t, dtype=torch.float32, device=streams.device)
    hc_p, d_p = triton.next_power_of_2(hc), triton.next_power_of_2(d)
    norm = norm_weight is not None
    warps = min(16, max(4, hc_p * d_p // ROW_ELEMS_PER_WARP))
    _hc_collapse_kernel[(t,)](
        streams,
        logits,
        base,
        scale,
        norm_weight.contiguous() if norm_weight is not None else base,
        out,
        sumsq,
        t,
        hc,
        d,
        hc_eps,
        norm_eps,
        out_eps,
        streams.stride(0),
        streams.stride(1),
        logits.stride(0),
        out.stride(0),
        HC_P=hc_p,
        D_P=d_p,
        NORM=norm,
        num_warps=warps,
        **pdl_kwargs(streams),
    )
    _hc_weights_kernel[(triton.cdiv(t, WEIGHT_BLOCK_T),)](
        logits,
        sumsq,
        base,
        scale,
        post,
        comb,
        t,
        hc,
        d,
        iters,
        hc_eps,
        norm_eps,
        logits.stride(0),
        HC_P=hc_p,
        BLOCK_T=WEIGHT_BLOCK_T,
        **pdl_kwargs(logits),
    )
