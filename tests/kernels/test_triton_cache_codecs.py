"""Triton element codecs (dsv4_kernels/triton_cache_codecs.py) bit for bit against dsv4_kernels/quant_formats.py.

Runs compiled on a GPU when one is present (where the e4m3 encoder is the hardware cast), else in
triton's CPU interpreter (the software encoder).
"""

import pytest
import torch

from dsv4_kernels import quant_formats as qf  # noqa: E402
from dsv4_kernels import triton_cache_codecs as tc  # noqa: E402
from dsv4_kernels.hadamard import hadamard_matrix  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

triton, tl = tc.triton, tc.tl


@triton.jit
def _codecs_kernel(
    x_ptr, bf_ptr, f8_ptr, e2_ptr, efp8_ptr, ee2_ptr, N, floor, HW_FP8: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    tl.store(bf_ptr + i, tc.tl_round_bf16(x), mask=m)
    tl.store(f8_ptr + i, tc.tl_e4m3_bits(x, HW_FP8), mask=m)
    tl.store(e2_ptr + i, tc.tl_e2m1_code(x).to(tl.uint8), mask=m)
    a = tl.abs(x)
    tl.store(efp8_ptr + i, tc.tl_pow2_exponent(a, floor, tc.FP8_MAX_EXP, tc.FP8_MAX_MANT), mask=m)
    tl.store(ee2_ptr + i, tc.tl_pow2_exponent(a, floor, tc.E2M1_MAX_EXP, tc.E2M1_MAX_MANT), mask=m)


@triton.jit
def _rotation_kernel(out_ptr, N, HADAMARD: tl.constexpr, LOG2N: tl.constexpr, NP: tl.constexpr):
    j = tl.arange(0, NP)
    tl.store(out_ptr + j[:, None] * NP + j[None, :], tc.tl_rotation(j, j, N, HADAMARD, LOG2N))


def run_codecs(x: torch.Tensor, floor: float = qf.AMAX_FLOOR):
    n = x.numel()
    outs = [
        torch.empty(n, dtype=dt, device=DEVICE)
        for dt in (torch.float32, torch.uint8, torch.uint8, torch.int32, torch.int32)
    ]
    block = 1024
    _codecs_kernel[(triton.cdiv(n, block),)](x, *outs, n, floor, HW_FP8=x.is_cuda and tc.USE_HW_FP8_CAST, BLOCK=block)
    return outs


def edge_values() -> torch.Tensor:
    """Random magnitudes across the fp8 range plus exact grid points, midpoints and their fp32 neighbours."""
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-14, 10, (20000,), generator=gen).float())
    grid = qf.fp8_e4m3_decode(torch.arange(256, dtype=torch.uint8))
    grid = grid[torch.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2
    powers = torch.tensor([448.0 * 2.0**k for k in range(-24, 20)] + [6.0 * 2.0**k for k in range(-20, 20)])
    e2 = torch.tensor(qf.E2M1_GRID + (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
    base = torch.cat([grid, mids, powers, e2, torch.tensor([0.0, -0.0, 1e-30, 1e-4, 2.0**-10])])
    up, down = torch.nextafter(base, base + 1), torch.nextafter(base, base - 1)
    vals = torch.cat([rand, base, up, down, -base, -up, -down])
    return vals[vals.abs() <= 448.0].contiguous()


def test_codecs_equal_quant_formats_bit_for_bit():
    x = edge_values()
    bf, f8, e2, efp8, ee2 = (o.cpu() for o in run_codecs(x.to(DEVICE)))
    assert torch.equal(bf, x.to(torch.bfloat16).float())
    assert torch.equal(f8, qf.fp8_e4m3_encode(x))
    assert torch.equal(e2, qf.e2m1_encode(x))
    # Exponents of bf16-valued amax (every production path): equal to torch's ceil(log2(.)) exactly.
    a = x.abs()
    is_bf16 = a == a.to(torch.bfloat16).float()
    assert torch.equal(efp8[is_bf16], qf.pow2_exponent(a, qf.FP8_E4M3_MAX)[is_bf16].int())
    assert torch.equal(ee2[is_bf16], qf.pow2_exponent(a, qf.E2M1_MAX)[is_bf16].int())
    # Any fp32 amax: the kernel's exponent is the exact one (smallest e with amax <= max * 2**e), and torch's
    # fp32 log2 is at most one lower (only just above a power of two, see the module docstring).
    for got, fmt_max in ((efp8, qf.FP8_E4M3_MAX), (ee2, qf.E2M1_MAX)):
        am = a.double().clamp_min(qf.AMAX_FLOOR)
        e = got.double()
        assert bool((am <= fmt_max * torch.exp2(e)).all()) and bool((am > fmt_max * torch.exp2(e - 1)).all())
        diff = got - qf.pow2_exponent(a, fmt_max).int()
        assert bool(((diff == 0) | (diff == 1)).all())


@pytest.mark.parametrize("hadamard", [True, False])
def test_rotation_blocks(hadamard):
    n = 32
    out = torch.empty(64, 64, device=DEVICE)
    _rotation_kernel[(1,)](out, n, HADAMARD=hadamard, LOG2N=5, NP=64)
    expected = torch.zeros(64, 64)
    expected[:n, :n] = hadamard_matrix(n) if hadamard else torch.eye(n)
    assert torch.equal(out.cpu(), expected)
