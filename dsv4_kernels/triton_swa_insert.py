"""Triton fused SWA insert: kv RMSNorm + interleaved RoPE, then the row write into the SWA cache.

Reference: kv = `apply_rope(rms_norm(kv, weight, eps), cos, sin)` (as `dsv4_kernels.triton_norm_rope`, with the same
rounding points), then
- fp8_ds_mla cache: `geometry.write_rows(cache, layout, rows, geometry.pack_fp8_ds_mla(kv, layout))`, with the
  NoPE zero-padded up to layout.nope_dim when the model's NoPE width is not a multiple of 64 (engine.model.cache's
  RowCodec): e4m3 codes of each 64-value block over a UE8M0 scale, bf16 RoPE bytes in the value row, the scale
  bytes (+ one zero pad byte) in the block's scale area;
- exact cache: `cache[rows] = kv` (rows of D values in the model dtype).
Rows < 0 are skipped. The normalised, rotated kv is returned in the model dtype for the step's own attention.
One program per token: the NoPE channels are loaded as a [blocks, 64] tile (one quant block a row), the RoPE
channels as even / odd vectors (as dsv4_kernels/triton_norm_rope.py), so nothing is reshaped in registers.

Rounding: every rounding to bf16 uses `tl_round_bf16` (nearest even, by bits), so the interpreter and the GPU
store the same values, and the cache bytes equal `pack_fp8_ds_mla(returned kv)` exactly (see
dsv4_kernels/triton_cache_codecs.py for the e4m3 and exponent codecs). Against the torch reference the returned kv
may differ by one bf16 ulp (fp32 sums in another order, rsqrt.approx on the GPU), and so may the bytes of the
few values sitting on a rounding boundary.
The q side (per-head unweighted RMSNorm + RoPE) is `dsv4_kernels.triton_norm_rope.rms_norm_rope(q, cos, sin, eps)`.
"""

from __future__ import annotations

import torch

from dsv4_kernels import triton_cache_codecs as tc
from dsv4_kernels.geometry import FP8_DS_MLA_QUANT_BLOCK, ExactRowLayout, Fp8DsMlaLayout
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_cache_codecs import (
    tl_round_bf16,
    tl_round_to,
    tl_row_offsets,
    tl_store_fp8_ds_mla,
)
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


@triton.jit
def _swa_insert_kernel(
    kv_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    rows_ptr,
    out_ptr,
    cache_ptr,
    D,
    NOPE,
    HALF,
    eps,
    block_size,
    block_stride,
    stride_kt,
    stride_ot,
    stride_ct,
    stride_st,
    stride_cr,
    FP8: tl.constexpr,
    NB: tl.constexpr,
    NB_P: tl.constexpr,
    QB: tl.constexpr,
    HALF_P: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
    BF16: tl.constexpr,
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    x_row = kv_ptr + t * stride_kt
    o_row = out_ptr + t * stride_ot
    b = tl.arange(0, NB_P)
    c = b[:, None] * QB + tl.arange(0, QB)[None, :]  # NoPE channel of [quant block, value]
    cm = c < NOPE
    p = tl.arange(0, HALF_P)
    pm = p < HALF
    ce = NOPE + 2 * p
    x = tl.load(x_row + c, mask=cm, other=0.0).to(tl.float32)
    ev = tl.load(x_row + ce, mask=pm, other=0.0).to(tl.float32)
    od = tl.load(x_row + ce + 1, mask=pm, other=0.0).to(tl.float32)
    r = tl.rsqrt((tl.sum(tl.sum(x * x, axis=1), axis=0) + tl.sum(ev * ev, axis=0) + tl.sum(od * od, axis=0)) / D + eps)
    a = tl_round_to(tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32) * (x * r), BF16, dt)
    ev = tl_round_to(tl.load(w_ptr + ce, mask=pm, other=0.0).to(tl.float32) * (ev * r), BF16, dt)
    od = tl_round_to(tl.load(w_ptr + ce + 1, mask=pm, other=0.0).to(tl.float32) * (od * r), BF16, dt)
    cs = tl.load(cos_ptr + t * stride_ct + p, mask=pm, other=1.0)
    sn = tl.load(sin_ptr + t * stride_st + p, mask=pm, other=0.0)
    ev, od = tl_round_to(ev * cs - od * sn, BF16, dt), tl_round_to(od * cs + ev * sn, BF16, dt)
    tl.store(o_row + c, a.to(dt), mask=cm)
    tl.store(o_row + ce, ev.to(dt), mask=pm)
    tl.store(o_row + ce + 1, od.to(dt), mask=pm)

    # A [1] vector, not a scalar: the interpreter rejects masks built from a scalar compare.
    slot = tl.load(rows_ptr + t + tl.arange(0, 1)).to(tl.int64)
    ok = slot >= 0
    slot = tl.maximum(slot, 0)
    if FP8:
        vrow, srow = tl_row_offsets(slot, block_size, block_stride, TOKEN_STRIDE, SCALE_STRIDE)
        # pack_fp8_ds_mla quantises the bf16 latent: round first (a no-op for a bf16 model).
        tl_store_fp8_ds_mla(
            cache_ptr,
            vrow,
            srow,
            ok,
            tl_round_bf16(a),
            tl_round_bf16(ev),
            tl_round_bf16(od),
            p,
            HALF,
            NB,
            NB_P,
            QB,
            ROPE_OFFSET,
            SCALE_STRIDE - NB,
            HW_FP8,
        )
    else:
        c_row = cache_ptr + slot * stride_cr
        cdt = cache_ptr.dtype.element_ty
        tl.store(c_row + c, a.to(cdt), mask=cm & ok)
        tl.store(c_row + ce, ev.to(cdt), mask=pm & ok)
        tl.store(c_row + ce + 1, od.to(cdt), mask=pm & ok)


