"""FP8 block and MXFP4 reference (de)quantisation: round trips, odd shapes, hand-built bytes."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_kernels.quant import (
    E2M1_VALUES,
    dequant_fp8_block,
    dequant_mxfp4,
    float_to_ue8m0,
    quant_fp8_block,
    quant_mxfp4,
    ue8m0_to_float,
)

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _expand(scale: torch.Tensor, n: int, k: int, block=(128, 128)) -> torch.Tensor:
    s = ue8m0_to_float(scale)
    return s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


# ---- FP8 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (5, 130), (1, 1)])
@pytest.mark.parametrize("scale_fmt", ["float32", "ue8m0"])
def test_fp8_block_round_trip(shape, scale_fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * 0.05
    q, s = quant_fp8_block(w, scale_fmt=scale_fmt)
    n, k = shape
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert tuple(s.shape) == (math.ceil(n / 128), math.ceil(k / 128))
    if scale_fmt == "ue8m0":
        assert s.dtype in (E8M0, torch.uint8)
    d = dequant_fp8_block(q, s)
    assert d.dtype == torch.float32 and d.shape == w.shape
    # e4m3: 3 mantissa bits -> relative half-ulp 2**-4; subnormals (< 2**-6 * s) have step 2**-9 * s.
    bound = w.abs() * 2.0**-4 + _expand(s, n, k) * 2.0**-10
    assert torch.all((d - w).abs() <= bound + 1e-12)
    # The same bytes viewed as uint8 dequantise identically.
    assert torch.equal(dequant_fp8_block(q.view(torch.uint8), s), d)


def test_fp8_zero_block_and_no_saturation():
    w = torch.zeros(130, 130)
    w[129, 129] = 1000.0  # one big value alone in the last (ragged) block
    q, s = quant_fp8_block(w)
    assert s[0, 0] == 1.0 and s[1, 1] == pytest.approx(1000.0 / 448)
    d = dequant_fp8_block(q, s)
    assert d[129, 129] == pytest.approx(1000.0, rel=1e-6)
    assert torch.count_nonzero(d) == 1


def test_fp8_dequant_hand_built_bytes():
    # e4m3 bytes: 0x38 = 1.0, 0x40 = 2.0, 0xB8 = -1.0, 0x01 = 2**-9 (smallest subnormal), 0x7E = 448.
    raw = torch.tensor([[0x38, 0x40], [0xB8, 0x01]], dtype=torch.uint8)
    d = dequant_fp8_block(raw, torch.tensor([[0.5]]))
    assert torch.equal(d, torch.tensor([[0.5, 1.0], [-0.5, 2.0**-10]]))
    # Block boundaries: a [2, 3] weight with 1x2 blocks -> scale grid [2, 2]; UE8M0 bytes 126..129.
    raw = torch.full((2, 3), 0x38, dtype=torch.uint8)
    ue = torch.tensor([[126, 127], [128, 129]], dtype=torch.uint8)
    want = torch.tensor([[0.5, 0.5, 1.0], [2.0, 2.0, 4.0]])
    assert torch.equal(dequant_fp8_block(raw, ue, block=(1, 2)), want)
    if E8M0 is not None:
        assert torch.equal(dequant_fp8_block(raw, ue.view(E8M0), block=(1, 2)), want)
    assert dequant_fp8_block(torch.tensor([[0x7E]], dtype=torch.uint8), torch.tensor([[1.0]])).item() == 448.0


def test_fp8_bad_scale_shape():
    q, s = quant_fp8_block(torch.randn(130, 10))
    with pytest.raises(ValueError, match="scale shape"):
        dequant_fp8_block(q, s[:1])


def test_ue8m0_codec():
    assert ue8m0_to_float(torch.tensor([127, 128, 120], dtype=torch.uint8)).tolist() == [1.0, 2.0, 2.0**-7]
    assert ue8m0_to_float(torch.tensor([0], dtype=torch.uint8)).item() == 2.0**-127
    assert math.isnan(ue8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())
    assert float_to_ue8m0(torch.tensor([1.0, 0.25, 3.0])).tolist() == [127, 125, 129]  # 3 rounds up to 4


# ---- MXFP4 ------------------------------------------------------------------------------------
def _nearest_grid_error(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Distance from each w to the closest representable value +-E2M1 * block scale."""
    grid = torch.tensor(E2M1_VALUES)
    grid = torch.cat([grid, -grid])
    n, k = w.shape
    scale = ue8m0_to_float(s).repeat_interleave(32, dim=1)
    return (w.unsqueeze(-1) - grid * scale.unsqueeze(-1)).abs().amin(dim=-1)


