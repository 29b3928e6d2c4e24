"""RMSNorm references.

Norms always run in fp32 and cast back once: V4 keeps norm weights in fp32 and the oracle multiplies in
fp32 before the cast, so doing the same keeps bf16 runs bit-compatible with it.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim. x: [..., D], weight: [D] -> [..., D] in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (per-head query norm, mHC input norm). x: [..., D] -> [..., D]."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
