"""Numerics shared by every kernel and engine test: tolerances keyed by dtype, random inputs, assert_close.

One table so CI is never looser than a local run and no test file carries its own copy. The 16-bit
tolerances cover one rounding to bf16 mid-kernel; fp32 ones cover reordered sums.
"""

from __future__ import annotations

import torch

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
# Kernels that accumulate over many experts or long rows (grouped MoE) round more often than one op.
LOOSE_TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}


def tol(dtype: torch.dtype, loose: bool = False) -> dict:
    """{"atol", "rtol"} for comparing a `dtype` kernel output with its fp32 reference."""
    table = LOOSE_TOL if loose else TOL
    if dtype not in table:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {sorted(map(str, table))}")
    return dict(table[dtype])


def assert_close(
    out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scaled: bool = False, loose: bool = False
) -> None:
    """Compare in fp32 with `dtype`'s tolerance. scaled=True makes atol relative to the expected output's
    largest magnitude: a one-ulp rounding before a rotation (RoPE, Hadamard) carries ~m * 2^-8 of the
    largest value m into outputs near zero."""
    t = tol(dtype, loose)
    scale = max(1.0, expected.float().abs().max().item()) if scaled else 1.0
    torch.testing.assert_close(out.float(), expected.float(), atol=t["atol"] * scale, rtol=t["rtol"])


def randn(
    *shape: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    scale: float = 1.0,
) -> torch.Tensor:
    """Fresh seeded normal inputs (never zeros), drawn in fp32 on the CPU so every device sees the same."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