@pytest.mark.parametrize("shape", [(16, 96), (7, 32), (1, 256)])
def test_mxfp4_round_trip(shape):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * 0.05
    packed, s = quant_mxfp4(w)
    n, k = shape
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert tuple(s.shape) == (n, k // 32) and s.dtype in (E8M0, torch.uint8)
    d = dequant_mxfp4(packed, s)
    assert d.shape == w.shape and d.dtype == torch.float32
    # Every element lands on a nearest representable value of its block ...
    assert torch.all((d - w).abs() <= _nearest_grid_error(w, s) + 1e-7)
    # ... and the block scale never clips: error <= 1 grid unit <= amax / 3.
    amax = w.reshape(n, k // 32, 32).abs().amax(-1, keepdim=True)
    assert torch.all((d - w).reshape(n, k // 32, 32).abs() <= amax / 3 + 1e-7)
    # int8 storage (DeepSeek's release dtype) decodes the same.
    packed_i8, s2 = quant_mxfp4(w, packed_dtype=torch.int8)
    assert packed_i8.dtype == torch.int8 and torch.equal(dequant_mxfp4(packed_i8, s2), d)


def test_mxfp4_batched_leading_dims():
    w = torch.randn(3, 4, 64)
    packed, s = quant_mxfp4(w)
    assert packed.shape == (3, 4, 32) and s.shape == (3, 4, 2)
    d = dequant_mxfp4(packed, s)
    assert torch.equal(d[1], dequant_mxfp4(packed[1], s[1]))


def test_mxfp4_hand_built_bytes():
    # byte 0xF1: low nibble 0x1 -> +0.5 (element 0), high nibble 0xF -> -6 (element 1).
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0xF1
    packed[0, 1] = 0x7A  # low 0xA -> -1.0, high 0x7 -> +6
    one = torch.tensor([[127]], dtype=torch.uint8)
    d = dequant_mxfp4(packed, one)
    assert d[0, :4].tolist() == [0.5, -6.0, -1.0, 6.0] and torch.count_nonzero(d) == 4
    assert dequant_mxfp4(packed, torch.tensor([[129]], dtype=torch.uint8))[0, :2].tolist() == [2.0, -24.0]
    assert dequant_mxfp4(packed.view(torch.int8), one)[0, 1].item() == -6.0
    if E8M0 is not None:
        assert torch.equal(dequant_mxfp4(packed, one.view(E8M0)), d)
    # All 16 codes, both nibble positions: byte c | (c << 4) -> value(c), value(c).
    codes = torch.arange(16, dtype=torch.uint8)
    table = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
    d = dequant_mxfp4((codes | (codes << 4)).reshape(1, 16), one)
    assert d[0, 0::2].tolist() == list(table) and d[0, 1::2].tolist() == list(table)


def test_mxfp4_rounding_ties_to_smaller_magnitude():
    # amax 6 -> scale 1; midpoints round to the smaller magnitude, as the cache writers and Triton kernels do
    # (one codec: dsv4_kernels.quant_formats).
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.3, -0.0]
    w = torch.tensor(vals + [0.0] * (32 - len(vals))).reshape(1, 32)
    packed, s = quant_mxfp4(w)
    assert ue8m0_to_float(s).item() == 1.0
    d = dequant_mxfp4(packed, s)[0, : len(vals)]
    assert d.tolist() == [6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, -4.0, 0.5, 0.0]
    assert (packed[0, 4] & 0xF).item() == 0  # -0.25 rounds to +0 (no negative-zero code)


def test_mxfp4_shape_errors():
    with pytest.raises(ValueError, match="multiple"):
        quant_mxfp4(torch.randn(2, 48))
    packed, s = quant_mxfp4(torch.randn(2, 64))
    with pytest.raises(ValueError, match="scale shape"):
        dequant_mxfp4(packed, s[:, :1])
