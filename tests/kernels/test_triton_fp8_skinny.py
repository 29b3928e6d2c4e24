"""The split-K FP8 GEMM for decode-sized M (dsv4_kernels/triton_fp8_skinny.py) against the plain-torch reference
(dsv4_kernels.fp8_linear.fp8_linear_ref) on fresh random inputs: interpreter on the CPU, compiled on CUDA; on a GPU
with DeepGEMM also against DeepGEMM's GEMM on the same quantised activations."""

import pytest
import torch

from tests.support import triton_env  # noqa: F401  (sets TRITON_INTERPRET before dsv4_kernels.triton_* imports)
from dsv4_kernels import fp8_linear as ref
from dsv4_kernels import triton_fp8_skinny as skinny
from dsv4_kernels.gpu import has_deep_gemm
from dsv4_kernels.quant import quant_fp8_block

DEVICE = triton_env.DEVICE


def _case(m, n, k, seed, pow2=True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    q, s = quant_fp8_block(w, scale_fmt="ue8m0")
    fw = ref.weight_from_checkpoint(q.to(DEVICE), s.to(DEVICE), pow2)
    x = (torch.randn(m, k, generator=gen) * (1 + 4 * torch.rand(m, 1, generator=gen))).to(DEVICE, torch.bfloat16)
    xq, xs = ref.quant_act_1x128(x.float(), pow2)
    xs = xs.t().contiguous().t()  # MN-major strides, as the Triton quantiser writes them for DeepGEMM
    return x, fw, xq, xs


def _rel(out, want):
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(256, 1024), (1024, 256), (384, 2048)])
def test_matches_reference(m, n, k):
    """One row, a few, a full M tile; K split (several partials per column block) and not (K = 256)."""
    x, fw, xq, xs = _case(m, n, k, seed=m * 7 + n + k)
    block_n, splits, per = skinny.plan(n, k)
    assert (splits > 1) == (k >= 1024) and per * splits >= k // 128
    out = skinny.fp8_skinny_gemm(xq, xs, fw.weight, fw.scale)
    want = ref.fp8_linear_ref(x.float(), fw)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert _rel(out, want) < 8e-3  # same products; bf16 output rounding + accumulation order


def test_counters_reset_between_calls():
    """Split-K calls leave their arrival counters at zero, so a second call (another shape, then the first
    again) reduces correctly."""
    a = _case(3, 512, 2048, seed=11)
    b = _case(2, 256, 1024, seed=12)
    first = skinny.fp8_skinny_gemm(a[2], a[3], a[1].weight, a[1].scale)
    skinny.fp8_skinny_gemm(b[2], b[3], b[1].weight, b[1].scale)
    again = skinny.fp8_skinny_gemm(a[2], a[3], a[1].weight, a[1].scale)
    assert torch.equal(first, again)
    assert int(skinny._COUNTERS[first.device].abs().sum()) == 0


def test_bad_inputs_raise():
    x, fw, xq, xs = _case(2, 256, 256, seed=13)
    big = torch.zeros(skinny.MAX_M + 1, 256, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="activations"):
        skinny.fp8_skinny_gemm(big, torch.ones(skinny.MAX_M + 1, 2, device=DEVICE), fw.weight, fw.scale)
    with pytest.raises(ValueError, match="weight"):
        skinny.fp8_skinny_gemm(xq, xs, fw.weight[:200], fw.scale)
    with pytest.raises(ValueError, match="scales"):
        skinny.fp8_skinny_gemm(xq, xs[:, :1], fw.weight, fw.scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not has_deep_gemm(), reason="needs a CUDA GPU with deep_gemm")
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(1024, 4096), (32768, 1024), (4096, 8192), (512, 4096)])
def test_matches_deep_gemm_at_v4_flash_shapes(m, n, k):
    """V4-Flash's decode projections (q_a, q_b, wo_b, kv): the same quantised activations through DeepGEMM."""
    from dsv4_kernels.gpu import import_deep_gemm
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128

    x, fw, _, _ = _case(m, n, k, seed=m + n + k)
    xq, xs = quant_act_1x128(x, fw.pow2_act)
    got = skinny.fp8_skinny_gemm(xq, xs, fw.weight, fw.scale)
    want = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    import_deep_gemm().fp8_gemm_nt((xq, xs), (fw.weight, fw.scale), want)
    assert _rel(got, want) < 4e-3
    assert _rel(got, ref.fp8_linear_ref(x.float(), fw)) < 8e-3
