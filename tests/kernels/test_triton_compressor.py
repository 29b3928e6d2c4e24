"""Triton compressor pooling (dsv4_kernels/triton_compressor.py) against pool_windows + rms_norm (+ apply_rope).

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (set before any
dsv4_kernels.triton_* import, because triton reads the flag when a kernel is decorated).
"""

import pytest
import torch

from dsv4_kernels.compressor import overlap_slots, pool_windows  # noqa: E402
from dsv4_kernels.norm import rms_norm  # noqa: E402
from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from dsv4_kernels.triton_compressor import pool_norm_rope  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)


def assert_close(out, expected, dtype):
    """The kernel rounds to dtype mid-way (before RoPE, as the reference does): atol scales with the output."""
    NUM.assert_close(out, expected, dtype, scaled=True)


N, EPS = 5, 1e-6


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def cos_sin(rope_dim, seed):
    positions = torch.randint(0, 4096, (N,), generator=torch.Generator().manual_seed(seed)) * 4
    cos, sin = rope_cos_sin(positions, rope_inv_freq(160000.0, rope_dim))
    return cos.to(DEVICE), sin.to(DEVICE)


def reference(kv, score, weight, cos=None, sin=None):
    pooled = rms_norm(pool_windows(kv, score), weight, EPS)
    return pooled if cos is None else apply_rope(pooled, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlap_ratio4_with_rope(dtype):
    """8 overlap slots from overlap_slots, entry 0 without a previous window (its first 4 slots -inf)."""
    r, d, rope = 4, 48, 16
    kv_prev, kv_cur = randn(N, r, 2 * d, seed=1), randn(N, r, 2 * d, seed=2)
    sc_prev, sc_cur = randn(N, r, 2 * d, seed=3, scale=2.0), randn(N, r, 2 * d, seed=4, scale=2.0)
    prev_valid = torch.ones(N, dtype=torch.bool, device=DEVICE)
    prev_valid[0] = False
    kv, score = overlap_slots(kv_prev, sc_prev, kv_cur, sc_cur, prev_valid)
    kv = kv.to(dtype)
    weight = randn(d, seed=5) + 1.0
    cos, sin = cos_sin(rope, seed=6)
    out = pool_norm_rope(kv, score, weight, EPS, cos, sin)
    expected = reference(kv, score, weight, cos, sin)
    assert out.dtype == dtype and out.shape == (N, d)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_slots_in_chunks_without_rope(dtype):
    """Non-overlap windows (ratio-128 style) walked in 4-slot chunks; one entry's first 2 chunks are all -inf."""
    slots, d = 12, 40
    kv = randn(N, slots, d, seed=7, dtype=dtype)
    score = randn(N, slots, d, seed=8, scale=3.0)
    score[2, :8] = float("-inf")
    weight = randn(d, seed=9) + 1.0
    out = pool_norm_rope(kv, score, weight, EPS, block_s=4)
    assert_close(out, reference(kv, score, weight), dtype)


def test_strided_slot_views():
    """kv / score as column slices of the compressor state's fp32 [kv | score] rows, as decode reads them."""
    slots, d, rope = 8, 32, 8
    rows = randn(N, slots, 2 * d, seed=10)
    kv, score = rows[..., :d], rows[..., d:]
    weight = randn(d, seed=11) + 1.0
    cos, sin = cos_sin(rope, seed=12)
    out = pool_norm_rope(kv, score, weight, EPS, cos, sin)
    assert_close(out, reference(kv, score, weight, cos, sin), torch.float32)


def test_bad_shapes_raise():
    kv = randn(N, 8, 32, seed=13)
    with pytest.raises(ValueError, match="score"):
        pool_norm_rope(kv, kv[:, :4], torch.ones(32, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="weight"):
        pool_norm_rope(kv, kv, torch.ones(16, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="cos and sin"):
        pool_norm_rope(kv, kv, torch.ones(32, device=DEVICE), EPS, cos=torch.ones(N, 4, device=DEVICE))
