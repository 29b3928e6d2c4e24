"""Triton element codecs and paged-row addressing shared by the cache-writing kernels.

The rules are those of dsv4_kernels/quant_formats.py (what geometry's pack functions apply); here they are built
from integer bit operations, so triton's CPU interpreter and the GPU write the same bytes:
- `tl_round_bf16`: fp32 -> nearest-even bf16 value (kept in fp32). The interpreter's `.to(tl.bfloat16)`
  truncates, and every quantiser rounds its input to the model dtype first, so it must be exact.
- `tl_pow2_exponent`: e = ceil(log2(max(amax, floor) / fmt_max)), computed exactly as the smallest e with
  max(amax, floor) <= fmt_max * 2**e from amax's exponent and mantissa bits (the GPU's lg2.approx and
  div.full are not correctly rounded). torch's fp32 log2 agrees whenever amax is bf16-valued (8 mantissa
  bits: its quotient by 448 or 6 is at least 0.4% away from a power of two), which covers every production
  path (fp8_ds_mla rounds to bf16 before quantising; the model dtype is bf16). For arbitrary fp32 amax within
  ~|e| * 2**-23 (relative) above fmt_max * 2**e, torch's log2 rounds down onto an integer and the reference
  picks the exponent one lower (saturating that block at fmt_max); the kernel keeps the exact one.
- `tl_e4m3_bits`: fp32 in [-448, 448] -> e4m3fn byte, round to nearest even, -0 kept as 0x80 (as torch). On the
  GPU `HW_FP8` uses the hardware cast instead (cvt.rn.satfinite on sm_89+); the interpreter's cast drops the
  carry when the mantissa rounds up to the next power of two (125.7 -> 64), so it never runs there.
- `tl_e2m1_code`: nibble of the nearest e2m1 value, ties toward zero, -0 stored as +0 (quant_formats' bounds).
Paged addressing (`tl_row_offsets`) is geometry's block layout: block s // block_size starts at
block * block_stride; it holds block_size value rows, then block_size scale rows.
"""

from __future__ import annotations

import struct

import torch

from dsv4_kernels import quant_formats as qf
from dsv4_kernels.geometry import (
    FP8_INDEXER_AMAX_FLOOR,
    FP8_INDEXER_BLOCK,
    MXFP4_BLOCK,
    BlockRowLayout,
)
from dsv4_kernels.gpu import import_triton

triton, tl = import_triton()

# Set False to make the GPU use the bit-exact software e4m3 encoder too (e.g. if a triton build converts
# fp32 -> fp8 through fp16, which double-rounds; tests/kernels/test_triton_cache_codecs.py would catch it).
USE_HW_FP8_CAST = True


def fmt_max_bits(fmt_max: float) -> tuple[int, int]:
    """fmt_max = 1.m * 2**E -> (E, 23-bit mantissa field of m): the constants `tl_pow2_exponent` compares with."""
    bits = struct.unpack("<I", struct.pack("<f", fmt_max))[0]
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


