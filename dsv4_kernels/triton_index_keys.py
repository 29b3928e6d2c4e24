"""In-kernel loads of indexer key tiles from a key store, shared by the decode and prefill indexer kernels.

Key stores: plain rows [R, Di] (the exact cache), or the paged indexer cache of dsv4_kernels/geometry.py
(`IndexerKeyLayout`): FP8 e4m3 with one fp32 scale per 128 values, or MXFP4 (e2m1 nibbles, element 2i
in the low nibble, one UE8M0 scale per 32 values), dequantised in registers. Dequantised values are
exact in bf16 (few mantissa bits times a power of two), so bf16 tensor-core dots lose nothing on them.
`check_index_keys` is the host-side check of a store against its layout; `key_format` the kernels' FMT.
"""

from __future__ import annotations

import torch

from dsv4_kernels.geometry import IndexerKeyLayout
from dsv4_kernels.gpu import import_triton

triton, tl = import_triton()

PLAIN, FP8, MXFP4 = 0, 1, 2


@triton.jit
def tl_ue8m0_scale(byte):
    """UE8M0 byte b -> fp32 2**(b - 127), built from the exponent bits (exact, unlike ex2.approx)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def tl_load_index_keys(
    k_ptr,
    r,
    ok,
    cols,
    cmask,
    DI,
    stride_kr,
    block_size,
    VALUE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    FMT: tl.constexpr,
    DI_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Keys of rows / slots r (int64 [BLOCK_S], in range where ok) -> fp32 [BLOCK_S, DI_P], 0 where masked."""
    mask = ok[:, None] & cmask[None, :]
    if FMT == 0:
        keys = tl.load(k_ptr + r[:, None] * stride_kr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        # Paged layout: block = r // block_size holds all its value rows, then all its scale rows.
        blk = r // block_size
        pos = r - blk * block_size
        base = blk * stride_kr
        vrow = base + pos * VALUE_BYTES
        srow = base + block_size * VALUE_BYTES + pos * SCALE_BYTES
        GROUP: tl.constexpr = 128 if FMT == 1 else 32  # values per scale: FP8 128, MXFP4 32
        if FMT == 1:
            codes = tl.load(k_ptr + vrow[:, None] + cols[None, :], mask=mask, other=0)
            vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            packed = tl.load(k_ptr + vrow[:, None] + (cols // 2)[None, :], mask=mask, other=0).to(tl.int32)
            nib = (packed >> ((cols % 2) * 4)[None, :]) & 0xF
            # e2m1: exponent field e = bits 1-2, mantissa m = bit 0; e == 0 is the subnormal 0 / 0.5.
            e = (nib >> 1) & 3
            m = (nib & 1).to(tl.float32)
            mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
            vals = tl.where((nib & 8) != 0, -mag, mag)
        # One scale per GROUP values, loaded once as [BLOCK_S, DI_P / GROUP] and broadcast over its group.
        NG: tl.constexpr = DI_P // GROUP
        g = tl.arange(0, NG)
        gmask = ok[:, None] & (g * GROUP < DI)[None, :]
        if FMT == 1:
            sptr = (k_ptr + srow[:, None] + 4 * g[None, :]).to(tl.pointer_type(tl.float32))
            scale = tl.load(sptr, mask=gmask, other=0.0)
        else:
            scale = tl_ue8m0_scale(tl.load(k_ptr + srow[:, None] + g[None, :], mask=gmask, other=127))
        keys = tl.reshape(tl.reshape(vals, [BLOCK_S, NG, GROUP]) * scale[:, :, None], [BLOCK_S, DI_P])
    return keys


def check_index_keys(keys: torch.Tensor, layout: IndexerKeyLayout | None, di: int) -> None:
    """Raise ValueError / TypeError unless `keys` is a store of Di-wide keys as `layout` describes."""
    if layout is None:
        if keys.dim() != 2 or keys.shape[1] != di or keys.stride(-1) != 1:
            raise ValueError(f"keys must be [R, Di={di}] with unit stride on the last dim, got {tuple(keys.shape)}")
        return
    if not isinstance(layout, IndexerKeyLayout):
        raise TypeError(f"layout must be an IndexerKeyLayout or None, got {type(layout).__name__}")
    if layout.index_head_dim != di:
        raise ValueError(f"layout.index_head_dim {layout.index_head_dim} != q's Di {di}")
    if keys.dtype != torch.uint8 or keys.dim() != 2 or keys.stride(-1) != 1 or keys.shape[1] < layout.block_bytes():
        raise ValueError(
            f"keys must be a uint8 cache [blocks, >= {layout.block_bytes()}] with unit last stride, "
            f"got {keys.dtype} {tuple(keys.shape)}"
        )
    if layout.fmt == "fp8" and (keys.stride(0) % 4 or keys.data_ptr() % 4):
        raise ValueError(f"an fp8 indexer cache must be 4-byte aligned (fp32 scales), got stride {keys.stride(0)}")


def key_format(layout: IndexerKeyLayout | None) -> tuple[int, int, int, int]:
    """-> (FMT, VALUE_BYTES, SCALE_BYTES, block_size) kernel arguments of a store's layout."""
    if layout is None:
        return PLAIN, 0, 0, 1
    return (FP8 if layout.fmt == "fp8" else MXFP4), layout.value_bytes, layout.scale_bytes, layout.block_size


def bf16_dot(q: torch.Tensor, keys: torch.Tensor, layout: IndexerKeyLayout | None) -> bool:
    """Dequantised keys are exact in bf16, so quantised stores take the bf16 dot whenever q is bf16 (GPU)."""
    return q.is_cuda and q.dtype == torch.bfloat16 and (layout is not None or keys.dtype == torch.bfloat16)
