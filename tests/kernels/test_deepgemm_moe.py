"""Routed FP8 experts through DeepGEMM's contiguous grouped GEMM (dsv4_kernels.deepgemm_moe) against
dsv4_kernels.fp8_experts.fp8_moe_ref on experts converted from MXFP4 (CUDA with deep_gemm only)."""

import pytest
import torch

from dsv4_kernels.gpu import has_deep_gemm, why_not
from dsv4_kernels.moe import moe_experts, route
from dsv4_kernels.quant import dequant_mxfp4, quant_mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not has_deep_gemm(),
        reason="DeepGEMM's grouped FP8 GEMM needs a CUDA GPU with tokenspeed-deepgemm installed: "
        + (why_not("deep_gemm") or "no CUDA device"),
    ),
]


def _experts(e, h, inter, gen):
    packed = {}
    for name, (n, k) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
        q, s = quant_mxfp4(torch.randn(e * n, k, generator=gen) * k**-0.5)
        packed[name] = q.view(e, n, k // 2).cuda()
        packed["s" + name[1]] = s.view(torch.uint8).view(e, n, k // 32).cuda()
    return packed


@pytest.mark.parametrize(
    "t,e,h,inter,k,skip",
    [
        (1, 8, 256, 128, 2, False),
        (37, 16, 512, 256, 4, True),
        (300, 32, 1024, 512, 6, False),
        (2048, 64, 1024, 512, 6, True),
    ],
)
def test_deepgemm_moe_matches_reference(t, e, h, inter, k, skip):
    from dsv4_kernels import deepgemm_moe, fp8_experts

    gen = torch.Generator().manual_seed(t + e)
    pk = _experts(e, h, inter, gen)
    ex = fp8_experts.from_packed(pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"])
    x = (torch.randn(t, h, generator=gen)).to("cuda", torch.bfloat16)
    gate = (torch.randn(e, h, generator=gen) * h**-0.5).cuda()
    weights, ids = route(x, gate, k, 1.5)
    if skip:  # expert parallelism: pairs of another rank's experts
        ids = torch.where(ids % 5 == 0, -1, ids)
    shared = torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16)
    got = deepgemm_moe.deepgemm_moe(x, weights, ids, ex, 10.0, shared, exact=True)
    want = fp8_experts.fp8_moe_ref(x, weights, ids, ex, 10.0, shared)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h) and not got.isnan().any()
    scale = want.float().abs().max().clamp_min(1.0)
    # same quantised operands: tensor-core accumulation order and the one bf16 rounding of h/y apart
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * float(scale), rtol=3e-2)
    # against the bf16-activation MXFP4 reference: the FP8 activations' rounding (stated in deepgemm_moe)
    dense = [dequant_mxfp4(pk[n], pk["s" + n[1]]).to(torch.bfloat16) for n in ("w1", "w2", "w3")]
    exact = moe_experts(x, weights, ids, *dense, 10.0) + shared
    rel = float((got.float() - exact.float()).norm() / exact.float().norm())
    assert rel < 0.06, rel
    # that call sized its layout exactly; the sync-free bound layout (the eager default) gives the same rows to the
    # same pairs
    bound = deepgemm_moe.deepgemm_moe(x, weights, ids, ex, 10.0, shared)
    torch.testing.assert_close(bound.float(), got.float(), atol=1e-2 * float(scale), rtol=1e-2)
    # under capture the call takes the bound layout by itself (no sync) and replays to the eager bound result
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        again = deepgemm_moe.deepgemm_moe(x, weights, ids, ex, 10.0, shared)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(again, bound, atol=0, rtol=0)


def test_alignment_is_deepgemms():
    from dsv4_kernels import deepgemm_moe

    assert deepgemm_moe.m_alignment() in (64, 128, 256)


def test_warm_runs_every_layout_row_count():
    """deepgemm_moe.warm on real DeepGEMM: both GEMMs at each multiple of the alignment up to the bound."""
    from dsv4_kernels import deepgemm_moe, fp8_experts

    gen = torch.Generator().manual_seed(1)
    pk = _experts(16, 512, 256, gen)
    ex = fp8_experts.from_packed(pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"])
    align = deepgemm_moe.m_alignment()
    ms = deepgemm_moe.warm_m_values(300, 4, 16, align)
    assert ms[0] == align and ms[-1] == fp8_experts.padded_rows(1200, 16, align)
    assert deepgemm_moe.warm(ex, 300, 4) == 2 * len(ms)
    torch.cuda.synchronize()