def _check_inputs(kv, weight, cos, sin, rows) -> None:
    if kv.dim() != 2 or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [T, D] with unit stride on the last dim, got {tuple(kv.shape)}")
    t, d = kv.shape
    if weight.shape != (d,):
        raise ValueError(f"weight must be [D={d}], got {tuple(weight.shape)}")
    if cos.dim() != 2 or cos.shape[0] != t or sin.shape != cos.shape or 2 * cos.shape[1] > d:
        raise ValueError(
            f"cos/sin must be [T={t}, rope_dim // 2 <= {d // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if rows.dim() != 1 or rows.shape[0] != t or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32/int64 [T={t}] (-1 = skip), got {rows.dtype} {tuple(rows.shape)}")


def _check_fp8_layout(layout: Fp8DsMlaLayout, d: int, rope_dim: int) -> None:
    if layout.rope_dim != rope_dim or not 0 <= layout.nope_dim - (d - rope_dim) < FP8_DS_MLA_QUANT_BLOCK:
        raise ValueError(
            f"layout (head_dim {layout.head_dim}, rope {layout.rope_dim}) does not hold kv rows of "
            f"D={d} with rope {rope_dim} (NoPE may only be zero-padded to the next multiple of 64)"
        )


def swa_insert(
    kv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    rows: torch.Tensor,
    layout: Fp8DsMlaLayout | ExactRowLayout | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise and rotate this step's kv, write it into the SWA cache rows `rows`, return it.

    kv: [T, D] pre-norm wkv output (model dtype, last dim contiguous); weight: [D] RMSNorm weight;
    cos, sin: fp32 [T, rope_dim // 2] at each token's position; rows: int32/int64 [T] global cache rows
    (slot s = block s // block_size, position s % block_size), -1 = do not write (ids are not range-checked);
    cache, by layout:
    - Fp8DsMlaLayout: uint8 paged fp8_ds_mla cache of one layer, [blocks, >= layout.block_bytes()] or the
      engine's [rows, layout.row_bytes] view; layout.nope_dim may exceed D - rope_dim (zero padding);
    - None / ExactRowLayout: [R, D] rows in kv.dtype (last dim contiguous), cache[rows[t]] = result[t].
    out: optional [T, D] kv.dtype destination. -> [T, D] kv.dtype = apply_rope(rms_norm(kv, weight, eps), cos, sin).
    """
    _check_inputs(kv, weight, cos, sin, rows)
    t, d = kv.shape
    half = cos.shape[1]
    fp8 = isinstance(layout, Fp8DsMlaLayout)
    # the fp8_ds_mla row geometry the kernel reads (block rows, token / scale strides, RoPE offset); 0s when exact
    block_rows, token_stride, scale_stride, rope_offset = 1, 0, 0, 0
    if isinstance(layout, Fp8DsMlaLayout):
        _check_fp8_layout(layout, d, 2 * half)
        block_stride, _ = tc.paged_cache_args(cache, layout)
        nb, stride_cr = layout.num_scales, 0
        block_rows, token_stride = layout.block_size, layout.token_stride
        scale_stride, rope_offset = layout.scale_stride, layout.rope_offset
    else:
        if cache.dim() != 2 or cache.shape[1] != d or cache.stride(-1) != 1 or cache.dtype != kv.dtype:
            raise ValueError(
                f"an exact SWA cache must be [R, D={d}] {kv.dtype} with unit last stride, got "
                f"{cache.dtype} {tuple(cache.shape)}"
            )
        block_stride, nb, stride_cr = 0, triton.cdiv(d - 2 * half, FP8_DS_MLA_QUANT_BLOCK), cache.stride(0)
    if out is None:
        out = torch.empty_like(kv, memory_format=torch.contiguous_format)
    elif out.shape != kv.shape or out.dtype != kv.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, D] {kv.dtype} with unit last stride, got {out.dtype} {tuple(out.shape)}")
    require_triton(kv.device)
    if t == 0:
        return out
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    rows = rows.contiguous()
    extra = {"num_warps": 4} if kv.is_cuda else {}
    _swa_insert_kernel[(t,)](
        kv,
        weight,
        cos,
        sin,
        rows,
        out,
        cache,
        d,
        d - 2 * half,
        half,
        eps,
        block_rows,
        block_stride,
        kv.stride(0),
        out.stride(0),
        cos.stride(0),
        sin.stride(0),
        stride_cr,
        FP8=fp8,
        NB=nb,
        NB_P=max(1, triton.next_power_of_2(nb)),
        QB=FP8_DS_MLA_QUANT_BLOCK,
        HALF_P=max(1, triton.next_power_of_2(half)),
        TOKEN_STRIDE=token_stride,
        SCALE_STRIDE=scale_stride,
        ROPE_OFFSET=rope_offset,
        BF16=kv.dtype == torch.bfloat16,
        HW_FP8=kv.is_cuda and tc.USE_HW_FP8_CAST,
        **extra,
        **pdl_kwargs(kv),
    )
    return out
