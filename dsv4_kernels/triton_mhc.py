"""Triton mHC (manifold-constrained hyper-connections): fused pre (weights + Sinkhorn + collapse) and post.

Reference: `dsv4_kernels.mhc.hc_pre` / `hc_post`. Per token with hc streams of width D:
- pre: the (2+hc)*hc mixing logits are RMSNorm(flat streams) @ fn^T, computed split-K on the raw streams by
  dsv4_kernels.triton_mhc_mix (one partial sum a split, plus each split's sum of squares: the norm's statistic);
  the pre kernel adds the partials and applies the per-token factor. Then, all in registers: pre = sigmoid + eps,
  post = 2 sigmoid, comb = row softmax + eps, Sinkhorn (column norm, then iters-1 x (row, column)), and
  collapsed = sum_i pre_i * stream_i.
  Steps of up to split_max_tokens(dtype) tokens (fp32 streams: 256; bf16: all) run on a (T, D / BLOCK_D) grid:
  every program derives its token's weights (hc*hc is tiny) and collapses one block of D, so a token is spread over
  many programs (one program a token looping over D is latency-bound at decode sizes); the optional input RMSNorm
  (`norm_weight`) is a third launch over whole rows. These programs run as one warp: the Sinkhorn iterations'
  [hc, hc] sums would otherwise be cross-warp reductions (shared memory and a barrier each, 40 in a row).
  Longer steps take the long path: torch's fp32 matmul for the logits, then dsv4_kernels/triton_mhc_rows.py (a
  whole-row collapse a token, then the weights of token blocks). Measured in BENCHMARKS.md, "mHC pre: split
  kernels vs the long path".
- post: new_streams[j] = post_j * block_out + sum_i comb[i, j] * streams[i]; grid (T, D / BLOCK_D).
All mixing math is fp32 (as in the reference); outputs round once to the streams' dtype.
Interpreter note: bf16 loads are converted to fp32 before any arithmetic (see dsv4_kernels/triton_attention_kernels.py).
"""

from __future__ import annotations

import torch

from dsv4_kernels import triton_mhc_rows
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.settings import settings
from dsv4_kernels.triton_fp8_quant import quant_act_1x128
from dsv4_kernels.triton_mhc_mix import mix_partials, split_max_tokens
from dsv4_kernels.triton_norm_quant import MAX_K, rms_norm_quant
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


# The split pre kernel adds a token's split-K partials this many splits a load (each load is a dependent global
# read; BENCHMARKS.md, "mHC pre").
PRE_SPLITS_PER_LOAD = 128
# The long path: torch's fp32 matmul (cuBLAS) for the logits, then "rows" (dsv4_kernels/triton_mhc_rows.py: a
# whole-row collapse a token, its sum of squares and norm fused, then weights for blocks of tokens) or "token"
# (one _hc_pre_kernel program a token, which reads its streams three times). $DSV4_HC_LONG_PATH overrides.
LONG_PATH = settings().hc_long_path  # "rows" or "token" (checked when parsed)


@triton.jit
def tl_mix_sum(m_row, idx, mask, splits, stride_ms, SB: tl.constexpr):
    """The mixing logits at `idx` (1-D) of one token: the sum of its split-K partials, SB splits a load (one
    split a load was 128 dependent loads in a row at batch 1, three times over)."""
    acc = tl.zeros(idx.shape, dtype=tl.float32)
    for s0 in range(0, splits, SB):
        s = s0 + tl.arange(0, SB)
        acc += tl.sum(
            tl.load(
                m_row + s[:, None] * stride_ms + idx[None, :], mask=(s < splits)[:, None] & mask[None, :], other=0.0
            ),
            axis=0,
        )
    return acc


@triton.jit
def tl_mix_sum2(m_row, idx, mask, splits, stride_ms, SB: tl.constexpr):
    """tl_mix_sum of a 2-D `idx` (the comb logits)."""
    acc = tl.zeros(idx.shape, dtype=tl.float32)
    for s0 in range(0, splits, SB):
        s = s0 + tl.arange(0, SB)
        acc += tl.sum(
            tl.load(
                m_row + s[:, None, None] * stride_ms + idx[None, :, :],
                mask=(s < splits)[:, None, None] & mask[None, :, :],
                other=0.0,
            ),
            axis=0,
        )
    return acc


