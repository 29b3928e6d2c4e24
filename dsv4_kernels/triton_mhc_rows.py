"""mHC pre for long steps (prefill chunks): the mixing weights for blocks of tokens, then whole-row collapses.

`dsv4_kernels.triton_mhc.hc_pre` sends steps longer than `split_max_tokens` here after its split-K mix kernel
(for fp32 streams on tensor cores: three TF32 products a pair, fp32-level accuracy) has written the logit
partials and each token's sum of squares. Two launches follow, each reading its input once:
- `_hc_weights_kernel`, BLOCK_T tokens a program, vectorised over them: the partial sums, the mixing RMSNorm
  factor, pre = sigmoid + eps, post = 2 sigmoid, comb = row softmax + eps and Sinkhorn (column norm, then
  iters-1 x (row, column)) -> pre, post [T, hc], comb [T, hc, hc] fp32. (The split path derives one token's
  weights in every one of its D-block programs; at 8K tokens x 16 blocks that is 131K Sinkhorns.)
- `_hc_collapse_kernel`, ROWS whole tokens a program: collapsed = sum_i pre_i * stream_i held in registers,
  rounded to the streams' dtype, then the block's optional input RMSNorm over the row without reading it again.
The path this replaced (torch's fp32 matmul for the logits, one program a token reading its streams three times)
took 0.77 ms a call at 8K tokens on the H200 against a 0.13 ms read of the fp32 streams (BENCHMARKS.md, "mHC pre").
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton

triton, tl = import_triton()

WEIGHT_BLOCK_T = 64  # tokens a weights program: [64, hc, hc] tiles, the Sinkhorn sums stay per token
ROW_ELEMS = 8192  # fp32 elements of collapsed rows a collapse program holds (2 tokens at D = 4096)


@triton.jit
def _partial_sum(parts_ptr, off, mask, splits, stride_ps):
    """sum over splits s of parts[s] at offsets `off` (any shape, `mask` broadcast to it), fp32."""
    acc = tl.zeros(off.shape, dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(parts_ptr + s * stride_ps + off, mask=mask, other=0.0)
    return acc


@triton.jit(do_not_specialize=["T", "splits", "stride_ps", "stride_pt"])
def _hc_weights_kernel(parts_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, HC, D, N_MIX, iters,
                       hc_eps, norm_eps, splits, stride_ps, stride_pt,
                       HC_P: tl.constexpr, BLOCK_T: tl.constexpr):
    """parts: fp32 [splits, T, N_MIX + 1] (column N_MIX: the sum of squares) -> pre, post fp32 [T, HC],
    comb fp32 [T, HC, HC]; padded stream entries stay exactly 0 so they never enter a sum."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    i = tl.arange(0, HC_P)
    j = tl.arange(0, HC_P)
    imask = i < HC
    row_off = rows.to(tl.int64) * stride_pt
    sumsq = _partial_sum(parts_ptr, row_off + N_MIX, rmask, splits, stride_ps)
    rinv = tl.rsqrt(sumsq / (HC * D) + norm_eps)  # [BT]
    s0 = tl.load(scale_ptr).to(tl.float32)
    s1 = tl.load(scale_ptr + 1).to(tl.float32)
    s2 = tl.load(scale_ptr + 2).to(tl.float32)
    m2 = rmask[:, None] & imask[None, :]
    pre = (_partial_sum(parts_ptr, row_off[:, None] + i[None, :], m2, splits, stride_ps) * rinv[:, None] * s0
           + tl.load(base_ptr + i, mask=imask, other=0.0)[None, :])
    pre = tl.where(imask[None, :], tl.sigmoid(pre) + hc_eps, 0.0)
    post = (_partial_sum(parts_ptr, row_off[:, None] + HC + i[None, :], m2, splits, stride_ps) * rinv[:, None] * s1
            + tl.load(base_ptr + HC + i, mask=imask, other=0.0)[None, :])
    post = 2.0 * tl.sigmoid(post)
    cmask2 = imask[:, None] & (j < HC)[None, :]
    cmask = cmask2[None, :, :]  # [1, HC_P, HC_P]
    cidx = 2 * HC + i[:, None] * HC + j[None, :]  # comb[i, j] lives at 2*HC + i*HC + j
    logits = (_partial_sum(parts_ptr, row_off[:, None, None] + cidx[None, :, :], rmask[:, None, None] & cmask,
                           splits, stride_ps) * rinv[:, None, None] * s2
              + tl.load(base_ptr + cidx, mask=cmask2, other=0.0)[None, :, :])
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
    out2 = rows[:, None].to(tl.int64) * HC + i[None, :]
    tl.store(pre_ptr + out2, pre, mask=m2)
    tl.store(post_ptr + out2, post, mask=m2)
    tl.store(comb_ptr + rows[:, None, None].to(tl.int64) * HC * HC + cidx[None, :, :] - 2 * HC, comb,
             mask=rmask[:, None, None] & cmask)


