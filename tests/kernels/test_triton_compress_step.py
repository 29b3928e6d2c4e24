"""Triton compressor step (dsv4_kernels/triton_compress_step.py) against the engine's reference chain.

close_windows: slots gathered from [state ring | chunk] rows (SourceRows.row), overlap_slots, pool_windows, rms_norm,
apply_rope at the window start -> the entry rows (exact: values; quantised: the bytes the quantised-entry writer
dsv4_kernels.triton_compressor.pool_norm_rope_quant stores for the same slots, byte for byte). save_state
(dsv4_kernels/triton_state_save.py): RingWrite
of dsv4_kernels.compressor.state_rows. Runs compiled on a GPU when one is present, else in triton's CPU interpreter.
"""

import pytest
import torch

from dsv4_kernels.compressor import overlap_slots, pool_windows, state_rows  # noqa: E402
from dsv4_kernels.norm import rms_norm  # noqa: E402
from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from dsv4_kernels.triton_compress_step import close_windows, entry_rope_table  # noqa: E402
from dsv4_kernels.triton_compressor import pool_norm_rope_quant  # noqa: E402
from dsv4_kernels.triton_state_save import save_state  # noqa: E402
from engine.model.cache import fp8_ds_mla_codec, indexer_codec  # noqa: E402
from tests.support.cache_kernel_checks import assert_close, sentinel_cache  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

