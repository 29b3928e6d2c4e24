"""Triton gathered k-way combine (dsv4_kernels/triton_pair_combine.py) against its torch expression.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (tests/support/triton_env.py).
"""

import pytest
import torch

from dsv4_kernels import triton_pair_combine as pc  # noqa: E402
from tests.support import numerics as NUM
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)


def _ref(y, rows, w, shared, dtype):
    picked = y.float()[rows.clamp_min(0)] * w.float().unsqueeze(-1)
    out = torch.where((rows >= 0).unsqueeze(-1), picked, 0.0).sum(1).to(dtype)
    return out if shared is None else (out.float() + shared.float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [True, False])
def test_gather_combine_matches_reference(dtype, with_shared):
    """Rows -1 are never read: the padded rows they would hit hold NaN here."""
    t, k, m, h = 5, 3, 24, 80
    y = NUM.randn(m, h, dtype=dtype, device=DEVICE, seed=1)
    y[20:] = float("nan")
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 20, (t, k), generator=g)
    rows[1, 2] = rows[3, 0] = -1
    w = torch.rand(t, k, generator=g)
    shared = NUM.randn(t, h, dtype=dtype, device=DEVICE, seed=3) if with_shared else None
    got = pc.gather_combine(y, rows.to(DEVICE), w.to(DEVICE), shared)
    assert got.dtype == dtype and not got.isnan().any()
    NUM.assert_close(got, _ref(y, rows.to(DEVICE), w.to(DEVICE), shared, dtype), dtype)


def test_gather_combine_empty_and_checks():
    y = NUM.randn(8, 16, device=DEVICE, seed=4)
    assert pc.gather_combine(
        y, torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), torch.zeros(0, 2, device=DEVICE)
    ).shape == (0, 16)
    with pytest.raises(ValueError, match="both be"):
        pc.gather_combine(y, torch.zeros(3, 2, dtype=torch.int64, device=DEVICE), torch.zeros(3, 1, device=DEVICE))
