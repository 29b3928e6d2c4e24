"""Reference (plain torch) weight (de)quantisation for DeepSeek V4 checkpoints.

Two formats appear in the released checkpoints:
- FP8 e4m3 weights with one scale per 128x128 block (dense projections). The scale is stored as
  float32 (DeepSeek V3 style, transformers calls it `weight_scale_inv`) or as a UE8M0 power of two
  (V4: `float8_e8m0fnu`, or its raw `uint8` exponent byte).
- MXFP4 (OCP microscaling): e2m1 values, two per byte, one UE8M0 scale per 32 consecutive elements
  along the input dimension (routed experts). Low nibble = even element, high nibble = odd element
  (as in TokenSpeed's indexer-cache reader: `even = e2m1(packed & 0xF)`, `odd = e2m1(packed >> 4)`).

These functions are the correctness reference and the checkpoint writer for tests; they are not fast.
"""

from __future__ import annotations

import math

import torch

from dsv4_kernels import quant_formats as qf

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = qf.E2M1_MAX  # largest e2m1 magnitude
MXFP4_BLOCK = 32
FP8_BLOCK = (128, 128)
UE8M0_BIAS = 127

# e2m1 magnitudes indexed by the low three bits of a nibble; bit 0x8 is the sign.
E2M1_VALUES = qf.E2M1_GRID

_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)


# ---- scale helpers ----------------------------------------------------------------------------
def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode a scale tensor to float32, whatever its storage.

    uint8 is read as a UE8M0 exponent byte (value 2**(e-127), 255 = NaN); float8_e8m0fnu is the same
    thing typed; any floating dtype (float32 / bfloat16 V3-style scales) is taken as the value itself.
    """
    if _E8M0 is not None and scale.dtype == _E8M0:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        e = scale.to(torch.float32)
        # exp2 keeps e == 0 as the subnormal 2**-127 (a bit shift into the exponent field would give 0).
        return torch.where(scale == 255, torch.full_like(e, float("nan")), torch.exp2(e - UE8M0_BIAS))
    if scale.dtype == torch.int8:
        raise TypeError("int8 scales are ambiguous; pass UE8M0 scales as uint8 or float8_e8m0fnu")
    return scale.to(torch.float32)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode positive power-of-two float scales as UE8M0 bytes (uint8). Non-powers are rounded up."""
    e = torch.ceil(torch.log2(scale.to(torch.float32).clamp_min(2.0**-127)))
    return (e + UE8M0_BIAS).clamp(0, 254).to(torch.uint8)


def _as_e8m0(ue8m0: torch.Tensor) -> torch.Tensor:
    """uint8 exponent bytes -> float8_e8m0fnu when this torch has it (safetensors writes F8_E8M0)."""
    return ue8m0.view(_E8M0) if _E8M0 is not None else ue8m0


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), computed on exponents so it is exact."""
    return torch.exp2(torch.ceil(torch.log2(x)))


# ---- FP8 block scaling ----------------------------------------------------------------------
def _fp8_view(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn:
        return weight
    if weight.dtype in (torch.uint8, torch.int8):
        return weight.view(torch.float8_e4m3fn)
    raise TypeError(f"expected float8_e4m3fn (or uint8/int8 bytes) weight, got {weight.dtype}")


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """FP8 block-scaled weight -> float32.

    weight: [N, K] float8_e4m3fn (or uint8/int8 holding its bytes).
    scale:  [ceil(N/bn), ceil(K/bk)] float32/bfloat16 values, or UE8M0 (uint8 / float8_e8m0fnu).
    returns [N, K] float32 where element (n, k) = weight[n, k] * scale[n // bn, k // bk].
    """
    w = _fp8_view(weight).to(torch.float32)
    if w.dim() != 2:
        raise ValueError(f"FP8 block weight must be 2-D, got shape {tuple(w.shape)}")
    n, k = w.shape
    bn, bk = block
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scale shape {tuple(scale.shape)} does not match weight {n}x{k} (want {want})")
    s = ue8m0_to_float(scale).to(w.device)
    # Expand each block scale over its block, then crop the ragged last row/column of blocks.
    s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w * s


def quant_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, scale_fmt: str = "float32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], scale [ceil(N/bn), ceil(K/bk)]).

    scale_fmt "float32": scale = block amax / 448 (float32, V3 / transformers style);
    "ue8m0": scale rounded up to a power of two and stored as float8_e8m0fnu (uint8 if torch lacks it),
    the V4 release format. Rounding up keeps every scaled value within +-448 so nothing saturates.
    """
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(w.shape)}")
    if scale_fmt not in ("float32", "ue8m0"):
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}")
    w = w.to(torch.float32)
    n, k = w.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = w.new_zeros(gn * bn, gk * bk)
    padded[:n, :k] = w
    amax = padded.view(gn, bn, gk, bk).abs().amax(dim=(1, 3))  # [gn, gk]
    # An all-zero block gets scale 1 (any positive value would do; this avoids 0/0).
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        scale = _pow2_ceil(scale)
    s = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if scale_fmt == "ue8m0":
        return q, _as_e8m0(float_to_ue8m0(scale))
    return q, scale


