"""Triton mHC between two blocks in two launches: post + the next mix, then pre + the next input's norm + quant.

Reference: `dsv4_kernels.mhc.hc_post`, then `hc_pre` of the next block, then
`dsv4_kernels.norm.rms_norm(collapsed, norm_weight, eps)` in the block's dtype and, for an FP8 first projection,
`dsv4_kernels.fp8_linear.quant_act_1x128` of that. dsv4_kernels.triton_mhc runs this as four launches a boundary
(post, mix partials, pre, norm + quant: ~14 us of kernels and three gaps at batch 1, eight boundaries a step on the
4-layer slice); here it is two:
- `_post_mix_kernel`, grid (T / TOK, D / BLOCK_D): each program makes one D block of the new streams
  (post_j * block_out + sum_i comb[i, j] * streams_i, rounded once to the streams' dtype and stored) and, from the
  stored values, that block's split-K partials of what the next pre needs: the (2+hc)*hc mixing logits
  (streams_flat @ fn^T), the streams' sum of squares (the mixing RMSNorm) and their hc x hc Gram matrix
  G[i, j] = sum_d s_i[d] s_j[d]. fn's block is loaded once and kept for TOK tokens. POST off: the streams are read
  as they are (a step's first block, after the embedding).
- `_pre_norm_quant_kernel`, grid (T, D / BLOCK_D), BLOCK_D whole 128-blocks: each program derives its token's
  weights (dsv4_kernels.triton_mhc.tl_mixing: sigmoid, softmax, Sinkhorn), collapses one D block, and norms it without
  the rest of the row: the collapsed row's sum of squares is pre^T G pre (sum_d (sum_i pre_i s_i[d])^2), so no
  whole-row pass is needed. Then normed = w * y * rsqrt(mean + eps), rounded once to the output dtype, and its
  1x128 e4m3 codes and scales (`tl_quant_1x128`, as every 1x128 writer here).
Precision: the reference squares the collapsed row after rounding it to the streams' dtype; pre^T G pre squares it
before. With fp32 streams (the engine's residual) that is the same value up to fp32 summation order; with bf16
streams the statistic differs by bf16 rounding noise averaged over D (tests/kernels/test_triton_mhc_chain.py checks
both against the reference chain).
Interpreter note: every load is converted to fp32 before any arithmetic (see dsv4_kernels/triton_attention_kernels.py).
"""

from __future__ import annotations

import torch

from dsv4_kernels.fp8_linear import BLOCK
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.settings import settings
from dsv4_kernels.triton_cache_codecs import USE_HW_FP8_CAST
from dsv4_kernels.triton_fp8_quant import scale_buffer, tl_quant_1x128
from dsv4_kernels.triton_mhc import PRE_SPLITS_PER_LOAD, tl_mix_sum2, tl_split_weights
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

# Steps of up to this many tokens take the chain (small decode batches, MTP verification of them); longer ones keep
# dsv4_kernels.triton_mhc's launches, whose mix runs on dot tiles (here every program keeps its fn block in
# registers and runs tokens on FMAs, TOK at a time): on an H100 (BENCHMARKS.md `decode_launches`) batch 1 went from
# 717 to 748 tok/s with the chain (and the router GEMV and the RoPE in wo_a's quantiser), but with the chain up to
# 256 tokens batch 64 went from 12356 to 12194. $DSV4_HC_CHAIN_MAX_TOKENS overrides (0: never); the kernels
# themselves take any step up to LIMIT_TOKENS, so a larger setting stops there (longer steps keep the four launches:
# a setting of 8192 once failed every 8K-token prefill step instead).
CHAIN_MAX_TOKENS = settings().hc_chain_max_tokens  # 8
LIMIT_TOKENS = 4096
# The post + mix kernel's D block: 64 columns give 64 programs a token at V4-Flash's D = 4096 (its fn block, 24 x 4 x
# 64 fp32, stays in registers), and 64 split-K partials for the pre kernel to add.
POST_MIX_BLOCK_D = 64
# The pre kernel's D block, in 128-wide quantisation blocks.
PRE_BLOCKS = 2


def partial_columns(hc: int) -> int:
    """Columns of a token's partials: the (2+hc)*hc logits, the sum of squares, the hc x hc Gram matrix."""
    return (2 + hc) * hc + 1 + hc * hc


