"""Interleaved partial RoPE (plain and YaRN), forward and inverse.

V4 rotates only the trailing `rope_dim` channels of a head, pairing channels (2i, 2i+1). The attention
output gets the inverse rotation at the query position so each value's contribution depends only on the
relative distance. YaRN follows DeepSeek: corrected inverse frequencies, cos/sin scaled by
`attention_factor` (1.0 for V4's compressed layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def rope_inv_freq(
    theta: float,
    dim: int,
    yarn_factor: float | None = None,
    original_max_position: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Inverse frequencies, one per rotated pair. -> fp32 [dim // 2]."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if yarn_factor is None:
        return extrapolation
    interpolation = 1.0 / (yarn_factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0):
    """positions: int [...] -> (cos, sin), each fp32 [..., rope_dim // 2]."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x in interleaved pairs.

    x: [T, ..., D]; cos/sin: [T, rope_dim // 2] (broadcast over the middle dims). The rotation runs in fp32
    and is cast back to x.dtype. `inverse=True` applies the conjugate rotation (angle -theta).
    """
    half = cos.shape[-1]
    rope_dim = 2 * half
    extra = x.dim() - cos.dim()
    shape = (cos.shape[0],) + (1,) * extra + (half,)
    cos = cos.reshape(shape)
    sin = sin.reshape(shape)
    if inverse:
        sin = -sin
    rope = x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rot_even = even * cos - odd * sin
    rot_odd = odd * cos + even * sin
    rotated = torch.stack((rot_even, rot_odd), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)


@dataclass(frozen=True)
class InverseRope:
    """The inverse rotation of rows of heads: cos / sin fp32 [T, rope_dim // 2] (the rows' angles), head_dim the
    width of each head whose trailing rope_dim channels turn back (V4's attention output before wo_a). A projection
    that quantises its input can apply it in the same launch (dsv4_kernels.triton_fp8_quant.quant_act_1x128_grouped)."""

    cos: torch.Tensor
    sin: torch.Tensor
    head_dim: int

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ..., n * head_dim] -> the same with every head turned back (reference: apply_rope, inverse)."""
        heads = x.reshape(*x.shape[:-1], -1, self.head_dim)  # cos / sin broadcast over the middle dims
        return apply_rope(heads, self.cos, self.sin, inverse=True).reshape(x.shape)
