"""Walsh-Hadamard rotation reference (the indexer's q and k rotation before quantisation).

V4 rotates both the indexer queries and the indexer keys with the normalised Sylvester Hadamard matrix
H_n / sqrt(n) (natural order, H[i, j] = (-1) ** popcount(i & j): the order of the fast transform, e.g.
TokenSpeed's `hadamard_transform(x, scale=n ** -0.5)`, seed 002). H / sqrt(n) is orthogonal and symmetric,
so (Hq) . (Hk) = q . k: the rotation leaves scores unchanged and only spreads outliers across channels
before MXFP4 / FP8 quantisation. It sits after RoPE and before quantisation on both sides; the seed feeds
it the bf16 vector and gets bf16 back, i.e. fp32 math rounded once to the model dtype, as here.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _hadamard_cpu(n: int) -> torch.Tensor:
    idx = torch.arange(n)
    both = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(both)
    for b in range(max(1, n.bit_length())):
        parity ^= (both >> b) & 1
    return (1 - 2 * parity).float()


def hadamard_matrix(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix, fp32 [n, n] of +-1; n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    return _hadamard_cpu(n).to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim: x [..., n] -> (x @ H_n) * n ** -0.5 in x.dtype (fp32 math, one rounding)."""
    n = x.shape[-1]
    h = hadamard_matrix(n, x.device)
    return ((x.float() @ h) * n**-0.5).to(x.dtype)
