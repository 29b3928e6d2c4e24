"""Triton step inputs (dsv4_kernels/triton_step_inputs.py) against the torch ops they replace: the embedding
gather expanded into hc residual streams, and dsv4_kernels.rope.rope_cos_sin of each RoPE at the positions.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (whose float -> bf16 casts truncate:
a narrowing cast is compared at bf16's tolerance). The `gpu` test runs V4-Flash's widths (hidden 4096, hc 4, the
main and compress RoPEs of 64 channels).
"""

import pytest
import torch

from dsv4_kernels.rope import rope_cos_sin, rope_inv_freq  # noqa: E402
from dsv4_kernels.triton_step_inputs import step_inputs  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

HC, VOCAB = 4, 97


def _ropes(half: int, device: str):
    """V4's two RoPEs: plain (theta 1e4) and YaRN (theta 16e4, factor 16 from 4096), attention factors 1 and 1.28."""
    main = rope_inv_freq(10000.0, 2 * half, 1.0, 4096, 32.0, 1.0)
    comp = rope_inv_freq(160000.0, 2 * half, 16.0, 4096, 32.0, 1.0)
    return torch.stack([main, comp]).float().to(device), torch.tensor([1.0, 1.2772588722239781], device=device)


def _check(t: int, d: int, table_dtype: torch.dtype, streams_dtype: torch.dtype, half: int, device: str) -> None:
    table = NUM.randn(VOCAB, d, dtype=table_dtype, device=device, seed=t + d)
    gen = torch.Generator().manual_seed(t)
    ids = torch.randint(0, VOCAB, (t,), generator=gen).to(device)
    # positions from 0 to past 1M: large angles are where an approximate cos / sin would drift
    positions = torch.cat([torch.tensor([0, 1 << 20]), torch.randint(0, 1 << 20, (t,), generator=gen)])[:t].to(device)
    inv, factors = _ropes(half, device)
    streams, cos_sin = step_inputs(table, ids, positions, HC, streams_dtype, inv, factors)
    assert streams.shape == (t, HC, d) and streams.dtype == streams_dtype
    assert cos_sin.shape == (2, 2, t, half) and cos_sin.dtype == torch.float32
    want = table.cpu()[ids.cpu()].to(streams_dtype).unsqueeze(1).expand(-1, HC, -1)
    if table_dtype.itemsize <= streams_dtype.itemsize:  # a widening (or no) cast: exact
        assert torch.equal(streams.cpu(), want)
    else:
        NUM.assert_close(streams.cpu(), want, streams_dtype)
    for r in range(2):
        cos, sin = rope_cos_sin(positions.cpu(), inv[r].cpu(), float(factors[r]))
        assert cos_sin[r, 0].is_contiguous()
        NUM.assert_close(cos_sin[r, 0].cpu(), cos, torch.float32)
        NUM.assert_close(cos_sin[r, 1].cpu(), sin, torch.float32)


@pytest.mark.parametrize(
    "table_dtype,streams_dtype",
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("t,d", [(1, 64), (3, 200), (64, 96)])
def test_step_inputs_match_reference(table_dtype, streams_dtype, t, d):
    """T = 1, 3, 64; D 200 is not a power of two (a masked tail block); the engine's case is a bf16 table into
    fp32 streams (its fp32 residual)."""
    _check(t, d, table_dtype, streams_dtype, 32, DEVICE)


def test_step_inputs_realistic_width():
    _check(3, 4096, torch.bfloat16, torch.float32, 32, DEVICE)


def test_step_inputs_empty_and_bad_shapes():
    table = NUM.randn(VOCAB, 64, device=DEVICE)
    inv, factors = _ropes(32, DEVICE)
    none = torch.zeros(0, dtype=torch.long, device=DEVICE)
    streams, cos_sin = step_inputs(table, none, none, HC, torch.float32, inv, factors)
    assert streams.shape == (0, HC, 64) and cos_sin.shape == (2, 2, 0, 32)
    with pytest.raises(ValueError, match="positions"):
        step_inputs(table, torch.zeros(2, dtype=torch.long, device=DEVICE), none, HC, torch.float32, inv, factors)
    with pytest.raises(ValueError, match="factors"):
        step_inputs(table, none, none, HC, torch.float32, inv, factors[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: compiled Triton (libdevice cos / sin)")
@pytest.mark.parametrize("t", [1, 3, 64])
def test_step_inputs_gpu_v4_flash_widths(t):
    _check(t, 4096, torch.bfloat16, torch.float32, 32, "cuda")
    _check(t, 4096, torch.bfloat16, torch.bfloat16, 32, "cuda")