# ---- MXFP4 ----------------------------------------------------------------------------------
def _packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    if _FP4X2 is not None and packed.dtype == _FP4X2:
        return packed.view(torch.uint8)
    if packed.dtype == torch.int8:
        return packed.view(torch.uint8)
    if packed.dtype == torch.uint8:
        return packed
    raise TypeError(f"expected int8/uint8 packed e2m1 bytes, got {packed.dtype}")


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    """MXFP4 weight -> float32.

    packed: [N, K/2] int8/uint8 (or float4_e2m1fn_x2); byte j holds element 2j in its low nibble and
            element 2j+1 in its high nibble.
    scale:  [N, K/32] UE8M0 (uint8 exponent, bias 127, or float8_e8m0fnu); float scales also accepted.
    returns [N, K] float32.
    """
    p = _packed_bytes(packed)
    *lead, half = p.shape
    k = 2 * half
    if k % block:
        raise ValueError(f"MXFP4 row length {k} is not a multiple of the block size {block}")
    if tuple(scale.shape) != (*lead, k // block):
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not match packed {tuple(p.shape)}")
    vals = qf.e2m1_decode(qf.unpack_nibbles(p))
    s = ue8m0_to_float(scale).to(vals.device)
    return (vals.reshape(*lead, k // block, block) * s.unsqueeze(-1)).reshape(*lead, k)


def mxfp4_as_bytes(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A stored MXFP4 weight -> (uint8 e2m1 bytes [..., K/2], uint8 UE8M0 bytes [..., K/32]), the form the
    Triton kernels read; None when the scales are floats that are not all powers of two (not MXFP4)."""
    if _E8M0 is not None and scale.dtype == _E8M0:
        scale = scale.view(torch.uint8)
    elif scale.dtype.is_floating_point:
        codes = float_to_ue8m0(scale)
        if not torch.equal(ue8m0_to_float(codes), scale.to(torch.float32)):
            return None
        scale = codes
    elif scale.dtype != torch.uint8:
        return None
    return _packed_bytes(packed).contiguous(), scale.contiguous()


def quant_mxfp4(
    w: torch.Tensor, block: int = MXFP4_BLOCK, packed_dtype: torch.dtype = torch.uint8
) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (packed [N, K/2] `packed_dtype`, scale [N, K/32] float8_e8m0fnu or uint8).

    The checkpoint-shaped wrapper of the one MXFP4 codec (`dsv4_kernels.quant_formats.quantize_mxfp4`, which the
    cache writers and Triton kernels match bit for bit): the block scale is the smallest power of two with
    amax / scale <= 6, so no element clips; e2m1 ties round to the smaller magnitude.
    """
    k = w.shape[-1]
    if k % block:
        raise ValueError(f"MXFP4 row length {k} is not a multiple of the block size {block}")
    packed, exponent = qf.quantize_mxfp4(w, block)
    if packed_dtype != torch.uint8:
        packed = packed.view(packed_dtype)
    return packed, _as_e8m0(qf.ue8m0_encode(exponent))