@triton.jit(do_not_specialize=["T", "stride_ps"])  # (stride_ps = T x columns: no variant a step size)
def _post_mix_kernel(
    new_ptr,
    block_out_ptr,
    streams_ptr,
    post_ptr,
    comb_ptr,
    fn_ptr,
    part_ptr,
    T,
    HC,
    D,
    N_MIX,
    NCOL,
    stride_st,
    stride_sh,
    stride_bt,
    stride_nt,
    stride_nh,
    stride_fn,
    stride_ps,
    HC_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NM_P: tl.constexpr,
    TOK: tl.constexpr,
    POST: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    i = tl.arange(0, HC_P)
    imask = i < HC
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = cols < D
    xmask = imask[:, None] & dmask[None, :]
    m = tl.arange(0, NM_P)
    mmask = m < N_MIX
    # fn[m, i * D + d] as [NM_P, HC_P, BLOCK_D]: this block's columns of every logit, kept for TOK tokens
    w = tl.load(
        fn_ptr + m[:, None, None] * stride_fn + (i[:, None] * D + cols[None, :])[None, :, :],
        mask=mmask[:, None, None] & xmask[None, :, :],
        other=0.0,
    ).to(tl.float32)
    gcol = N_MIX + 1 + i[:, None] * HC + i[None, :]
    gmask = imask[:, None] & imask[None, :]
    part_row = part_ptr + tl.program_id(1) * stride_ps
    for k in range(TOK):
        t = tl.program_id(0) * TOK + k
        t64 = t.to(tl.int64)
        live = (i * 0 + t) < T  # [HC_P]: a past-the-end token of the last run (a vector: the interpreter's masks)
        lmask = xmask & live[:, None]
        x = tl.load(streams_ptr + t64 * stride_st + i[:, None] * stride_sh + cols[None, :], mask=lmask, other=0.0)
        x = x.to(tl.float32)  # [i, d]
        if POST:
            comb = tl.load(
                comb_ptr + t64 * HC * HC + i[:, None] * HC + i[None, :], mask=gmask & live[:, None], other=0.0
            )
            post = tl.load(post_ptr + t64 * HC + i, mask=imask & live, other=0.0)
            bo = tl.load(block_out_ptr + t64 * stride_bt + cols, mask=dmask & ((cols * 0 + t) < T), other=0.0)
            y = post[:, None] * bo.to(tl.float32)[None, :] + tl.sum(comb[:, :, None] * x[:, None, :], axis=0)
            y = y.to(new_ptr.dtype.element_ty)  # [j, d]
            tl.store(new_ptr + t64 * stride_nt + i[:, None] * stride_nh + cols[None, :], y, mask=lmask)
            x = tl.where(xmask, y.to(tl.float32), 0.0)  # the partials are of the streams as stored
        mix = tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)  # [NM_P]
        gram = tl.sum(x[:, None, :] * x[None, :, :], axis=2)  # [HC_P, HC_P]
        sumsq = tl.sum(tl.sum(x * x, axis=1), axis=0)
        out = part_row + t64 * NCOL
        tl.store(out + m, mix, mask=mmask & ((m * 0 + t) < T))
        tl.store(out + N_MIX + i * 0, sumsq + i * 0.0, mask=(i == 0) & live)
        tl.store(out + gcol, gram, mask=gmask & live[:, None])