FP8_MAX_EXP, FP8_MAX_MANT = fmt_max_bits(qf.FP8_E4M3_MAX)  # 448 = 1.75 * 2**8
E2M1_MAX_EXP, E2M1_MAX_MANT = fmt_max_bits(qf.E2M1_MAX)  # 6 = 1.5 * 2**2
# The same numbers as constexpr globals (jit functions may only read constexpr globals).
FP8_EXP, FP8_MANT = tl.constexpr(FP8_MAX_EXP), tl.constexpr(FP8_MAX_MANT)
E2M1_EXP, E2M1_MANT = tl.constexpr(E2M1_MAX_EXP), tl.constexpr(E2M1_MAX_MANT)
CODEC_AMAX_FLOOR = tl.constexpr(qf.AMAX_FLOOR)  # fp8_ds_mla and MXFP4
FP8_INDEXER_FLOOR = tl.constexpr(FP8_INDEXER_AMAX_FLOOR)
MX_HALF = tl.constexpr(MXFP4_BLOCK // 2)  # even (or odd) columns of one MXFP4 scale group
FP8_GROUP = tl.constexpr(FP8_INDEXER_BLOCK)


@triton.jit
def tl_round_bf16(x):
    """fp32 -> fp32 holding x rounded to the nearest-even bf16 (finite x)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def tl_round_to(x, BF16: tl.constexpr, DT: tl.constexpr):
    """fp32 x rounded to the model dtype (bf16 exactly by bits; fp16 by cast; fp32 unchanged), kept in fp32."""
    if BF16:
        y = tl_round_bf16(x)
    else:
        y = x.to(DT).to(tl.float32)
    return y


@triton.jit
def tl_pow2_exponent(amax, floor, FMT_EXP: tl.constexpr, FMT_MANT: tl.constexpr):
    """int32 e = ceil(log2(max(amax, floor) / fmt_max)) exactly; fmt_max = (1 + FMT_MANT / 2**23) * 2**FMT_EXP."""
    bits = tl.maximum(amax, floor).to(tl.int32, bitcast=True)
    over = ((bits & 0x7FFFFF) > FMT_MANT).to(tl.int32)
    return ((bits >> 23) & 0xFF) - 127 - FMT_EXP + over


@triton.jit
def tl_exp2i(e):
    """int32 e in [-126, 127] -> fp32 2**e, exact (built from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def tl_ue8m0(e):
    """int32 exponents -> UE8M0 bytes e + 127 saturated to [0, 255] (quant_formats.ue8m0_encode)."""
    return tl.minimum(tl.maximum(e + 127, 0), 255).to(tl.uint8)


@triton.jit
def tl_e4m3_bits(v, HW_FP8: tl.constexpr):
    """fp32 v (scaled into range; clamped here to +-448) -> uint8 e4m3fn bit patterns, nearest even."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if HW_FP8:
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        a = tl.abs(v)
        bits = a.to(tl.int32, bitcast=True)
        # Normal range: keep 3 mantissa bits with round-half-even; a carry moves into the exponent as it must.
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
        # Below 2**-6 the e4m3 grid is 2**-9 apart: adding 2**14 rounds a to that grid (fp32 spacing at 2**14
        # is 2**-9, ties to even), and the offset from 2**14's bits is the subnormal code (8 = 2**-6 normal).
        sub = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        code = tl.where(a < 0.015625, sub, normal)
        sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 7
        code = (code | sign).to(tl.uint8)
    return code


@triton.jit
def tl_e2m1_code(v):
    """fp32 v (already divided by its block scale) -> int32 e2m1 nibbles (quant_formats.e2m1_encode)."""
    a = tl.abs(v)
    code = (
        (a > 0.25).to(tl.int32)
        + (a > 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a > 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a > 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return tl.where((v < 0) & (code != 0), code | 8, code)


@triton.jit
def tl_row_offsets(slot, block_size, block_stride, VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """int64 slots -> (value row, scale row) byte offsets in a paged cache (geometry's block layout)."""
    blk = slot // block_size
    pos = slot - blk * block_size
    base = blk * block_stride
    return base + pos * VALUE_BYTES, base + block_size * VALUE_BYTES + pos * SCALE_BYTES


@triton.jit
def tl_rotation(j, i, n, HADAMARD: tl.constexpr, LOG2N: tl.constexpr):
    """[K, N] fp32 block of the n x n Sylvester Hadamard matrix (+-1, unnormalised) at rows j, columns i, or of
    the identity when not HADAMARD; 0 outside [0, n)^2. H[j, i] = (-1) ** popcount(j & i)."""
    inside = (j < n)[:, None] & (i < n)[None, :]
    if HADAMARD:
        v = j[:, None] & i[None, :]
        par = v & 0
        for b in tl.static_range(LOG2N):
            par = par ^ ((v >> b) & 1)
        m = tl.where(inside, 1.0 - 2.0 * par.to(tl.float32), 0.0)
    else:
        m = tl.where(inside & (j[:, None] == i[None, :]), 1.0, 0.0)
    return m


def paged_cache_args(cache: torch.Tensor, layout: BlockRowLayout) -> tuple[int, int]:
    """Validate a paged uint8 cache of `layout` -> (block stride in bytes, capacity in rows).

    Accepts geometry's shape [blocks, >= block_bytes] (block stride = cache.stride(0)) or the engine's
    per-layer view [rows, row_bytes] (rows a multiple of block_size; block stride = block_bytes).
    """
    if cache.dtype != torch.uint8 or cache.dim() != 2 or not cache.is_contiguous():
        raise ValueError(
            f"cache must be a contiguous uint8 [blocks, >= {layout.block_bytes()}] or "
            f"[rows, {layout.row_bytes}] tensor, got {cache.dtype} {tuple(cache.shape)}"
        )
    if cache.shape[1] >= layout.block_bytes():
        return cache.stride(0), cache.shape[0] * layout.block_size
    if cache.shape[1] == layout.row_bytes and cache.shape[0] % layout.block_size == 0:
        return layout.block_bytes(), cache.shape[0]
    raise ValueError(
        f"cache must be [blocks, >= {layout.block_bytes()}] or [rows (multiple of "
        f"{layout.block_size}), {layout.row_bytes}], got {tuple(cache.shape)}"
    )


def check_rows(rows: torch.Tensor, n: int, capacity: int, what: str = "rows") -> torch.Tensor:
    """int [n] destination row ids (-1 = skip) -> contiguous; raises on a bad shape or dtype.

    Out-of-range ids are not checked here (that would sync the GPU); callers own the range, as with index_copy.
    """
    if rows.dim() != 1 or rows.shape[0] != n or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{what} must be int32/int64 [{n}] (-1 = skip; < {capacity}), got {rows.dtype} {tuple(rows.shape)}"
        )
    return rows.contiguous()


@triton.jit
def tl_store_fp8_ds_mla(
    cache_ptr,
    vrow,
    srow,
    ok,
    nope,
    ev,
    od,
    p,
    HALF,
    NB: tl.constexpr,
    NB_P: tl.constexpr,
    QB: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
    PAD: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """Write one fp8_ds_mla row (geometry.pack_fp8_ds_mla) at value / scale row offsets vrow / srow if ok.

    vrow, srow: int64 [1]; ok: bool [1] (a [1] vector: the interpreter rejects masks from scalar compares).
    nope: fp32 [NB_P, QB] bf16-valued NoPE values (quant block b = row b; rows >= NB and zero padding are
    ignored / encode as 0); ev, od: fp32 [HALF_P] bf16-valued RoPE pairs (channels 2p, 2p + 1); PAD zero
    bytes follow the NB scale bytes.
    """
    b = tl.arange(0, NB_P)
    j = tl.arange(0, QB)
    bmask = b < NB
    e = tl_pow2_exponent(tl.max(tl.abs(nope), axis=1), CODEC_AMAX_FLOOR, FP8_EXP, FP8_MANT)
    codes = tl_e4m3_bits(nope * tl_exp2i(-e)[:, None], HW_FP8)
    tl.store(cache_ptr + vrow + b[:, None] * QB + j[None, :], codes, mask=ok & bmask[:, None])
    rope = (cache_ptr + vrow + ROPE_OFFSET).to(tl.pointer_type(tl.bfloat16))
    pm = ok & (p < HALF)
    tl.store(rope + 2 * p, ev.to(tl.bfloat16), mask=pm)  # exact: already bf16-valued
    tl.store(rope + 2 * p + 1, od.to(tl.bfloat16), mask=pm)
    tl.store(cache_ptr + srow + b, tl_ue8m0(e), mask=ok & bmask)
    for k in tl.static_range(PAD):
        tl.store(cache_ptr + srow + NB + k, tl.zeros([1], tl.uint8), mask=ok)
