"""Triton per-row exponential noise (dsv4_kernels/triton_sampling.py): a function of the row's seed only, Exp(1)."""

import torch

from dsv4_kernels.triton_sampling import exp_noise  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)


def test_noise_depends_only_on_the_row_seed_and_is_exponential():
    seeds = torch.tensor([7, 2**62 + 12345, 7, 99], dtype=torch.int64, device=DEVICE)
    e = exp_noise(seeds, 3000)
    assert e.shape == (4, 3000) and e.dtype == torch.float32
    assert torch.equal(e[0], e[2]) and not torch.equal(e[0], e[1])
    # the same seed in another batch (other rows, other position) draws the same row
    again = exp_noise(torch.tensor([5, 99], dtype=torch.int64, device=DEVICE), 3000)
    assert torch.equal(again[1], e[3])
    assert (e > 0).all() and torch.isfinite(e).all()
    mean = e.double().mean().item()  # Exp(1): mean 1, sd of the mean ~ 1 / sqrt(12000)
    assert abs(mean - 1.0) < 0.05, mean