@triton.jit(do_not_specialize=["splits", "stride_ms", "stride_sk"])
def _pre_norm_quant_kernel(
    streams_ptr,
    part_ptr,
    base_ptr,
    scale_ptr,
    normw_ptr,
    normed_ptr,
    q_ptr,
    s_ptr,
    post_ptr,
    comb_ptr,
    HC,
    D,
    N_MIX,
    NCOL,
    iters,
    hc_eps,
    norm_eps,
    out_eps,
    splits,
    stride_st,
    stride_sh,
    stride_ms,
    stride_nt,
    stride_qt,
    stride_sm,
    stride_sk,
    HC_P: tl.constexpr,
    KB: tl.constexpr,
    SB: tl.constexpr,
    QUANT: tl.constexpr,
    POW2: tl.constexpr,
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HC_P)
    j = tl.arange(0, HC_P)
    imask = i < HC
    m_row = part_ptr + t * NCOL
    pre, cmask = tl_split_weights(
        m_row, base_ptr, scale_ptr, post_ptr, comb_ptr, t, HC, D, N_MIX, iters, hc_eps, norm_eps, splits, stride_ms,
        HC_P, SB,
    )  # fmt: skip
    gram = tl_mix_sum2(m_row, N_MIX + 1 + i[:, None] * HC + j[None, :], cmask, splits, stride_ms, SB)
    # the collapsed row's sum of squares, pre^T G pre (pre is 0 on padded streams)
    ysq = tl.sum(tl.sum(pre[:, None] * gram * pre[None, :], axis=1), axis=0)
    r = tl.rsqrt(ysq / D + out_eps)
    b = tl.program_id(1) * KB + tl.arange(0, KB)
    cols = b[:, None] * 128 + tl.arange(0, 128)[None, :]  # [KB, 128]: this program's quantisation blocks
    dmask = cols < D
    x = tl.load(
        streams_ptr + t * stride_st + i[:, None, None] * stride_sh + cols[None, :, :],
        mask=imask[:, None, None] & dmask[None, :, :],
        other=0.0,
    ).to(tl.float32)
    y = tl.sum(pre[:, None, None] * x, axis=0).to(streams_ptr.dtype.element_ty).to(tl.float32)  # as stored collapsed
    w = tl.load(normw_ptr + cols, mask=dmask, other=0.0).to(tl.float32)
    normed = (w * (y * r)).to(normed_ptr.dtype.element_ty)
    tl.store(normed_ptr + t * stride_nt + cols, normed, mask=dmask)
    if QUANT:
        codes, scale = tl_quant_1x128(tl.where(dmask, normed.to(tl.float32), 0.0), POW2, HW_FP8)
        tl.store(q_ptr + t * stride_qt + cols, codes, mask=dmask)
        tl.store(s_ptr + t * stride_sm + b * stride_sk, scale, mask=b * 128 < D)


def takes_chain(streams: torch.Tensor) -> bool:
    """Does a boundary over these streams [T, hc, D] take this module's two launches?"""
    return 0 < streams.shape[0] <= min(CHAIN_MAX_TOKENS, LIMIT_TOKENS)


