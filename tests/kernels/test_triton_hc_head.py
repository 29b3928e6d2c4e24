"""Triton hc_head + final RMSNorm (dsv4_kernels/triton_hc_head.py) against the torch expression it replaces:
rms_norm(dsv4_kernels.mhc.hc_head(streams[rows], ...), norm_weight).to(out_dtype).

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (whose float -> bf16 casts truncate:
16-bit outputs are compared at the dtype's tolerance). The `gpu` test runs V4-Flash's widths (hidden 4096, hc 4).
"""

import pytest
import torch

from dsv4_kernels.mhc import hc_head  # noqa: E402
from dsv4_kernels.norm import rms_norm  # noqa: E402
from dsv4_kernels.triton_hc_head import hc_head_norm  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

HC, HC_EPS, NORM_EPS, OUT_EPS = 4, 1e-6, 1e-6, 1e-6


def _inputs(t: int, d: int, dtype: torch.dtype, seed: int, device: str = DEVICE):
    """Fresh random streams and head weights; fn scaled so the pre logits sit in sigmoid's live range."""
    streams = NUM.randn(t, HC, d, dtype=dtype, device=device, seed=seed, scale=2.0)
    fn = NUM.randn(HC, HC * d, device=device, seed=seed + 1, scale=(HC * d) ** -0.5 * 3.0)
    base = NUM.randn(HC, device=device, seed=seed + 2)
    scale = NUM.randn(1, device=device, seed=seed + 3).abs() + 0.5
    weight = 1.0 + NUM.randn(d, device=device, seed=seed + 4, scale=0.2)
    return streams, fn, base, scale, weight


def _reference(streams, fn, base, scale, weight, rows, out_dtype):
    taken = streams if rows is None else streams[rows]
    collapsed = hc_head(taken.cpu(), fn.cpu(), base.cpu(), scale.cpu(), HC_EPS, NORM_EPS)
    return rms_norm(collapsed, weight.cpu(), OUT_EPS).to(out_dtype)


def _check(t: int, d: int, dtype: torch.dtype, out_dtype: torch.dtype, rows: list[int] | None, device: str):
    streams, fn, base, scale, weight = _inputs(t, d, dtype, seed=t * 7 + d, device=device)
    row_ids = None if rows is None else torch.tensor(rows, dtype=torch.long, device=device)
    out = hc_head_norm(streams, fn, base, scale, HC_EPS, NORM_EPS, weight, OUT_EPS, out_dtype, row_ids)
    n = t if rows is None else len(rows)
    assert out.shape == (n, d) and out.dtype == out_dtype
    want = _reference(streams, fn, base, scale, weight, row_ids.cpu() if rows is not None else None, out_dtype)
    # one tolerance for the coarsest rounding on the way (the streams' dtype, then out_dtype)
    coarse = torch.bfloat16 if torch.bfloat16 in (dtype, out_dtype) else torch.float32
    NUM.assert_close(out.cpu(), want, coarse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,d,rows",
    [(1, 64, None), (3, 200, None), (3, 96, [2, 0]), (64, 128, None), (64, 64, list(range(63, -1, -5)))],
)
def test_hc_head_norm_matches_reference(dtype, out_dtype, t, d, rows):
    """T = 1, 3, 64, narrow rows (the interpreter's speed), with and without the logit-row gather (rows out of
    order, repeated strides): D not a power of two (200) masks the tail of each pass."""
    _check(t, d, dtype, out_dtype, rows, DEVICE)


def test_hc_head_norm_realistic_width():
    """V4-Flash's hidden 4096 (hc 4: 16K-long mixing dots split over many programs), one decode token."""
    _check(1, 4096, torch.float32, torch.bfloat16, [0], DEVICE)


def test_hc_head_norm_empty_and_bad_shapes():
    streams, fn, base, scale, weight = _inputs(2, 64, torch.float32, seed=3)
    none = torch.zeros(0, dtype=torch.long, device=DEVICE)
    assert hc_head_norm(streams, fn, base, scale, HC_EPS, NORM_EPS, weight, OUT_EPS, torch.bfloat16, none).shape == (
        0,
        64,
    )
    with pytest.raises(ValueError, match="fn"):
        hc_head_norm(streams, fn[:, :64], base, scale, HC_EPS, NORM_EPS, weight, OUT_EPS, torch.float32)
    with pytest.raises(ValueError, match="norm_weight"):
        hc_head_norm(streams, fn, base, scale, HC_EPS, NORM_EPS, weight[:32], OUT_EPS, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: compiled Triton at V4-Flash widths")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,rows", [(1, None), (1, [0]), (3, [2, 0, 1]), (64, None), (64, list(range(0, 64, 9)))])
def test_hc_head_norm_gpu_v4_flash_widths(dtype, t, rows):
    """Compiled kernels at hidden 4096, hc 4 (the engine's fp32 residual and the bf16 one) into the bf16 head input."""
    _check(t, 4096, dtype, torch.bfloat16, rows, "cuda")
