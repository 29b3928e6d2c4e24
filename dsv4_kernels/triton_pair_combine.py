"""Triton k-way sum of routed rows read through a row map (the FP8 grouped MoE's last step, one launch).

`gather_combine(y, pair_row, weights, shared)`: out[t] = sum_j weights[t, j] * y[pair_row[t, j]] over the k slots
in slot order, in fp32, rounded once to the dtype, then + shared[t] rounded again (= the reference
`(sum_j w y_j).to(dtype) + shared` in the dtype). A pair with pair_row -1 (another expert-parallel rank's expert)
adds nothing: its row is never read (the padded rows it would point at may hold anything, NaN included).
y's rows are the padded, expert-sorted GEMM output (dsv4_kernels.fp8_experts.ContiguousLayout); reading them here
replaces a gather, a scale and a sum over [P, H] in torch.
Interpreter note (as dsv4_kernels/triton_attention_kernels.py): every load is converted to fp32 before any arithmetic.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

BLOCK = 1024


@triton.jit
def _gather_combine_kernel(
    y_ptr,
    row_ptr,
    w_ptr,
    shared_ptr,
    out_ptr,
    K,
    H,
    stride_y,
    stride_st,
    stride_ot,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(K):
        row = tl.load(row_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        # A -1 pair reads row 0 (always allocated) and is dropped by the select, never multiplied (NaN x 0 = NaN).
        y = tl.load(y_ptr + tl.maximum(row, 0) * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        acc += tl.where(row >= 0, w * y, 0.0)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:
        sh = tl.load(shared_ptr + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + sh).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + cols, out, mask=mask)


def gather_combine(
    y: torch.Tensor,
    pair_row: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y: [M, H] (unit last stride); pair_row: int [T, k] rows of y (-1 = none); weights: float [T, k];
    shared: [T, H] or None -> [T, H] in out_dtype (default shared's dtype, else y's)."""
    if y.dim() != 2 or y.stride(-1) != 1:
        raise ValueError(f"y must be [M, H] with a unit last stride, got {tuple(y.shape)} {y.stride()}")
    if pair_row.dim() != 2 or weights.shape != pair_row.shape:
        raise ValueError(
            f"pair_row and weights must both be [T, k], got {tuple(pair_row.shape)}, {tuple(weights.shape)}"
        )
    t, k = pair_row.shape
    h = y.shape[1]
    if shared is not None and (shared.shape != (t, h) or shared.stride(-1) != 1):
        raise ValueError(f"shared must be [T={t}, H={h}] with a unit last stride, got {tuple(shared.shape)}")
    require_triton(y.device)
    dtype = out_dtype or (shared.dtype if shared is not None else y.dtype)
    out = torch.empty(t, h, dtype=dtype, device=y.device)
    if t and h:
        block = min(BLOCK, triton.next_power_of_2(h))
        rows = pair_row.contiguous()
        w = weights.contiguous()
        _gather_combine_kernel[(t, triton.cdiv(h, block))](
            y,
            rows,
            w,
            out if shared is None else shared,
            out,
            k,
            h,
            y.stride(0),
            0 if shared is None else shared.stride(0),
            out.stride(0),
            HAS_SHARED=shared is not None,
            BLOCK_H=block,
            **pdl_kwargs(y),
        )
    return out