def _post_mix(
    block_out: torch.Tensor | None,
    streams: torch.Tensor,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    fn: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the new streams [T, hc, D] (streams itself when block_out is None), fp32 partials [splits, T, NCOL])."""
    t, hc, d = streams.shape
    n_mix = (2 + hc) * hc
    block_d = min(POST_MIX_BLOCK_D, triton.next_power_of_2(d))
    splits = triton.cdiv(d, block_d)
    ncol = partial_columns(hc)
    parts = torch.empty(splits, t, ncol, dtype=torch.float32, device=streams.device)
    new = streams if block_out is None else torch.empty(t, hc, d, dtype=streams.dtype, device=streams.device)
    tok = 1 if t <= 8 else 8  # decode: one token a program (all SMs busy); larger steps reuse fn's block
    fn = fn.float().contiguous()
    _post_mix_kernel[(triton.cdiv(t, tok), splits)](
        new,
        streams if block_out is None else block_out,
        streams,
        fn if post is None else post.float().contiguous(),
        fn if comb is None else comb.float().contiguous(),
        fn,
        parts,
        t,
        hc,
        d,
        n_mix,
        ncol,
        streams.stride(0),
        streams.stride(1),
        0 if block_out is None else block_out.stride(0),
        new.stride(0),
        new.stride(1),
        fn.stride(0),
        parts.stride(0),
        HC_P=triton.next_power_of_2(hc),
        BLOCK_D=block_d,
        NM_P=triton.next_power_of_2(n_mix),
        TOK=tok,
        POST=block_out is not None,
        **({"num_warps": 4} if streams.is_cuda else {}),
        **pdl_kwargs(new),
    )
    return new, parts


def _pre_norm_quant(
    streams: torch.Tensor,
    parts: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    norm_weight: torch.Tensor,
    out_eps: float,
    out_dtype: torch.dtype,
    pow2: bool | None,
):
    """-> (normed [T, D] in out_dtype, e4m3 [T, D] or None, fp32 scales [T, ceil(D/128)] MN-major or None,
    post fp32 [T, hc], comb fp32 [T, hc, hc]); pow2 None: no quantisation."""
    t, hc, d = streams.shape
    kb = triton.cdiv(d, BLOCK)
    normed = torch.empty(t, d, dtype=out_dtype, device=streams.device)
    quant = pow2 is not None
    q = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=streams.device) if quant else None
    s = scale_buffer(t, kb, streams.device) if quant else None
    post = torch.empty(t, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=streams.device)
    blocks = min(PRE_BLOCKS, triton.next_power_of_2(kb))
    _pre_norm_quant_kernel[(t, triton.cdiv(kb, blocks))](
        streams,
        parts,
        base.float().contiguous(),
        scale.float().contiguous(),
        norm_weight.contiguous(),
        normed,
        normed if q is None else q.view(torch.uint8),
        post if s is None else s,
        post,
        comb,
        hc,
        d,
        (2 + hc) * hc,
        parts.shape[2],
        iters,
        hc_eps,
        norm_eps,
        out_eps,
        parts.shape[0],
        streams.stride(0),
        streams.stride(1),
        parts.stride(0),
        normed.stride(0),
        0 if q is None else q.stride(0),
        0 if s is None else s.stride(0),
        0 if s is None else s.stride(1),
        HC_P=triton.next_power_of_2(hc),
        KB=blocks,
        SB=min(PRE_SPLITS_PER_LOAD, triton.next_power_of_2(parts.shape[0])),
        QUANT=quant,
        POW2=bool(pow2),
        HW_FP8=streams.is_cuda and USE_HW_FP8_CAST,
        **({"num_warps": 1} if streams.is_cuda else {}),
        **pdl_kwargs(streams),
    )  # one warp: Sinkhorn's hc x hc sums stay in-warp (as dsv4_kernels.triton_mhc's split pre)
    return normed, q, s, post, comb


def _check(streams: torch.Tensor, fn: torch.Tensor, norm_weight: torch.Tensor, iters: int) -> None:
    if streams.dim() != 3 or streams.stride(-1) != 1:
        raise ValueError(f"streams must be [T, hc, D] with unit stride on the last dim, got {tuple(streams.shape)}")
    require_triton(streams.device)
    t, hc, d = streams.shape
    n_mix = (2 + hc) * hc
    if fn.shape != (n_mix, hc * d):
        raise ValueError(f"fn must be [(2+hc)*hc={n_mix}, hc*D={hc * d}], got {tuple(fn.shape)}")
    if norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [D={d}], got {tuple(norm_weight.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn iters must be >= 1, got {iters}")
    if t > LIMIT_TOKENS:
        raise ValueError(f"the mHC chain takes steps of <= {LIMIT_TOKENS} tokens, got {t}")


def pre_norm_quant(
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
    pow2: bool | None,
):
    """A block's mHC pre, its input RMSNorm and (pow2 not None) that input's 1x128 quantisation, in two launches.
    streams [T, hc, D]; fn [(2+hc)*hc, hc*D]; base [(2+hc)*hc]; scale [3]; norm_weight [D].
    -> (normed [T, D] in out_dtype, e4m3 [T, D] or None, fp32 scales [T, ceil(D/128)] MN-major or None,
    post fp32 [T, hc], comb fp32 [T, hc, hc]), as dsv4_kernels.triton_mhc.hc_pre_quant."""
    _check(streams, fn, norm_weight, iters)
    _, parts = _post_mix(None, streams, None, None, fn)
    return _pre_norm_quant(streams, parts, base, scale, iters, hc_eps, norm_eps, norm_weight, out_eps, out_dtype, pow2)


def post_pre_norm_quant(
    block_out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
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
    pow2: bool | None,
):
    """The boundary after a block: its mHC post (block_out [T, D], the block's post [T, hc] and comb [T, hc, hc]),
    then the next block's pre_norm_quant (its fn, base, scale, norm_weight) on the new streams, in two launches.
    -> (new streams [T, hc, D] in streams.dtype, then pre_norm_quant's five outputs)."""
    _check(streams, fn, norm_weight, iters)
    t, hc, d = streams.shape
    if block_out.shape != (t, d) or block_out.stride(-1) != 1:
        raise ValueError(f"block_out must be [T={t}, D={d}] with unit last stride, got {tuple(block_out.shape)}")
    if post.shape != (t, hc) or comb.shape != (t, hc, hc):
        raise ValueError(
            f"post must be [{t}, {hc}] and comb [{t}, {hc}, {hc}], got {tuple(post.shape)}, {tuple(comb.shape)}"
        )
    new, parts = _post_mix(block_out, streams, post, comb, fn)
    outs = _pre_norm_quant(new, parts, base, scale, iters, hc_eps, norm_eps, norm_weight, out_eps, out_dtype, pow2)
    return (new, *outs)
