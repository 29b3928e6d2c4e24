"""Byte-exact cache layouts (dsv4_kernels/geometry.py) and their codecs (dsv4_kernels/quant_formats.py).

Capacity numbers for V4-Flash (43 layers: 2 SWA-only, then CSA(4) / HCA(128) alternating -> 21 CSA, 20 HCA),
computed by the module and pinned here:
- compressed + indexer cache per raw token, fp8_ds_mla + MXFP4: 21 * (584 + 68) / 4 + 20 * 584 / 128
  = 3423 + 91.25 = 3514.25 B = 3.43 KiB (the docs' "about 3.4 KB" is KiB); FP8 indexer instead: 3850.25 B;
  exact bf16 rows: 21 * (1024 + 256) / 4 + 20 * 1024 / 128 = 6880 B.
- SWA ring per layer per request: 128 * 584 = 74752 B = 73 KiB = 74.75 kB (the docs' "~75 KB" is kB);
  across 43 layers 3.21 MB; exact bf16: 128 * 1024 = 131072 B per layer.
- compressor state per request: ratio 4 8 * 8192 = 64 KiB, ratio 128 128 * 4096 = 512 KiB, indexer 8 * 2048
  = 16 KiB per CSA layer -> 21 * (64 + 16) + 20 * 512 KiB = 12206080 B = 11.64 MiB, ~3.8x the whole SWA.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import geometry as g
from dsv4_kernels import quant_formats as qf
from tests.support.configs import flash_config

SENTINEL = 0xAB


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def varied_rows(n: int, width: int, seed: int) -> torch.Tensor:
    """Random rows whose magnitudes span many binades, so scales differ per block."""
    spread = torch.exp2(randn(n, width // 32, seed=seed + 1, scale=4.0)).repeat_interleave(32, dim=1)
    return randn(n, width, seed=seed) * spread


# ---- sizes ----------------------------------------------------------------------------------------
def test_fp8_ds_mla_v4_sizes():
    layout = g.Fp8DsMlaLayout(head_dim=512, rope_dim=64)
    assert (layout.nope_dim, layout.num_scales) == (448, 7)
    assert layout.token_stride == 448 + 2 * 64 == 576
    assert layout.scale_stride == 7 + 1 == 8
    assert layout.row_bytes == 584
    assert layout.block_size == 64 and layout.block_bytes() == 64 * 584 == 37376
    assert layout.block_bytes(2) == 1168
    assert layout.value_offset(0) == 0 and layout.value_offset(5) == 5 * 576
    assert layout.scale_offset(0) == 64 * 576 and layout.scale_offset(5) == 64 * 576 + 5 * 8
    assert layout.rope_offset == 448


def test_indexer_row_sizes():
    mx = g.IndexerKeyLayout(128, "mxfp4")
    assert (mx.value_bytes, mx.scale_bytes, mx.row_bytes, mx.num_scales) == (64, 4, 68, 4)
    fp8 = g.IndexerKeyLayout(128, "fp8")
    assert (fp8.value_bytes, fp8.scale_bytes, fp8.row_bytes, fp8.num_scales) == (128, 4, 132, 1)
    assert fp8.scale_offset(3) == 64 * 128 + 3 * 4  # scales after all value rows of the block
    assert g.IndexerKeyLayout.from_row_bytes(68, "mxfp4") == mx
    assert g.IndexerKeyLayout.from_row_bytes(132, "fp8") == fp8
    assert g.IndexerKeyLayout(256, "fp8").scale_bytes == 8


def test_compressor_state_widths():
    c4 = g.CompressorStateLayout(4, 512, overlap=True)
    assert (c4.coff, c4.state_width, c4.row_floats, c4.row_bytes) == (2, 1024, 2048, 8192)
    assert c4.window_rows == 8 and c4.bytes_per_request == 65536
    assert (c4.kv_cols, c4.score_cols) == (slice(0, 1024), slice(1024, 2048))
    c128 = g.CompressorStateLayout(128, 512, overlap=False)
    assert (c128.coff, c128.state_width, c128.row_bytes, c128.window_rows) == (1, 512, 4096, 128)
    assert c128.bytes_per_request == 524288
    idx = g.CompressorStateLayout(4, 128, overlap=True)
    assert (idx.state_width, idx.row_bytes, idx.bytes_per_request) == (256, 2048, 16384)
    assert [c4.slot(p) for p in (0, 7, 8, 13)] == [0, 7, 0, 5]
    assert c128.slot(300) == 300 - 256


def test_compressor_state_live_positions():
    c4 = g.CompressorStateLayout(4, 512, overlap=True)
    assert c4.live_positions(3) == range(0, 3)
    assert c4.live_positions(8) == range(4, 8)  # window 1's first halves feed entry 2
    assert c4.live_positions(11) == range(4, 11)  # 4 + 3 rows, the doc's maximum
    assert max(len(c4.live_positions(n)) for n in range(64)) == 7
    c128 = g.CompressorStateLayout(128, 512, overlap=False)
    assert c128.live_positions(300) == range(256, 300)
    assert c128.live_positions(256) == range(256, 256)
    assert max(len(c128.live_positions(n)) for n in range(600)) == 127
    # Live rows never collide in the ring.
    for layout in (c4, c128):
        for n in range(300):
            slots = [layout.slot(p) for p in layout.live_positions(n)]
            assert len(set(slots)) == len(slots)


def test_swa_layout():
    swa = g.SwaLayout(window=128, head_dim=512, rope_dim=64)
    assert swa.row_bytes == 584 and swa.num_blocks == 2 and swa.bytes_per_request == 74752
    assert swa.slot(130) == 2 and swa.live_positions(200) == range(72, 200)
    exact = g.SwaLayout(128, 512, 64, fmt="exact", dtype=torch.bfloat16)
    assert exact.row_bytes == 1024 and exact.bytes_per_request == 131072
    assert g.SwaLayout(window=100, block_size=64).bytes_per_request == 2 * 64 * 584  # whole pages


def test_exact_layouts():
    kv = g.ExactRowLayout(512, torch.bfloat16)
    assert (kv.row_bytes, kv.scale_bytes, kv.block_bytes(4)) == (1024, 0, 4096)
    assert g.ExactRowLayout(128, torch.float32).row_bytes == 512


@pytest.mark.parametrize(
    "bad",
    [
        lambda: g.Fp8DsMlaLayout(512, 65),
        lambda: g.Fp8DsMlaLayout(500, 64),
        lambda: g.IndexerKeyLayout(100, "mxfp4"),
        lambda: g.IndexerKeyLayout(128, "nvfp4"),
        lambda: g.IndexerKeyLayout.from_row_bytes(70, "mxfp4"),
        lambda: g.SwaLayout(fmt="int8"),
        lambda: g.CompressorStateLayout(1, 512, False),
    ],
)
def test_invalid_layouts_raise(bad):
    with pytest.raises(ValueError):
        bad()


# ---- whole model -----------------------------------------------------------------------------------
def test_v4_flash_capacity_numbers():
    cfg = flash_config()
    assert len(cfg.layers_with_ratio(4)) == 21 and len(cfg.layers_with_ratio(128)) == 20
    per_token = g.cache_bytes_per_token(cfg)
    assert per_token == pytest.approx(21 * 652 / 4 + 20 * 584 / 128) == pytest.approx(3514.25)
    assert 3.35 < per_token / 1024 < 3.45  # "about 3.4 KB a token" (KiB)
    assert g.cache_bytes_per_token(cfg, indexer_format="fp8") == pytest.approx(3850.25)
    assert g.cache_bytes_per_token(cfg, kv_format="exact", indexer_format="exact") == pytest.approx(6880)
    assert g.swa_bytes_per_request(cfg, per_layer=True) == 74752  # "~75 KB per layer" (kB)
    assert g.swa_bytes_per_request(cfg) == 43 * 74752
    assert g.swa_bytes_per_request(cfg, kv_format="exact", per_layer=True) == 131072
    assert g.state_bytes_per_request(cfg) == 21 * (65536 + 16384) + 20 * 524288


def test_geometry_from_config():
    cfg = flash_config()
    geo = g.CacheGeometry.from_config(cfg)
    assert geo.num_layers == 43
    assert geo.compressed_layout(4).block_size == 64 and geo.compressed_layout(128).block_size == 2
    assert geo.indexer == g.IndexerKeyLayout(128, "mxfp4", 64)
    assert geo.state_layout(4).overlap and not geo.state_layout(128).overlap
    assert geo.indexer_state == g.CompressorStateLayout(4, 128, True)
    # Exact bytes for 1000 tokens: 250 entries on CSA layers, 7 on HCA layers.
    assert geo.compressed_bytes(1000) == 21 * 250 * 652 + 20 * 7 * 584
    assert geo.request_bytes(1000) == (
        geo.swa_bytes_per_request() + geo.state_bytes_per_request() + geo.compressed_bytes(1000)
    )
    exact = g.CacheGeometry.from_config(cfg, kv_format="exact", indexer_format="exact")
    assert exact.compressed_layout(4) == g.ExactRowLayout(512, torch.bfloat16, 64)
    assert exact.indexer == g.ExactRowLayout(128, torch.bfloat16, 64)
    swa_only = g.CacheGeometry.from_config(flash_config(num_hidden_layers=2, compress_ratios=[0, 0]))
    assert swa_only.indexer is None and swa_only.compressed_bytes_per_token() == 0


# ---- codecs ----------------------------------------------------------------------------------------
def test_e2m1_codec_matches_grid_and_ties_round_down():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 9.0, -0.1, -0.3, -6.0])
    want = torch.tensor([0.0, 0.0, 0.5, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, 0.0, -0.5, -6.0])
    nibbles = qf.e2m1_encode(x)
    assert torch.equal(qf.e2m1_decode(nibbles), want)
    assert nibbles[11] == 0  # -0.1 -> +0, no sign bit
    packed = qf.pack_nibbles(torch.tensor([0x1, 0xF, 0x7, 0x8], dtype=torch.uint8))
    assert packed.tolist() == [0xF1, 0x87]  # even element in the low nibble
    assert torch.equal(qf.unpack_nibbles(packed), torch.tensor([0x1, 0xF, 0x7, 0x8], dtype=torch.uint8))


def test_ue8m0_codec():
    e = torch.tensor([-20.0, -1.0, 0.0, 3.0])
    b = qf.ue8m0_encode(e)
    assert b.tolist() == [107, 126, 127, 130]
    assert torch.equal(qf.ue8m0_decode(b), torch.exp2(e))


def test_fp8_ds_mla_round_trip_within_bounds():
    layout = g.Fp8DsMlaLayout(512, 64)
    kv = varied_rows(37, 512, seed=1)
    rows = g.pack_fp8_ds_mla(kv, layout)
    assert rows.shape == (37, 584) and rows.dtype == torch.uint8
    out = g.unpack_fp8_ds_mla(rows, layout)
    ref = kv.to(torch.bfloat16).float()
    assert torch.equal(out[:, 448:], ref[:, 448:])  # RoPE tail is raw bf16
    blocks = ref[:, :448].reshape(37, 7, 64)
    exponent = rows[:, 576:583].float() - 127
    scale = torch.exp2(exponent)
    amax = blocks.abs().amax(-1)
    # The scale is the smallest power of two that fits the block into e4m3: amax / scale in (224, 448].
    assert torch.all(amax / scale <= 448) and torch.all(amax / scale > 224)
    assert torch.all(rows[:, 583] == 0)  # pad byte
    err = (out[:, :448].reshape(37, 7, 64) - blocks).abs()
    # e4m3: half an ulp is 2**-4 relative for normals; subnormal steps are 2**-9 of the scale.
    bound = blocks.abs() * 2.0**-4 + scale.unsqueeze(-1) * 2.0**-10
    assert torch.all(err <= bound)
    assert torch.equal(g.unpack_fp8_ds_mla(rows, layout, torch.bfloat16).float(), out)


def _nearest_e2m1(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(qf.E2M1_GRID)
    grid = torch.cat([grid, -grid]) * scale.unsqueeze(-1)
    return (x.unsqueeze(-1) - grid).abs().amin(-1)


def test_indexer_mxfp4_round_trip_is_nearest_grid_point():
    k = varied_rows(29, 128, seed=2)
    rows = g.pack_indexer_mxfp4(k)
    assert rows.shape == (29, 68)
    out = g.unpack_indexer_mxfp4(rows)
    blocks = k.reshape(29, 4, 32)
    scale = torch.exp2(rows[:, 64:].float() - 127)
    amax = blocks.abs().amax(-1)
    assert torch.all(amax / scale <= 6) and torch.all(amax / scale > 3)
    err = (out.reshape(29, 4, 32) - blocks).abs()
    best = _nearest_e2m1(blocks, scale.unsqueeze(-1))
    assert torch.allclose(err, best, rtol=0, atol=1e-6 * float(scale.max()))
    # Nibble order: element 0 is the low nibble of byte 0.
    first = qf.e2m1_decode(rows[:, 0] & 0xF) * scale[:, 0]
    assert torch.equal(first, out[:, 0])


def test_indexer_fp8_round_trip_within_bounds():
    k = randn(23, 256, seed=3, scale=5.0)
    rows = g.pack_indexer_fp8(k)
    assert rows.shape == (23, 256 + 8)
    scales = rows[:, 256:].contiguous().view(torch.float32)  # [23, 2] little-endian fp32
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two
    amax = k.reshape(23, 2, 128).abs().amax(-1)
    assert torch.all(amax / scales <= 448) and torch.all(amax / scales > 224)
    out = g.unpack_indexer_fp8(rows)
    bound = k.abs() * 2.0**-4 + scales.repeat_interleave(128, 1) * 2.0**-10
    assert torch.all((out - k).abs() <= bound)


def test_pack_rejects_bad_shapes():
    with pytest.raises(ValueError):
        g.pack_fp8_ds_mla(randn(2, 448, seed=4), g.Fp8DsMlaLayout())
    with pytest.raises(ValueError):
        g.pack_indexer_mxfp4(randn(2, 100, seed=4))
    with pytest.raises(ValueError):
        g.unpack_indexer_fp8(torch.zeros(2, 131, dtype=torch.uint8))


# ---- placement ---------------------------------------------------------------------------------------
LAYOUTS = [
    g.Fp8DsMlaLayout(512, 64, block_size=64),
    g.Fp8DsMlaLayout(512, 64, block_size=2),  # ratio-128 compressed pages
    g.IndexerKeyLayout(128, "mxfp4", 64),
    g.IndexerKeyLayout(128, "fp8", 16),
    g.ExactRowLayout(512, torch.bfloat16, 8),
]


def _width(layout) -> int:
    return getattr(layout, "head_dim", None) or getattr(layout, "index_head_dim", None) or layout.width


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{type(lay).__name__}-{lay.block_size}")
def test_write_one_row_touches_only_its_bytes(layout):
    num_blocks = 3
    cache = torch.full((num_blocks, layout.block_bytes()), SENTINEL, dtype=torch.uint8)
    row = g.pack_rows(layout, randn(1, _width(layout), seed=5))
    slot = layout.block_size + layout.block_size // 2  # middle of block 1
    g.write_rows(cache, layout, torch.tensor([slot]), row)
    block, pos = layout.locate(slot)
    expected = torch.full_like(cache, SENTINEL)
    v, s = layout.value_offset(pos), layout.scale_offset(pos)
    expected[block, v : v + layout.value_bytes] = row[0, : layout.value_bytes]
    expected[block, s : s + layout.scale_bytes] = row[0, layout.value_bytes :]
    assert torch.equal(cache, expected)
    assert torch.equal(g.read_rows(cache, layout, torch.tensor([slot, -1])), torch.cat([row, torch.zeros_like(row)]))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{type(lay).__name__}-{lay.block_size}")
def test_full_block_is_value_rows_then_scale_rows(layout):
    n = layout.block_size
    cache = torch.full((2, layout.block_bytes() + 16), SENTINEL, dtype=torch.uint8)  # padded pages
    x = randn(n, _width(layout), seed=6)
    rows = g.pack_rows(layout, x)
    g.write_rows(cache, layout, torch.arange(n, 2 * n), rows)  # fill block 1
    values_end = n * layout.value_bytes
    assert torch.equal(cache[1, :values_end].view(n, layout.value_bytes), rows[:, : layout.value_bytes])
    assert torch.equal(
        cache[1, values_end : layout.block_bytes()].view(n, layout.scale_bytes), rows[:, layout.value_bytes :]
    )
    assert torch.all(cache[1, layout.block_bytes() :] == SENTINEL) and torch.all(cache[0] == SENTINEL)
    back = g.unpack_rows(layout, g.read_rows(cache, layout, torch.arange(n, 2 * n)))
    assert torch.equal(back, g.unpack_rows(layout, rows))


def test_byte_offsets_and_slot_checks():
    layout = g.Fp8DsMlaLayout(512, 64, block_size=4)
    offsets = layout.row_byte_offsets(torch.tensor([5]))  # block 1, pos 1
    base = layout.block_bytes()
    assert offsets[0, 0] == base + 576 and offsets[0, 575] == base + 2 * 576 - 1
    assert offsets[0, 576] == base + 4 * 576 + 8 and offsets.shape == (1, 584)
    cache = torch.zeros(2, layout.block_bytes(), dtype=torch.uint8)
    with pytest.raises(ValueError):
        g.write_rows(cache, layout, torch.tensor([8]), torch.zeros(1, 584, dtype=torch.uint8))
    with pytest.raises(ValueError):
        g.read_rows(cache[:, :100], layout, torch.tensor([0]))
    with pytest.raises(TypeError):
        g.read_rows(cache.float(), layout, torch.tensor([0]))


def test_unpack_one_row_of_odd_sized_packed_rows():
    """A one-row slice of packed rows counts as contiguous with the packed row's stride and offset; unpacking it
    must not view those bytes as a wider dtype in place (a 195-byte fp8 row, the trained model's, failed on the GPU
    with "stride(0) must be divisible by 2")."""
    layout = g.Fp8DsMlaLayout(160, 32)  # 128 e4m3 + 64 rope bytes + 2 scales + pad = 195 bytes
    assert layout.row_bytes % 2 == 1
    rows = g.pack_fp8_ds_mla(torch.randn(5, 160), layout)
    whole = g.unpack_fp8_ds_mla(rows, layout)
    for i in range(5):
        assert torch.equal(g.unpack_fp8_ds_mla(rows[i : i + 1], layout), whole[i : i + 1])
    keys = g.pack_indexer_fp8(torch.randn(3, 128))
    padded = torch.cat([torch.zeros(3, 1, dtype=torch.uint8), keys], dim=1)[:, 1:]  # rows at odd offsets
    for i in range(3):
        assert torch.equal(g.unpack_indexer_fp8(padded[i : i + 1]), g.unpack_indexer_fp8(keys)[i : i + 1])
