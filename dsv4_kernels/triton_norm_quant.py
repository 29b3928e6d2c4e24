"""Triton RMSNorm + 1x128 FP8 activation quantisation in one launch (the prologue of FP8 projections on a normed input).

Reference: `dsv4_kernels.fp8_linear.quant_act_1x128(dsv4_kernels.norm.rms_norm(x, weight, eps))`, plus the normed rows
themselves (V4's attention keeps q_res, the normed low-rank query, and feeds it to two FP8 projections: wq_b
and the indexer's wq_b, which can then share one quantisation).

One program per row: the whole row (K <= a few thousand, V4's q_lora 1024) stays in registers; sum of squares
in fp32, normed = weight * x * rsqrt(mean + eps) rounded once to the output dtype (as rms_norm returns it), then
per 128-wide block amax -> scale (power of two for UE8M0 checkpoints) -> e4m3 codes, exactly as
`dsv4_kernels.triton_fp8_quant` does on that rounded row. Scales are written MN-major for DeepGEMM.
Interpreter note: every load is converted to fp32 before any arithmetic (see dsv4_kernels/triton_attention_kernels.py).
"""

from __future__ import annotations

import torch

from dsv4_kernels.fp8_linear import BLOCK
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_cache_codecs import USE_HW_FP8_CAST
from dsv4_kernels.triton_fp8_quant import scale_buffer, tl_quant_1x128
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

MAX_K = 8192  # a row in registers


@triton.jit
def _norm_quant_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    s_ptr,
    K,
    eps,
    stride_x,
    stride_y,
    stride_q,
    stride_sm,
    stride_sk,
    KB_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    POW2: tl.constexpr,
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, KB_P)
    c = tl.arange(0, BLOCK_K)
    k = b[:, None] * BLOCK_K + c[None, :]  # [KB_P, BLOCK_K]: the row as 128-wide blocks
    mask = k < K
    x = tl.load(x_ptr + row * stride_x + k, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / K + eps)
    w = tl.load(w_ptr + k, mask=mask, other=0.0).to(tl.float32)
    y = (w * (x * r)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + k, y, mask=mask)
    y = tl.where(mask, y.to(tl.float32), 0.0)
    codes, scale = tl_quant_1x128(y, POW2, HW_FP8)  # one scale per 128-wide block: [KB_P]
    tl.store(q_ptr + row * stride_q + k, codes, mask=mask)
    tl.store(s_ptr + row * stride_sm + b * stride_sk, scale, mask=b * BLOCK_K < K)


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, pow2: bool = True, out_dtype: torch.dtype | None = None
):
    """x: [M, K] (unit last stride), weight: [K] -> (normed [M, K] in out_dtype (default x.dtype), e4m3 [M, K],
    fp32 scales [M, ceil(K/128)] MN-major) = (rms_norm(x, weight, eps), *quant_act_1x128(that, pow2))."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with a unit last stride, got {tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    if weight.shape != (k,):
        raise ValueError(f"weight must be [K={k}], got {tuple(weight.shape)}")
    if k > MAX_K:
        raise ValueError(f"rows of {k} > {MAX_K} features do not fit one program")
    require_triton(x.device)
    kb = triton.cdiv(k, BLOCK)
    y = torch.empty(m, k, dtype=out_dtype or x.dtype, device=x.device)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = scale_buffer(m, kb, x.device)
    if m and k:
        extra = {"num_warps": 4} if x.is_cuda else {}
        _norm_quant_kernel[(m,)](
            x,
            weight.contiguous(),
            y,
            q.view(torch.uint8),
            s,
            k,
            float(eps),
            x.stride(0),
            y.stride(0),
            q.stride(0),
            s.stride(0),
            s.stride(1),
            KB_P=triton.next_power_of_2(kb),
            BLOCK_K=BLOCK,
            POW2=pow2,
            HW_FP8=x.is_cuda and USE_HW_FP8_CAST,
            **extra,
            **pdl_kwargs(x),
        )
    return y, q, s
