"""Block-scaled FP8 linear layers, plain torch: the reference the DeepGEMM path (dsv4_kernels.deepgemm_linear)
must match.

DeepSeek V4's dense projections are stored as FP8 e4m3 weights [N, K] with one scale per 128x128 block
(UE8M0 in the release, i.e. powers of two). At inference the activations are quantised too, per token in
1x128 blocks along K (DeepSeek's `act_quant`; DeepGEMM's `per_token_cast_to_fp8`):
    scale[m, b] = max(amax(x[m, 128b : 128b + 128]), 1e-4) / 448        (rounded UP to a power of two
                                                                        when the checkpoint's scale_fmt
                                                                        is ue8m0, as V4's is)
    x_q[m, k]  = e4m3(x[m, k] / scale[m, k // 128])
    y[m, n]    = sum_k x_q[m, k] * scale[m, k // 128] * w[n, k] * w_scale[n // 128, k // 128]
The reference computes exactly that sum in fp32 on dequantised operands; the fast path runs the same
products on the tensor cores (fp32 accumulation, scales applied per 128-wide K block), so the two differ
only by accumulation order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 1.0e-4  # DeepGEMM's and DeepSeek's activation quantisers floor the block amax here


@dataclass(frozen=True)
class Fp8Weight:
    """A block-scaled FP8 weight: e4m3 `weight` [N, K] and fp32 `scale` [ceil(N/128), ceil(K/128)].

    Held as the checkpoint stores it (no bf16 copy); `pow2_act` says whether activations are quantised with
    power-of-two scales (the checkpoint's scale_fmt is ue8m0) or with amax / 448.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    pow2_act: bool = True

    def __post_init__(self):
        w, s = self.weight, self.scale
        if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
            raise ValueError(f"Fp8Weight.weight must be float8_e4m3fn [N, K], got {w.dtype} {tuple(w.shape)}")
        want = (math.ceil(w.shape[0] / BLOCK), math.ceil(w.shape[1] / BLOCK))
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(
                f"Fp8Weight.scale must be float32 {want} for weight {tuple(w.shape)}, got {s.dtype} {tuple(s.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.weight.shape  # 2-D, checked in __post_init__
        return rows, cols

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> [N, K] in `dtype`: weight * its block scale."""
        n, k = self.shape
        s = self.scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        return (self.weight.to(torch.float32) * s).to(dtype)


def act_scales(x: torch.Tensor, pow2: bool = True) -> torch.Tensor:
    """x: [M, K] -> fp32 per-token block scales [M, ceil(K/128)] (see the module docstring)."""
    m, k = x.shape
    kb = math.ceil(k / BLOCK)
    padded = x.new_zeros(m, kb * BLOCK, dtype=torch.float32)
    padded[:, :k] = x.float()
    amax = padded.view(m, kb, BLOCK).abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scale = amax / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(scale))) if pow2 else scale


def quant_act_1x128(x: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)]), per token in 1x128 blocks."""
    if x.dim() != 2:
        raise ValueError(f"activations must be [M, K], got shape {tuple(x.shape)}")
    scale = act_scales(x, pow2)
    k = x.shape[1]
    s = scale.repeat_interleave(BLOCK, dim=1)[:, :k]
    q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequant_act(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(e4m3 [M, K], fp32 [M, ceil(K/128)]) -> fp32 [M, K]."""
    k = q.shape[1]
    return q.float() * scale.repeat_interleave(BLOCK, dim=1)[:, :k]


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """y = x W^T with x quantised per token (1x128) and W block-scaled FP8. x: [..., K] -> [..., N] in x.dtype."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"activations end in {x.shape[-1]} features, weight {tuple(w.shape)} expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    xq = dequant_act(*quant_act_1x128(x2, w.pow2_act))
    y = xq @ w.dequant(torch.float32).t()
    return y.to(x.dtype).view(*lead, n)


def weight_from_checkpoint(weight: torch.Tensor, scale: torch.Tensor, pow2_act: bool = True) -> Fp8Weight:
    """Checkpoint FP8 bytes (e4m3 or raw uint8/int8) + block scales (UE8M0 bytes or floats) -> Fp8Weight."""
    from dsv4_kernels.quant import ue8m0_to_float

    w = weight if weight.dtype == torch.float8_e4m3fn else weight.view(torch.float8_e4m3fn)
    return Fp8Weight(w.contiguous(), ue8m0_to_float(scale).to(w.device).contiguous(), pow2_act)
