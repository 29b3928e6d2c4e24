"""Element formats of DeepSeek V4's quantized caches: FP8 e4m3, FP4 e2m1 and power-of-two scales.

Bit-level codecs only, plain torch, CPU friendly; `dsv4_kernels.geometry` decides where the bytes live.
(`dsv4_kernels.quant` is a different module: it dequantises checkpoint *weights*.)

Rules, as TokenSpeed's reference cache writers apply them (seed 002 and its Triton kernels):
- every scale is a power of two 2**e, chosen as e = ceil(log2(amax / fmt_max)) so that the block's
  largest magnitude lands in (fmt_max / 2, fmt_max]; amax is floored first so an all-zero block still
  gets a finite scale;
- a UE8M0 scale is stored as the single byte e + 127 (no mantissa, no sign), decoded as 2**(byte - 127);
- e2m1 rounds to the nearest grid value and a value exactly between two grid values rounds DOWN in
  magnitude (the kernels compare with `<=`); -0 is stored as +0;
- two e2m1 nibbles share a byte: element 2i in the low nibble, element 2i+1 in the high nibble.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
UE8M0_BIAS = 127
# Magnitudes of the 8 e2m1 codes (bit 3 of a nibble is the sign).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; |x| <= bound[i] (and > bound[i-1]) encodes as code i.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# amax floor of the fp8_ds_mla and MXFP4 writers; the FP8 indexer writer floors amax/448 at 1e-10 instead.
AMAX_FLOOR = 1.0e-4


def pow2_exponent(amax: torch.Tensor, fmt_max: float, floor: float = AMAX_FLOOR) -> torch.Tensor:
    """Integer-valued float32 exponents e = ceil(log2(max(amax, floor) / fmt_max)), same shape as amax."""
    return torch.ceil(torch.log2(amax.float().clamp_min(floor) / fmt_max))


def ue8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Exponents (float or int) -> uint8 bytes e + 127, saturated to [0, 255] as the writers do."""
    return torch.clamp(exponent.float() + UE8M0_BIAS, 0.0, 255.0).to(torch.uint8)


def ue8m0_decode(scale_bytes: torch.Tensor) -> torch.Tensor:
    """uint8 UE8M0 bytes -> float32 scales 2**(byte - 127). Every byte below 255 is exact in fp32."""
    return torch.exp2(scale_bytes.to(torch.float32) - UE8M0_BIAS)


def fp8_e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 e4m3fn bit patterns (round to nearest even). Clamped first: e4m3fn has no inf."""
    return torch.clamp(x.float(), -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bit patterns -> float32 values."""
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 nibbles (0..15): bits 0-2 index E2M1_GRID, bit 3 is the sign. Saturates at 6."""
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    x = x.float()
    # bucketize(right=False) returns i with bounds[i-1] < |x| <= bounds[i]: ties go to the smaller code.
    code = torch.bucketize(x.abs(), bounds, right=False).to(torch.uint8)
    negative = (x < 0) & (code != 0)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles (0..15) -> float32 values."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=nibbles.device)
    magnitude = grid[(nibbles & 0x7).long()]
    return torch.where((nibbles & 0x8) != 0, -magnitude, magnitude)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [..., 2k] -> bytes [..., k]; element 2i goes to the low nibble of byte i."""
    if nibbles.shape[-1] % 2:
        raise ValueError(f"need an even number of nibbles, got shape {tuple(nibbles.shape)}")
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., k] -> uint8 nibbles [..., 2k] (inverse of `pack_nibbles`)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def quantize_fp8_pow2(x: torch.Tensor, block: int, floor: float = AMAX_FLOOR) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 e4m3 with power-of-two scales.

    x: [..., n] float, n % block == 0 -> (codes uint8 [..., n], exponents float32 [..., n // block]).
    """
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the quant block {block}; shape {tuple(x.shape)}")
    blocks = x.float().reshape(*x.shape[:-1], n // block, block)
    exponent = pow2_exponent(blocks.abs().amax(dim=-1), FP8_E4M3_MAX, floor)
    # Multiplying by an exact power of two cannot add rounding error; all rounding happens in the cast.
    codes = fp8_e4m3_encode(blocks * torch.exp2(-exponent).unsqueeze(-1))
    return codes.reshape(x.shape), exponent


def dequantize_fp8_pow2(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., n], float32 scales [..., n // block] -> float32 [..., n]."""
    block = codes.shape[-1] // scales.shape[-1]
    return fp8_e4m3_decode(codes) * scales.repeat_interleave(block, dim=-1)


def quantize_mxfp4(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: e2m1 values with one UE8M0 scale per `block` elements.

    x: [..., n] float, n % block == 0 -> (packed uint8 [..., n // 2], exponents float32 [..., n // block]).
    """
    n = x.shape[-1]
    if n % block or block % 2:
        raise ValueError(f"last dim {n} must be a multiple of the even MXFP4 block {block}; shape {tuple(x.shape)}")
    blocks = x.float().reshape(*x.shape[:-1], n // block, block)
    # The MXFP4 writer clamps the exponent to the normal UE8M0 range before scaling.
    exponent = pow2_exponent(blocks.abs().amax(dim=-1), E2M1_MAX).clamp(-127.0, 127.0)
    nibbles = e2m1_encode(blocks * torch.exp2(-exponent).unsqueeze(-1)).reshape(x.shape)
    return pack_nibbles(nibbles), exponent


def dequantize_mxfp4(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., n // 2], UE8M0 bytes [..., n // block] -> float32 [..., n]."""
    values = e2m1_decode(unpack_nibbles(packed))
    block = values.shape[-1] // scale_bytes.shape[-1]
    return values * ue8m0_decode(scale_bytes).repeat_interleave(block, dim=-1)
