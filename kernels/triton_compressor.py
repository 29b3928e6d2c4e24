"""Triton compressor pooling: softmax over slots, weighted sum, RMSNorm, optional compress RoPE, fused.

Reference: `kernels.rms_norm(kernels.compressor.pool_windows(kv, score), weight, eps)`, then (if cos/sin
are given) `kernels.rope.apply_rope(., cos, sin)` at each entry's window start, as engine/attention.py
chains them. kv and score are the slot rows already arranged per entry (`overlap_slots` for ratio 4,
the plain window for ratio 128); a slot whose score is -inf gets weight 0.

The softmax runs per channel over the slots, so channels are independent until the norm. One program
per entry pools three column groups separately: the NoPE channels, then the even and the odd RoPE
channels (pairs (2i, 2i+1)); the norm sums squares over all three and RoPE rotates even against odd
without any in-register de-interleave. Each group takes two passes over the slots (max/sum, then the
weighted sum) so the weights are final before they are rounded to kv.dtype, as in the reference.
Interpreter note: bf16 loads are converted to fp32 before any arithmetic (see kernels/triton_attention.py).
"""

from __future__ import annotations

import torch

from kernels.gpu import import_triton, require_triton

triton, tl = import_triton()


@triton.jit
def _pool_cols(kv_row, sc_row, cols, cmask, SLOTS, stride_kvs, stride_scs, OUT_DTYPE: tl.constexpr,
               BLOCK_S: tl.constexpr):
    """Softmax-over-slots weighted sum of the given columns -> fp32 values rounded to OUT_DTYPE."""
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
        w = (tl.exp(sc.to(tl.float32) - m[None, :]) * inv_l[None, :]).to(OUT_DTYPE).to(tl.float32)
        acc += tl.sum((kv * w).to(OUT_DTYPE).to(tl.float32), axis=0)  # the reference multiplies in kv.dtype
    return acc.to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _pool_norm_rope_kernel(kv_ptr, score_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, SLOTS, D, HALF, eps,
                           stride_kvn, stride_kvs, stride_scn, stride_scs, stride_on, stride_cn, stride_sn,
                           NOPE_P: tl.constexpr, HALF_P: tl.constexpr, HAS_ROPE: tl.constexpr,
                           BLOCK_S: tl.constexpr):
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


def pool_norm_rope(kv: torch.Tensor, score: torch.Tensor, weight: torch.Tensor, eps: float,
                   cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                   *, block_s: int | None = None) -> torch.Tensor:
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
    if cos is not None and (cos.dim() != 2 or cos.shape[0] != n or sin.shape != cos.shape or 2 * cos.shape[1] > d):
        raise ValueError(f"cos/sin must be [N={n}, rope_dim // 2 <= {d // 2}], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    require_triton(kv.device)
    out = torch.empty(n, d, dtype=kv.dtype, device=kv.device)
    if n == 0:
        return out
    half = 0 if cos is None else cos.shape[1]
    if cos is not None:
        cos, sin = cos.float(), sin.float()
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    else:
        cos = sin = out  # unused
    block_s = block_s or max(1, min(16, triton.next_power_of_2(slots)))
    extra = {"num_warps": 4} if kv.is_cuda else {}
    _pool_norm_rope_kernel[(n,)](
        kv, score, weight, cos, sin, out, slots, d, half, eps,
        kv.stride(0), kv.stride(1), score.stride(0), score.stride(1), out.stride(0), cos.stride(0), sin.stride(0),
        NOPE_P=max(1, triton.next_power_of_2(d - 2 * half)), HALF_P=max(1, triton.next_power_of_2(half)),
        HAS_ROPE=half > 0, BLOCK_S=block_s, **extra)
    return out