@triton.jit
def tl_mixing(m_row, base_ptr, scale_ptr, rinv, i, j, imask, HC, iters, hc_eps, splits, stride_ms, SB: tl.constexpr):
    """One token's mixing weights from its split-K logit partials: (pre [HC_P], post [HC_P], comb [HC_P, HC_P],
    comb's mask). pre = sigmoid + eps, post = 2 sigmoid, comb = row softmax + eps, then Sinkhorn (column norm,
    then iters-1 x (row, column)); padded entries stay exactly 0 so they never enter a sum."""
    s0 = tl.load(scale_ptr).to(tl.float32)
    s1 = tl.load(scale_ptr + 1).to(tl.float32)
    s2 = tl.load(scale_ptr + 2).to(tl.float32)
    pre = tl_mix_sum(m_row, i, imask, splits, stride_ms, SB) * rinv * s0 + tl.load(base_ptr + i, mask=imask, other=0.0)
    pre = tl.where(imask, tl.sigmoid(pre) + hc_eps, 0.0)
    post = tl_mix_sum(m_row, HC + i, imask, splits, stride_ms, SB) * rinv * s1 + tl.load(
        base_ptr + HC + i, mask=imask, other=0.0
    )
    post = 2.0 * tl.sigmoid(post)
    # comb[i, j] lives at 2*HC + i*HC + j
    cmask = imask[:, None] & (j < HC)[None, :]
    cidx = 2 * HC + i[:, None] * HC + j[None, :]
    logits = tl_mix_sum2(m_row, cidx, cmask, splits, stride_ms, SB) * rinv * s2 + tl.load(
        base_ptr + cidx, mask=cmask, other=0.0
    )
    logits = tl.where(cmask, logits, float("-inf"))
    row_max = tl.max(logits, axis=1)
    row_max = tl.where(imask, row_max, 0.0)  # padded rows are all -inf: keep their exponent finite
    e = tl.where(cmask, tl.exp(logits - row_max[:, None]), 0.0)
    row_sum = tl.where(imask, tl.sum(e, axis=1), 1.0)
    comb = tl.where(cmask, e / row_sum[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    return pre, post, comb, cmask


@triton.jit
def tl_split_weights(
    m_row, base_ptr, scale_ptr, post_ptr, comb_ptr, t, HC, D, N_MIX, iters, hc_eps, norm_eps, splits, stride_ms,
    HC_P: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """Token t's mixing weights from its split-K partials at m_row (the streams' sum of squares in column N_MIX: the
    mixing RMSNorm's statistic), the way every program of a split pre kernel derives them (grid (T, D blocks)); the
    token's first program stores post and comb. -> (pre [HC_P], comb's mask [HC_P, HC_P])."""
    i = tl.arange(0, HC_P)
    j = tl.arange(0, HC_P)
    imask = i < HC
    sumsq = tl.sum(tl_mix_sum(m_row, N_MIX + i * 0, i == 0, splits, stride_ms, SB), axis=0)
    rinv = tl.rsqrt(sumsq / (HC * D) + norm_eps)
    pre, post, comb, cmask = tl_mixing(
        m_row, base_ptr, scale_ptr, rinv, i, j, imask, HC, iters, hc_eps, splits, stride_ms, SB
    )
    if tl.program_id(1) == 0:
        tl.store(post_ptr + t * HC + i, post, mask=imask)
        tl.store(comb_ptr + t * HC * HC + i[:, None] * HC + j[None, :], comb, mask=cmask)
    return pre, cmask


@triton.jit(do_not_specialize=["splits", "stride_ms", "stride_mt"])
def _hc_pre_kernel(
    streams_ptr,
    mixes_ptr,
    base_ptr,
    scale_ptr,
    collapsed_ptr,
    post_ptr,
    comb_ptr,
    normw_ptr,
    normed_ptr,
    HC,
    D,
    iters,
    hc_eps,
    norm_eps,
    out_eps,
    splits,
    stride_st,
    stride_sh,
    stride_ms,
    stride_mt,
    stride_ct,
    stride_nt,
    HC_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token (long steps: T programs fill the GPU)."""
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HC_P)
    j = tl.arange(0, HC_P)
    imask = i < HC
    s_row = streams_ptr + t * stride_st + i[:, None] * stride_sh

    # Pass 1: sum of squares of the flattened streams -> the RMSNorm factor of the mixing logits.
    sq = tl.zeros([HC_P, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(s_row + cols[None, :], mask=imask[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
        sq += x * x
    rinv = tl.rsqrt(tl.sum(tl.sum(sq, axis=1), axis=0) / (HC * D) + norm_eps)
    pre, post, comb, cmask = tl_mixing(
        mixes_ptr + t * stride_mt, base_ptr, scale_ptr, rinv, i, j, imask, HC, iters, hc_eps, splits, stride_ms, 1
    )
    tl.store(post_ptr + t * HC + i, post, mask=imask)
    tl.store(comb_ptr + t * HC * HC + i[:, None] * HC + j[None, :], comb, mask=cmask)

    # Pass 2: collapse (re-reads the token's streams, which the first pass just brought into cache).
    ysq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        dmask = cols < D
        x = tl.load(s_row + cols[None, :], mask=imask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * x, axis=0).to(collapsed_ptr.dtype.element_ty)
        if NORM:
            yf = y.to(tl.float32)  # the block input as the reference norms it: rounded to the streams' dtype
            ysq += tl.where(dmask, yf * yf, 0.0)
        else:
            tl.store(collapsed_ptr + t * stride_ct + cols, y, mask=dmask)
    if NORM:
        # Pass 3: the block's input RMSNorm (weighted, fp32) and one rounding to the block dtype. The collapsed
        # row is recomputed from the cached streams (bitwise the same), not re-read from memory written by
        # other threads of this program (no barrier between them).
        r = tl.rsqrt(tl.sum(ysq, axis=0) / D + out_eps)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            dmask = cols < D
            x = tl.load(s_row + cols[None, :], mask=imask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            y = tl.sum(pre[:, None] * x, axis=0).to(collapsed_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(normw_ptr + cols, mask=dmask, other=0.0).to(tl.float32)
            tl.store(normed_ptr + t * stride_nt + cols, (w * (y * r)).to(normed_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["splits", "stride_ms", "stride_mt"])
def _hc_pre_split_kernel(
    streams_ptr,
    mixes_ptr,
    base_ptr,
    scale_ptr,
    collapsed_ptr,
    post_ptr,
    comb_ptr,
    HC,
    D,
    N_MIX,
    iters,
    hc_eps,
    norm_eps,
    splits,
    stride_st,
    stride_sh,
    stride_ms,
    stride_mt,
    stride_ct,
    HC_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Short steps: grid (T, D / BLOCK_D). Each program derives its token's weights from the partials (the sum
    of squares rides in column N_MIX of them, from _hc_mix_kernel) and collapses one block of D."""
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HC_P)
    imask = i < HC
    m_row = mixes_ptr + t * stride_mt
    pre, _ = tl_split_weights(
        m_row, base_ptr, scale_ptr, post_ptr, comb_ptr, t, HC, D, N_MIX, iters, hc_eps, norm_eps, splits, stride_ms,
        HC_P, SB,
    )  # fmt: skip
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = cols < D
    x = tl.load(
        streams_ptr + t * stride_st + i[:, None] * stride_sh + cols[None, :],
        mask=imask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    y = tl.sum(pre[:, None] * x, axis=0)
    tl.store(collapsed_ptr + t * stride_ct + cols, y.to(collapsed_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _norm_rows_kernel(x_ptr, w_ptr, out_ptr, D, eps, stride_xt, stride_ot, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), fp32 math, one rounding (a row per program, whole)."""
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    dmask = cols < D
    x = tl.load(x_ptr + t * stride_xt + cols, mask=dmask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=dmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, (w * (x * r)).to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _hc_post_kernel(
    out_ptr,
    block_out_ptr,
    streams_ptr,
    post_ptr,
    comb_ptr,
    HC,
    D,
    stride_st,
    stride_sh,
    stride_bt,
    stride_ot,
    stride_oh,
    HC_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = cols < D
    i = tl.arange(0, HC_P)
    imask = i < HC
    x = tl.load(
        streams_ptr + t * stride_st + i[:, None] * stride_sh + cols[None, :],
        mask=imask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)  # [i, d]
    comb = tl.load(
        comb_ptr + t * HC * HC + i[:, None] * HC + i[None, :], mask=imask[:, None] & imask[None, :], other=0.0
    ).to(tl.float32)  # [i, j]
    post = tl.load(post_ptr + t * HC + i, mask=imask, other=0.0).to(tl.float32)  # [j]
    bo = tl.load(block_out_ptr + t * stride_bt + cols, mask=dmask, other=0.0).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [j, d] = sum_i comb[i, j] x[i, d]
    y = post[:, None] * bo[None, :] + mixed
    tl.store(
        out_ptr + t * stride_ot + i[:, None] * stride_oh + cols[None, :],
        y.to(out_ptr.dtype.element_ty),
        mask=imask[:, None] & dmask[None, :],
    )


def _check_streams(streams: torch.Tensor) -> None:
    if streams.dim() != 3 or streams.stride(-1) != 1:
        raise ValueError(f"streams must be [T, hc, D] with unit stride on the last dim, got {tuple(streams.shape)}")
    require_triton(streams.device)


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    block_d: int = 256,
    norm_weight: torch.Tensor | None = None,
    out_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
):
    """Fused mHC pre. streams: [T, hc, D]; fn: [(2+hc)*hc, hc*D]; base: [(2+hc)*hc]; scale: [3].

    -> (collapsed [T, D] in streams.dtype, post fp32 [T, hc], comb fp32 [T, hc, hc]), as
    `dsv4_kernels.mhc.hc_pre`. The logits matmul runs split-K in fp32 on the un-normalised streams (mix_partials).
    norm_weight [D]: the block's input RMSNorm is fused in too and the first output is
    `dsv4_kernels.norm.rms_norm(collapsed, norm_weight, out_eps).to(out_dtype)` (out_dtype None = streams.dtype),
    saving the norm's and the cast's kernels (a layer's attention and MoE inputs).
    """
    _check_streams(streams)
    t, hc, d = streams.shape
    n_mix = (2 + hc) * hc
    if fn.shape != (n_mix, hc * d):
        raise ValueError(f"fn must be [(2+hc)*hc={n_mix}, hc*D={hc * d}], got {tuple(fn.shape)}")
    if base.shape != (n_mix,) or scale.shape != (3,):
        raise ValueError(f"base must be [{n_mix}] and scale [3], got {tuple(base.shape)}, {tuple(scale.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn iters must be >= 1, got {iters}")
    collapsed = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=streams.device)
    norm = norm_weight is not None
    if norm_weight is not None and norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [D={d}], got {tuple(norm_weight.shape)}")
    normed = torch.empty(t, d, dtype=out_dtype or streams.dtype, device=streams.device) if norm else collapsed
    # (with the norm fused the plain collapsed row is never stored: `collapsed` only names its dtype)
    if t == 0:
        return normed, post, comb
    extra = {"num_warps": 4} if streams.is_cuda else {}
    block_d = min(block_d, triton.next_power_of_2(d))
    if t <= split_max_tokens(streams.dtype):  # spread each token over D blocks (one program a token is latency-bound)
        parts = mix_partials(streams, fn, sumsq=True)  # [splits, T, n_mix + 1] fp32
        _hc_pre_split_kernel[(t, triton.cdiv(d, block_d))](
            streams,
            parts,
            base.float().contiguous(),
            scale.float().contiguous(),
            collapsed,
            post,
            comb,
            hc,
            d,
            n_mix,
            iters,
            hc_eps,
            norm_eps,
            parts.shape[0],
            streams.stride(0),
            streams.stride(1),
            parts.stride(0),
            parts.stride(1),
            collapsed.stride(0),
            HC_P=triton.next_power_of_2(hc),
            BLOCK_D=block_d,
            SB=min(PRE_SPLITS_PER_LOAD, triton.next_power_of_2(parts.shape[0])),
            **({"num_warps": 1} if streams.is_cuda else {}),
            **pdl_kwargs(streams),
        )  # one warp: Sinkhorn's hc x hc sums stay in-warp
        if norm_weight is not None:
            _norm_rows_kernel[(t,)](
                collapsed,
                norm_weight.contiguous(),
                normed,
                d,
                out_eps,
                collapsed.stride(0),
                normed.stride(0),
                BLOCK_D=triton.next_power_of_2(d),
                num_warps=8,
                **pdl_kwargs(collapsed),
            )
        return normed, post, comb
    parts = mix_partials(streams, fn)  # [1, T, n_mix] fp32 (torch's matmul)
    if LONG_PATH == "rows":  # whole-row collapse + token-block weights (dsv4_kernels/triton_mhc_rows.py)
        triton_mhc_rows.collapse_and_weights(
            streams, parts[0], base, scale, iters, hc_eps, norm_eps, normed, post, comb, norm_weight, out_eps
        )
        return normed, post, comb
    _hc_pre_kernel[(t,)](
        streams,
        parts,
        base.float().contiguous(),
        scale.float().contiguous(),
        collapsed,
        post,
        comb,
        norm_weight.contiguous() if norm_weight is not None else collapsed,
        normed,
        hc,
        d,
        iters,
        hc_eps,
        norm_eps,
        out_eps,
        parts.shape[0],
        streams.stride(0),
        streams.stride(1),
        parts.stride(0),
        parts.stride(1),
        collapsed.stride(0),
        normed.stride(0),
        HC_P=triton.next_power_of_2(hc),
        BLOCK_D=block_d,
        NORM=norm,
        **extra,
        **pdl_kwargs(streams),
    )
    return normed, post, comb


def hc_pre_quant(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    norm_weight: torch.Tensor,
    out_eps: float,
    out_dtype: torch.dtype,
    pow2: bool,
):
    """hc_pre with the block's input RMSNorm fused (norm_weight [D]), plus that input's 1x128 FP8 quantisation for
    the block's first FP8 projection -> (normed [T, D] in out_dtype, e4m3 [T, D], fp32 scales [T, ceil(D/128)]
    MN-major, post fp32 [T, hc], comb fp32 [T, hc, hc]); the codes are `quant_act_1x128(normed, pow2)`'s.
    Split-kernel steps: the norm launch becomes dsv4_kernels.triton_norm_quant's norm + quantisation (one launch
    where there were two: the norm here and the projection's quantiser); long steps: hc_pre's fused norm, then
    the quantiser (the same launches as before, the quantiser moved here)."""
    args = (streams, fn, base, scale, iters, hc_eps, norm_eps)
    if streams.shape[0] <= split_max_tokens(streams.dtype) and streams.shape[-1] <= MAX_K:
        collapsed, post, comb = hc_pre(*args)
        normed, q, s = rms_norm_quant(collapsed, norm_weight, out_eps, pow2, out_dtype)
        return normed, q, s, post, comb
    normed, post, comb = hc_pre(*args, norm_weight=norm_weight, out_eps=out_eps, out_dtype=out_dtype)
    q, s = quant_act_1x128(normed, pow2)
    return normed, q, s, post, comb


def hc_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *, block_d: int = 512
) -> torch.Tensor:
    """Fused mHC post. block_out: [T, D]; streams: [T, hc, D]; post: [T, hc]; comb: [T, hc, hc].

    -> [T, hc, D] in streams.dtype: post_j * block_out + sum_i comb[i, j] * streams_i, computed in fp32
    and rounded once (the reference rounds each term to the streams' dtype).
    """
    _check_streams(streams)
    t, hc, d = streams.shape
    if block_out.shape != (t, d) or block_out.stride(-1) != 1:
        raise ValueError(f"block_out must be [T={t}, D={d}] with unit last stride, got {tuple(block_out.shape)}")
    if post.shape != (t, hc) or comb.shape != (t, hc, hc):
        raise ValueError(
            f"post must be [{t}, {hc}] and comb [{t}, {hc}, {hc}], got {tuple(post.shape)}, {tuple(comb.shape)}"
        )
    out = torch.empty(t, hc, d, dtype=streams.dtype, device=streams.device)
    if t == 0:
        return out
    block_d = min(block_d, triton.next_power_of_2(d))
    extra = {"num_warps": 4} if streams.is_cuda else {}
    _hc_post_kernel[(t, triton.cdiv(d, block_d))](
        out,
        block_out,
        streams,
        post.float().contiguous(),
        comb.float().contiguous(),
        hc,
        d,
        streams.stride(0),
        streams.stride(1),
        block_out.stride(0),
        out.stride(0),
        out.stride(1),
        HC_P=triton.next_power_of_2(hc),
        BLOCK_D=block_d,
        **extra,
        **pdl_kwargs(out),
    )
    return out