@triton.jit(do_not_specialize=["T"])
def _hc_collapse_kernel(streams_ptr, pre_ptr, normw_ptr, out_ptr, T, HC, D, out_eps, stride_st, stride_sh,
                        stride_ot, ROWS: tl.constexpr, D_P: tl.constexpr, NORM: tl.constexpr):
    """out[t] = sum_i pre[t, i] * streams[t, i] (rounded to the streams' dtype), then with NORM the block's
    input RMSNorm: normw * (y * rsqrt(mean(y^2) + out_eps)), fp32 math, one rounding to out's dtype."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < T
    cols = tl.arange(0, D_P)
    m = rmask[:, None] & (cols < D)[None, :]
    base = streams_ptr + rows[:, None].to(tl.int64) * stride_st + cols[None, :]
    y = tl.zeros([ROWS, D_P], dtype=tl.float32)
    for h in range(HC):
        p = tl.load(pre_ptr + rows.to(tl.int64) * HC + h, mask=rmask, other=0.0)
        y += p[:, None] * tl.load(base + h * stride_sh, mask=m, other=0.0).to(tl.float32)
    y = y.to(streams_ptr.dtype.element_ty).to(tl.float32)  # the collapsed row as the reference rounds it
    if NORM:
        r = tl.rsqrt(tl.sum(y * y, axis=1) / D + out_eps)
        w = tl.load(normw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = w[None, :] * (y * r[:, None])
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m)


def weights_and_collapse(streams: torch.Tensor, parts: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                         iters: int, hc_eps: float, norm_eps: float, out: torch.Tensor, post: torch.Tensor,
                         comb: torch.Tensor, norm_weight: torch.Tensor | None = None, out_eps: float = 1e-6) -> None:
    """The rest of `triton_mhc.hc_pre` for a long step, written into out [T, D] (the collapsed row, or with
    norm_weight its RMSNorm), post fp32 [T, hc] and comb fp32 [T, hc, hc]. streams: [T, hc, D] (unit last
    stride); parts: fp32 [splits, T, (2+hc)*hc + 1], the split-K logits with the sum of squares last."""
    t, hc, d = streams.shape
    n_mix = (2 + hc) * hc
    if parts.shape[1:] != (t, n_mix + 1) or parts.stride(-1) != 1:
        raise ValueError(f"parts must be [splits, T={t}, {n_mix + 1}] with unit last stride, "
                         f"got {tuple(parts.shape)}")
    pre = torch.empty(t, hc, dtype=torch.float32, device=streams.device)
    _hc_weights_kernel[(triton.cdiv(t, WEIGHT_BLOCK_T),)](
        parts, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, t, hc, d, n_mix, iters,
        hc_eps, norm_eps, parts.shape[0], parts.stride(0), parts.stride(1),
        HC_P=triton.next_power_of_2(hc), BLOCK_T=WEIGHT_BLOCK_T)
    d_p = triton.next_power_of_2(d)
    rows = max(1, min(ROW_ELEMS // d_p, triton.next_power_of_2(t)))
    rows = 1 << (rows.bit_length() - 1)  # a power of two (the kernel's arange)
    norm = norm_weight is not None
    _hc_collapse_kernel[(triton.cdiv(t, rows),)](
        streams, pre, norm_weight.contiguous() if norm else pre, out, t, hc, d, out_eps, streams.stride(0),
        streams.stride(1), out.stride(0), ROWS=rows, D_P=d_p, NORM=norm,
        **({"num_warps": 8} if streams.is_cuda else {}))
