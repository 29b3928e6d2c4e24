"""Triton fused RMSNorm + RoPE (dsv4_kernels/triton_norm_rope.py) against dsv4_kernels.norm + dsv4_kernels.rope.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (set before any
dsv4_kernels.triton_* import, because triton reads the flag when a kernel is decorated).
"""

import pytest
import torch

from dsv4_kernels.norm import rms_norm, unweighted_rms_norm  # noqa: E402
from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from dsv4_kernels.triton_norm_rope import rms_norm_rope, rope  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)


def assert_close(out, expected, dtype):
    """The kernel rounds to dtype mid-way (before RoPE, as the reference does): atol scales with the output."""
    NUM.assert_close(out, expected, dtype, scaled=True)


T, EPS = 5, 1e-6


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def cos_sin(rope_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 5000, (T,), generator=gen)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(10000.0, rope_dim))
    return cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_per_head_unweighted(dtype):
    h, d, rope = 5, 96, 32  # D not a power of two; rows not a multiple of the row block
    q = randn(T, h, d, seed=1, dtype=dtype, scale=3.0)
    cos, sin = cos_sin(rope, seed=2)
    out = rms_norm_rope(q, cos, sin, EPS, block_r=4)
    expected = apply_rope(unweighted_rms_norm(q, EPS), cos, sin)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_weighted(dtype):
    d, rope = 80, 16
    kv = randn(T, d, seed=3, dtype=dtype, scale=0.5)
    weight = randn(d, seed=4) + 1.0  # fp32, as V4 keeps norm weights
    cos, sin = cos_sin(rope, seed=5)
    out = rms_norm_rope(kv, cos, sin, EPS, weight, block_r=2)
    expected = apply_rope(rms_norm(kv, weight, EPS), cos, sin)
    assert_close(out, expected, dtype)


def test_strided_q_view_and_no_rope_channels_untouched():
    h, d, rope = 4, 64, 16
    big = randn(T, h, d + 8, seed=6)
    q = big[..., :d]  # head stride > D
    cos, sin = cos_sin(rope, seed=7)
    out = rms_norm_rope(q, cos, sin, EPS)
    expected = apply_rope(unweighted_rms_norm(q, EPS), cos, sin)
    assert_close(out, expected, torch.float32)
    assert_close(out[..., : d - rope], unweighted_rms_norm(q, EPS)[..., : d - rope], torch.float32)


def test_bad_shapes_raise():
    q = randn(T, 4, 64, seed=8)
    cos, sin = cos_sin(16, seed=9)
    with pytest.raises(ValueError, match="cos/sin"):
        rms_norm_rope(q, cos[:2], sin[:2], EPS)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_rope(q, cos, sin, EPS, torch.ones(8, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_alone(dtype, inverse):
    """rope = apply_rope (the output's inverse rotation, the indexer queries): bit-equal where the reference
    rounds once (fp32 math, one cast); a strided head view and a [T, D] input."""
    h, d, r = 3, 80, 16
    big = randn(T, h, d + 8, seed=10, dtype=dtype, scale=3.0)
    x = big[..., :d]
    cos, sin = cos_sin(r, seed=11)
    out = rope(x, cos, sin, inverse, block_r=4)
    expected = apply_rope(x, cos, sin, inverse=inverse)
    assert out.dtype == dtype and out.shape == x.shape
    NUM.assert_close(out, expected, dtype)
    assert torch.equal(out[..., : d - r], x[..., : d - r])
    flat = randn(T, d, seed=12, dtype=dtype)
    NUM.assert_close(rope(flat, cos, sin, inverse), apply_rope(flat, cos, sin, inverse=inverse), dtype)
    with pytest.raises(ValueError, match="cos/sin"):
        rope(flat, cos[:2], sin[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_r", [4, None])  # None: the size rule (rows / 128 within [4, 128])
@pytest.mark.parametrize("pairs", [False, True])  # True: _rope_pairs_kernel (the rope channels as one tile)
def test_rope_in_place_writes_only_the_rope_channels(dtype, block_r, pairs):
    """inplace=True: the strided view itself holds apply_rope's result; the pad columns beside the view and the
    non-rotated channels keep their values."""
    h, d, r = 3, 80, 16
    big = randn(T, h, d + 8, seed=13, dtype=dtype, scale=3.0)
    before = big.clone()
    x = big[..., :d]
    cos, sin = cos_sin(r, seed=14)
    expected = apply_rope(x.clone(), cos, sin, inverse=True)
    out = rope(x, cos, sin, True, block_r=block_r, inplace=True, pairs=pairs)
    assert out.data_ptr() == x.data_ptr()
    NUM.assert_close(x, expected, dtype)
    assert torch.equal(big[..., : d - r], before[..., : d - r]) and torch.equal(big[..., d:], before[..., d:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_pairs_kernel_is_bit_equal_to_the_strided_one(dtype):
    """The two in-place kernels compute the same fp32 math and rounding: bit-equal outputs, forward and inverse."""
    h, d, r = 4, 96, 32
    x = randn(T, h, d, seed=15, dtype=dtype, scale=3.0)
    cos, sin = cos_sin(r, seed=16)
    for inverse in (False, True):
        a = rope(x.clone(), cos, sin, inverse, inplace=True, block_r=8)
        b = rope(x.clone(), cos, sin, inverse, inplace=True, block_r=8, pairs=True)
        assert torch.equal(a, b)
