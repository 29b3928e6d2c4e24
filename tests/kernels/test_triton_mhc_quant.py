"""Triton mHC pre with the block input's norm and its 1x128 FP8 quantisation (dsv4_kernels.triton_mhc.hc_pre_quant)
against the plain-torch chain it replaces: dsv4_kernels.mhc.hc_pre, rms_norm(collapsed, w).to(out_dtype), then
dsv4_kernels.fp8_linear.quant_act_1x128 of that input.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter. The `gpu` test runs V4-Flash's
widths (hidden 4096, hc 4).
"""

import pytest
import torch

from dsv4_kernels import fp8_linear, triton_mhc, triton_mhc_mix  # noqa: E402
from dsv4_kernels import mhc as ref  # noqa: E402
from dsv4_kernels.norm import rms_norm  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

HC, ITERS, EPS, OUT_EPS = 4, 20, 1e-6, 1e-5


def _inputs(t: int, d: int, dtype: torch.dtype, seed: int, device: str):
    n_mix = (2 + HC) * HC
    streams = NUM.randn(t, HC, d, dtype=dtype, device=device, seed=seed, scale=2.0)
    fn = NUM.randn(n_mix, HC * d, device=device, seed=seed + 1, scale=(HC * d) ** -0.5)
    base = NUM.randn(n_mix, device=device, seed=seed + 2, scale=0.5)
    scale = torch.tensor([0.7, 1.3, 2.0], device=device)
    weight = 1.0 + NUM.randn(d, device=device, seed=seed + 3, scale=0.3)
    return streams, fn, base, scale, weight


def _check(t: int, d: int, dtype: torch.dtype, pow2: bool, device: str) -> None:
    streams, fn, base, scale, weight = _inputs(t, d, dtype, seed=t * 13 + d, device=device)
    args = (streams, fn, base, scale, ITERS, EPS, EPS)
    normed, q, s, post, comb = triton_mhc.hc_pre_quant(
        *args, norm_weight=weight, out_eps=OUT_EPS, out_dtype=torch.bfloat16, pow2=pow2
    )
    ref_collapsed, ref_post, ref_comb = ref.hc_pre(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    want = rms_norm(ref_collapsed, weight.cpu(), OUT_EPS).to(torch.bfloat16)
    assert normed.dtype == torch.bfloat16 and normed.shape == (t, d) and q.dtype == torch.float8_e4m3fn
    NUM.assert_close(post.cpu(), ref_post, torch.float32)
    NUM.assert_close(comb.cpu(), ref_comb, torch.float32)
    NUM.assert_close(normed.cpu(), want, torch.bfloat16)
    # the codes and scales are the plain quantiser's on the returned rows, bit for bit (what the projection took
    # before: its own quantiser launch on the block input)
    oq, os_ = fp8_linear.quant_act_1x128(normed.cpu(), pow2)
    assert torch.equal(s.cpu(), os_) and torch.equal(q.cpu().view(torch.uint8), oq.view(torch.uint8))
    # and the input is the one hc_pre's own fused norm gives (the path it replaces)
    old, _, _ = triton_mhc.hc_pre(*args, norm_weight=weight, out_eps=OUT_EPS, out_dtype=torch.bfloat16)
    NUM.assert_close(normed.cpu(), old.cpu(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("t,d", [(1, 256), (3, 80), (64, 128)])
def test_hc_pre_quant_matches_reference(dtype, pow2, t, d):
    """Split-kernel steps (decode sizes): the input norm and the quantisation are one launch."""
    _check(t, d, dtype, pow2, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_quant_long_steps(monkeypatch, dtype):
    """Above the split limit (prefill chunks) hc_pre's own fused norm, then the quantiser: the same results."""
    monkeypatch.setattr(triton_mhc_mix, "MIX_MAX_TOKENS", 2)
    monkeypatch.setattr(triton_mhc_mix, "MIX_MAX_TOKENS_BF16", 2)
    _check(3, 80, dtype, True, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: compiled Triton at V4-Flash widths")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 64])
def test_hc_pre_quant_gpu_v4_flash_widths(dtype, t):
    _check(t, 4096, dtype, True, "cuda")
