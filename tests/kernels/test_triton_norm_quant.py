"""Triton RMSNorm + 1x128 FP8 quantisation (dsv4_kernels/triton_norm_quant.py) against
dsv4_kernels.norm.rms_norm followed by dsv4_kernels.fp8_linear.quant_act_1x128. Compiled on a GPU, else in triton's CPU interpreter."""

import pytest
import torch

from dsv4_kernels import fp8_linear  # noqa: E402
from dsv4_kernels.norm import rms_norm  # noqa: E402
from dsv4_kernels.triton_norm_quant import rms_norm_quant  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("m,k", [(3, 256), (1, 1024), (4, 200)])
def test_rms_norm_quant_matches_reference(dtype, pow2, m, k):
    """Normed rows within the dtype's tolerance of rms_norm's; codes and scales bit for bit the plain quantiser's
    on those rows (a 16-bit row may round one value an ulp apart from torch's, so not on torch's rows)."""
    x = NUM.randn(m, k, dtype=dtype, device=DEVICE, seed=m * k, scale=3.0)
    w = (1.0 + NUM.randn(k, seed=k, scale=0.2)).to(DEVICE)
    y, q, s = rms_norm_quant(x, w, 1e-6, pow2)
    want = rms_norm(x.cpu(), w.cpu(), 1e-6)
    assert y.dtype == dtype and q.dtype == torch.float8_e4m3fn and s.stride(0) == 1
    NUM.assert_close(y.cpu(), want, dtype)
    # Dequantised codes approximate the reference rows to e4m3 precision (a power-of-two scale may sit one
    # binade apart from the reference's when a block's amax lands on a boundary: hence the factor 2).
    back = fp8_linear.dequant_act(q.cpu(), s.cpu())
    torch.testing.assert_close(back, want.float(), atol=2 * s.max().item() * 2**-6, rtol=2**-3)
    # the codes are the plain quantiser's on the kernel's own normed rows, bit for bit
    oq, os_ = fp8_linear.quant_act_1x128(y.cpu(), pow2)
    assert torch.equal(s.cpu(), os_) and torch.equal(q.cpu().view(torch.uint8), oq.view(torch.uint8))


def test_rms_norm_quant_rejects_bad_shapes():
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant(torch.zeros(2, 128, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6)