EPS, T, R = 1e-6, 7, 12


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def randint(hi, shape, seed):
    return torch.randint(0, hi, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def inputs(d, ratio, overlap, dtype, n, seed):
    """A state ring, this step's projections and the slot rows of n entries (some windows without a previous)."""
    w = 2 * d if overlap else d
    kv, gate = randn(T, w, seed=seed, dtype=dtype, scale=2.0), randn(T, w, seed=seed + 1, dtype=dtype, scale=2.0)
    ape = randn(ratio, w, seed=seed + 2)
    positions = randint(4000, (T,), seed + 3)
    state = randn(R, 2 * w, seed=seed + 4, scale=2.0)
    state[:, :w] = state[:, :w].to(dtype).float()  # ring kv rows hold model-dtype values
    cur = randint(R + T, (n, ratio), seed + 5)
    prev = randint(R + T, (n, ratio), seed + 6) if overlap else None
    prev_valid = (randint(3, (n, ratio), seed + 7) > 0) if overlap else None
    if overlap:
        prev_valid[0] = False
    weight = randn(d, seed=seed + 8, scale=0.3) + 1.0
    entry_pos = randint(4000 // ratio, (n,), seed + 9) * ratio
    return kv, gate, ape, positions, state, cur, prev, prev_valid, weight, entry_pos


def reference_slots(kv, gate, ape, positions, state, cur, prev, prev_valid, dtype):
    src = torch.cat([state, state_rows(kv, gate, ape, positions)])
    w = kv.shape[1]
    c = src[cur]
    if prev is None:
        return c[..., :w].to(dtype), c[..., w:]
    p = src[prev]
    pkv, psc = overlap_slots(p[..., :w], p[..., w:], c[..., :w], c[..., w:], prev_valid[:, 0])
    return pkv.to(dtype), psc


def tables(rope, ratio):
    inv = rope_inv_freq(160000.0, rope)
    return entry_rope_table(lambda p: rope_cos_sin(p, inv.to(p.device)), 4096, ratio, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, rope, ratio, overlap", [(48, 16, 4, True), (40, 8, 16, False)])
def test_exact_entries(dtype, d, rope, ratio, overlap):
    n = 6
    kv, gate, ape, positions, state, cur, prev, pv, weight, epos = inputs(d, ratio, overlap, dtype, n, seed=d)
    cos_t, sin_t = tables(rope, ratio)
    rows = torch.tensor([5, -1, 0, 9, 2, 11], device=DEVICE)
    cache = torch.full((12, d), 7.0, dtype=dtype, device=DEVICE)
    close_windows(state, kv, gate, ape, positions, cur, prev, pv, weight, EPS, cos_t, sin_t, epos, rows, cache)
    skv, ssc = reference_slots(kv, gate, ape, positions, state, cur, prev, pv, dtype)
    cos, sin = rope_cos_sin(epos.cpu(), rope_inv_freq(160000.0, rope))
    expected = apply_rope(rms_norm(pool_windows(skv, ssc), weight, EPS), cos.to(DEVICE), sin.to(DEVICE))
    valid = rows >= 0
    assert_close(cache[rows[valid]], expected[valid], dtype)
    untouched = torch.ones(12, dtype=torch.bool, device=DEVICE)
    untouched[rows[valid]] = False
    assert bool((cache[untouched] == 7.0).all())


def test_skip_row_is_left_alone_and_the_rest_unchanged():
    """skip_row (a decode plan's scratch row for rows whose window stays open) is never written; every other
    row gets the bytes of a call without skip_row."""
    d, rope, ratio = 40, 8, 16
    kv, gate, ape, positions, state, cur, prev, pv, weight, epos = inputs(d, ratio, False, torch.bfloat16, 6, seed=77)
    cos_t, sin_t = tables(rope, ratio)
    rows = torch.tensor([5, 0, 3, 0, 2, 11], device=DEVICE)  # row 0 plays the scratch row, named twice
    plain = torch.full((12, d), 7.0, dtype=torch.bfloat16, device=DEVICE)
    skipped = plain.clone()
    close_windows(state, kv, gate, ape, positions, cur, prev, pv, weight, EPS, cos_t, sin_t, epos, rows, plain)
    close_windows(
        state, kv, gate, ape, positions, cur, prev, pv, weight, EPS, cos_t, sin_t, epos, rows, skipped, skip_row=0
    )
    assert bool((skipped[0] == 7.0).all()) and not bool((plain[0] == 7.0).all())
    assert torch.equal(skipped[1:], plain[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["fp8_ds_mla", "mxfp4", "fp8"])
def test_quantised_entries_match_the_slot_writer(dtype, kind):
    """Same bytes as pool_norm_rope_quant over the reference's gathered slots (the kernel the engine used)."""
    d, rope, n = (112, 32, 5) if kind == "fp8_ds_mla" else (64, 16, 5)
    codec = fp8_ds_mla_codec(d, rope, 4) if kind == "fp8_ds_mla" else indexer_codec(d, kind, 4)
    kv, gate, ape, positions, state, cur, prev, pv, weight, epos = inputs(d, 4, True, dtype, n, seed=3)
    cos_t, sin_t = tables(rope, 4)
    rows = torch.tensor([9, -1, 0, 3, 6], device=DEVICE)
    shape = (12, codec.layout.row_bytes)
    got, want = sentinel_cache(shape, DEVICE), sentinel_cache(shape, DEVICE)
    close_windows(
        state, kv, gate, ape, positions, cur, prev, pv, weight, EPS, cos_t, sin_t, epos, rows, got, codec.layout
    )
    skv, ssc = reference_slots(kv, gate, ape, positions, state, cur, prev, pv, dtype)
    k = epos // 4
    pool_norm_rope_quant(
        skv.contiguous(), ssc.contiguous(), weight, EPS, cos_t[k], sin_t[k], want, rows, codec.layout, hadamard=False
    )
    assert torch.equal(got, want)


def test_table_equals_per_step_cos_sin():
    cos_t, sin_t = tables(16, 4)
    pos = torch.tensor([0, 4, 400, 4092])
    cos, sin = rope_cos_sin(pos, rope_inv_freq(160000.0, 16))
    torch.testing.assert_close(cos_t[pos // 4].cpu(), cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin_t[pos // 4].cpu(), sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_state_pairs(dtype):
    w, ratio = 40, 4
    kv, gate = randn(T, w, seed=10, dtype=dtype), randn(T, w, seed=11, dtype=dtype)
    ape = randn(ratio, w, seed=12)
    positions = randint(1000, (T,), 13)
    chunk = torch.tensor([6, 0, 3, 2], device=DEVICE)
    ring = torch.tensor([3, 8, -1, 0], device=DEVICE)
    big = torch.full((10, 2 * w + 8), 123.0, device=DEVICE)
    save_state(kv, gate, ape, positions, big[:, : 2 * w], chunk, ring)
    expected = torch.full_like(big, 123.0)
    ok = ring >= 0
    expected[ring[ok], : 2 * w] = state_rows(kv, gate, ape, positions)[chunk[ok]]
    assert torch.equal(big, expected)


def test_bad_inputs_raise():
    kv, gate, ape, positions, state, cur, prev, pv, weight, epos = inputs(48, 4, True, torch.float32, 3, seed=1)
    cos_t, sin_t = tables(16, 4)
    rows = torch.zeros(3, dtype=torch.long, device=DEVICE)
    cache = torch.zeros(4, 48, device=DEVICE)
    with pytest.raises(ValueError, match="kv / gate"):
        close_windows(state, kv, gate, ape, positions, cur, None, None, weight, EPS, cos_t, sin_t, epos, rows, cache)
    with pytest.raises(ValueError, match="state"):
        close_windows(
            state.double(), kv, gate, ape, positions, cur, prev, pv, weight, EPS, cos_t, sin_t, epos, rows, cache
        )
    with pytest.raises(ValueError, match="entry_rows"):
        close_windows(state, kv, gate, ape, positions, cur, prev, pv, weight, EPS, cos_t, sin_t, epos, rows[:2], cache)
    with pytest.raises(ValueError, match="chunk_rows"):
        save_state(kv, gate, ape, positions, state, rows, rows[:2])
