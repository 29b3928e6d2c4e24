"""Triton fused SWA insert (dsv4_kernels/triton_swa_insert.py) against norm + rope + geometry's fp8_ds_mla pack.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (set before any
dsv4_kernels.triton_* import, because triton reads the flag when a kernel is decorated).
"""

import pytest
import torch

from dsv4_kernels import geometry as g  # noqa: E402
from dsv4_kernels.norm import rms_norm  # noqa: E402
from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from dsv4_kernels.triton_swa_insert import swa_insert  # noqa: E402
from engine.model.cache import fp8_ds_mla_codec  # noqa: E402
from tests.support.cache_kernel_checks import assert_bytes_near, assert_close, expected_cache, sentinel_cache  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

T, EPS = 7, 1e-6


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def inputs(d, rope, dtype, seed):
    kv = randn(T, d, seed=seed, dtype=dtype, scale=2.0)
    weight = randn(d, seed=seed + 1, scale=0.3) + 1.0  # fp32, as V4 keeps norm weights
    positions = torch.randint(0, 5000, (T,), generator=torch.Generator().manual_seed(seed + 2))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(10000.0, rope))
    rows = torch.tensor([5, 70, -1, 0, 127, -1, 64], dtype=torch.int32, device=DEVICE)  # two blocks of 64
    return kv, weight, cos.to(DEVICE), sin.to(DEVICE), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, rope", [(192, 64), (112, 32)])  # NoPE 128: two quant blocks; 80: padded to 128
@pytest.mark.parametrize("engine_view", [False, True])
def test_fp8_insert_matches_pack_and_keeps_sentinels(dtype, d, rope, engine_view):
    kv, weight, cos, sin, rows = inputs(d, rope, dtype, seed=d + rope)
    codec = fp8_ds_mla_codec(d, rope, g.SWA_BLOCK_ROWS)  # the engine's codec: zero-pads NoPE to 64s
    layout = codec.layout
    shape = (2 * layout.block_size, layout.row_bytes) if engine_view else (2, layout.block_bytes() + 16)
    cache = sentinel_cache(shape, DEVICE)
    out = swa_insert(kv, weight, cos, sin, EPS, cache, rows, layout)

    expected = apply_rope(rms_norm(kv, weight, EPS), cos, sin)
    assert out.dtype == dtype and out.shape == (T, d)
    assert_close(out, expected, dtype)
    # Byte-exact: the cache holds exactly the engine's encoding of the returned rows; nothing else changed.
    assert torch.equal(cache, expected_cache(shape, layout, rows, codec.encode(out), DEVICE))
    # Against the reference values: decoded within one quantisation step.
    blocks = cache.view(-1, layout.block_bytes()) if engine_view else cache
    valid = rows >= 0
    assert_bytes_near(layout, g.read_rows(blocks, layout, rows[valid]), codec.encode(expected)[valid])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_insert_writes_rows_only(dtype):
    d, rope = 96, 32
    kv, weight, cos, sin, rows = inputs(d, rope, dtype, seed=3)
    cache = torch.full((130, d), 7.0, dtype=dtype, device=DEVICE)
    out = torch.empty(T, d, dtype=dtype, device=DEVICE)
    ret = swa_insert(kv, weight, cos, sin, EPS, cache, rows.long(), out=out)
    assert ret is out
    assert_close(out, apply_rope(rms_norm(kv, weight, EPS), cos, sin), dtype)
    expected = torch.full_like(cache, 7.0)
    valid = rows >= 0
    expected[rows[valid].long()] = out[valid]
    assert torch.equal(cache, expected)


def test_v4_row_shape_and_all_skipped():
    d, rope = 512, 64
    kv, weight, cos, sin, _ = inputs(d, rope, torch.bfloat16, seed=4)
    layout = g.Fp8DsMlaLayout(d, rope)
    cache = sentinel_cache((1, layout.block_bytes()), DEVICE)
    rows = torch.full((T,), -1, dtype=torch.int64, device=DEVICE)
    swa_insert(kv, weight, cos, sin, EPS, cache, rows, layout)
    assert bool((cache == 0xA5).all())
    rows[3] = 9
    out = swa_insert(kv, weight, cos, sin, EPS, cache, rows, layout)
    assert torch.equal(g.read_rows(cache, layout, rows[3:4]), g.pack_fp8_ds_mla(out[3:4], layout))
    assert layout.row_bytes == 584


def test_bad_inputs_raise():
    kv, weight, cos, sin, rows = inputs(192, 64, torch.float32, seed=5)
    layout = g.Fp8DsMlaLayout(192, 64)
    cache = sentinel_cache((1, layout.block_bytes()), DEVICE)
    with pytest.raises(ValueError, match="rows"):
        swa_insert(kv, weight, cos, sin, EPS, cache, rows[:3], layout)
    with pytest.raises(ValueError, match="layout"):
        swa_insert(kv, weight, cos, sin, EPS, cache, rows, g.Fp8DsMlaLayout(256, 64))
    with pytest.raises(ValueError, match="cache"):
        swa_insert(kv, weight, cos, sin, EPS, cache[:, :100], rows, layout)
    with pytest.raises(ValueError, match="exact SWA cache"):
        swa_insert(kv, weight, cos, sin, EPS, torch.zeros(8, 192, dtype=torch.bfloat16, device=DEVICE), rows)
