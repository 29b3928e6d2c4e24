"""Triton compressor cache writer (dsv4_kernels/triton_compressor.py: pool_norm_rope_quant).

pool_norm_rope_quant against pool_windows + rms_norm + apply_rope (+ dsv4_kernels.hadamard for indexer keys) and the
engine's row codecs (geometry pack, zero padding). The state ring's kernel is tested in
tests/kernels/test_triton_compress_step.py. Runs compiled on a GPU when one is present, else in triton's CPU interpreter.
"""

import pytest
import torch

from dsv4_kernels import geometry as g  # noqa: E402
from dsv4_kernels.compressor import overlap_slots, pool_windows  # noqa: E402
from dsv4_kernels.hadamard import hadamard  # noqa: E402
from dsv4_kernels.norm import rms_norm  # noqa: E402
from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from dsv4_kernels.triton_compressor import pool_norm_rope_quant  # noqa: E402
from engine.model.cache import fp8_ds_mla_codec, indexer_codec  # noqa: E402
from tests.support.cache_kernel_checks import assert_bytes_near, assert_close, expected_cache, sentinel_cache  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

N, EPS, BLOCK = 6, 1e-6, 4  # 4-row blocks: entries land in several blocks


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def slots(d, dtype, seed):
    """Ratio-4 overlap slots [N, 8, d]; entry 0 has no previous window (its first 4 scores are -inf)."""
    kv_prev, kv_cur = randn(N, 4, 2 * d, seed=seed, scale=2.0), randn(N, 4, 2 * d, seed=seed + 1, scale=2.0)
    sc_prev, sc_cur = randn(N, 4, 2 * d, seed=seed + 2, scale=2.0), randn(N, 4, 2 * d, seed=seed + 3, scale=2.0)
    prev_valid = torch.ones(N, dtype=torch.bool, device=DEVICE)
    prev_valid[0] = False
    kv, score = overlap_slots(kv_prev, sc_prev, kv_cur, sc_cur, prev_valid)
    weight = randn(d, seed=seed + 4, scale=0.3) + 1.0
    return kv.to(dtype), score, weight


def cos_sin(rope, seed):
    positions = torch.randint(0, 4096, (N,), generator=torch.Generator().manual_seed(seed)) * 4
    cos, sin = rope_cos_sin(positions, rope_inv_freq(160000.0, rope))
    return cos.to(DEVICE), sin.to(DEVICE)


ROWS = [9, -1, 0, 3, 4, 11]  # three blocks of 4, one skipped entry


def check_entry_cache(codec, kv, score, weight, cos, sin, expected_values, dtype, engine_view, rotate=None):
    layout = codec.layout
    rows = torch.tensor(ROWS, dtype=torch.int64, device=DEVICE)
    shape = (3 * layout.block_size, layout.row_bytes) if engine_view else (3, layout.block_bytes() + 8)
    cache = sentinel_cache(shape, DEVICE)
    out = pool_norm_rope_quant(kv, score, weight, EPS, cos, sin, cache, rows, layout, hadamard=rotate)
    assert out.dtype == dtype and out.shape == expected_values.shape
    assert_close(out, expected_values, dtype)
    assert torch.equal(cache, expected_cache(shape, layout, rows, codec.encode(out), DEVICE))
    blocks = cache.view(-1, layout.block_bytes()) if engine_view else cache
    valid = rows >= 0
    assert_bytes_near(layout, g.read_rows(blocks, layout, rows[valid]), codec.encode(expected_values)[valid])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, rope", [(192, 64), (112, 32)])  # NoPE 128; NoPE 80 zero-padded to 128
@pytest.mark.parametrize("engine_view", [False, True])
def test_fp8_ds_mla_entries(dtype, d, rope, engine_view):
    kv, score, weight = slots(d, dtype, seed=d)
    cos, sin = cos_sin(rope, seed=d + 1)
    expected = apply_rope(rms_norm(pool_windows(kv, score), weight, EPS), cos, sin)
    check_entry_cache(fp8_ds_mla_codec(d, rope, BLOCK), kv, score, weight, cos, sin, expected, dtype, engine_view)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, d, rope", [("mxfp4", 64, 16), ("mxfp4", 16, 8), ("fp8", 128, 32), ("fp8", 64, 16)])
@pytest.mark.parametrize("rotate", [None, False])  # None: V4's rotated keys
def test_indexer_key_entries(dtype, fmt, d, rope, rotate):
    kv, score, weight = slots(d, dtype, seed=d + 7)
    cos, sin = cos_sin(rope, seed=d + 8)
    expected = apply_rope(rms_norm(pool_windows(kv, score), weight, EPS), cos, sin)
    if rotate is None:
        expected = hadamard(expected)
    codec = indexer_codec(d, fmt, BLOCK)  # zero-pads 16 -> 32 (mxfp4) and 64 -> 128 (fp8)
    check_entry_cache(codec, kv, score, weight, cos, sin, expected, dtype, engine_view=fmt == "fp8", rotate=rotate)


def test_quant_bad_inputs_raise():
    kv, score, weight = slots(64, torch.float32, seed=1)
    cos, sin = cos_sin(16, seed=2)
    rows = torch.zeros(N, dtype=torch.int64, device=DEVICE)
    layout = g.IndexerKeyLayout(64, "mxfp4", BLOCK)
    cache = sentinel_cache((2, layout.block_bytes()), DEVICE)
    with pytest.raises(ValueError, match="Hadamard"):
        pool_norm_rope_quant(
            kv, score, weight, EPS, cos, sin, cache, rows, g.Fp8DsMlaLayout(128, 64, BLOCK), hadamard=True
        )
    with pytest.raises(ValueError, match="rows"):
        pool_norm_rope_quant(kv, score, weight, EPS, cos, sin, cache, rows[:2], layout)
    with pytest.raises(ValueError, match="cache"):
        pool_norm_rope_quant(kv, score, weight, EPS, cos, sin, cache[:, :10], rows, layout)
    with pytest.raises(ValueError, match="index_head_dim"):
        pool_norm_rope_quant(kv, score, weight, EPS, cos, sin, cache, rows, g.IndexerKeyLayout(32, "mxfp4", BLOCK))
