"""The few-token FP8 GEMV (dsv4_kernels.triton_fp8_gemv) against dsv4_kernels.fp8_linear.fp8_linear_ref.

CPU: the Triton interpreter (tests/support/triton_env.py). GPU: compiled, at V4-Flash shapes, through the engine's
entry points (deepgemm_linear.fp8_gemm and fp8_grouped_gemm with the switch on) and under CUDA-graph capture.
"""

import pytest
import torch

from dsv4_kernels import fp8_linear as ref
from dsv4_kernels import triton_fp8_gemv as G  # noqa: E402
from dsv4_kernels.gpu import has_deep_gemm
from dsv4_kernels.quant import quant_fp8_block
from dsv4_kernels.triton_fp8_quant import quant_act_1x128, quant_act_1x128_grouped  # noqa: E402
from tests.support import triton_env  # noqa: F401  (sets TRITON_INTERPRET before dsv4_kernels.triton_* imports)

DEVICE = triton_env.DEVICE


def _weight(n, k, gen, pow2=True, scale_fmt="ue8m0"):
    w = torch.randn(n, k, generator=gen) * k**-0.5
    q, s = quant_fp8_block(w, scale_fmt=scale_fmt)
    return ref.weight_from_checkpoint(q.to(DEVICE), s.to(DEVICE), pow2)


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize(
    "m,n,k,tile",
    [(1, 256, 512, 16384), (3, 384, 256, 4096), (2, 128, 1024, 65536), (4, 256, 384, 1024), (1, 128, 128, 256)],
)
def test_gemv_matches_reference(m, n, k, tile, pow2):
    """bf16 out = the reference's fp32 product of the same quantised activations, rounded once (k = 384: a K padded
    to 512 in the tile; tile 1024 at k 384: one row a program; 65536: the 128-row cap)."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    fw = _weight(n, k, gen, pow2, "ue8m0" if pow2 else "float32")
    x = (torch.randn(m, k, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    xq, xs = quant_act_1x128(x, pow2)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = G.fp8_gemv(xq, xs, fw.weight, fw.scale, out, tile=tile)
    want = ref.fp8_linear_ref(x.float(), fw)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), atol=2e-2, rtol=1e-2)
    assert _rel(got, want) < 2.5e-3


@pytest.mark.parametrize("g,t,r,k", [(4, 1, 128, 256), (2, 3, 256, 128)])
def test_grouped_gemv_reads_each_groups_rows(g, t, r, k):
    """Group i's R output rows read activation row i of a transposed [T, G, K] view: the reference per group."""
    gen = torch.Generator().manual_seed(g + t + r)
    fw = _weight(g * r, k, gen)
    x = torch.randn(t, g, k, generator=gen).to(DEVICE, torch.bfloat16).transpose(0, 1)
    xq, xs = quant_act_1x128_grouped(x, True)
    got = G.fp8_gemv(xq, xs, fw.weight, fw.scale, torch.empty(g, t, r, dtype=torch.bfloat16, device=DEVICE))
    for i in range(g):
        part = ref.Fp8Weight(fw.weight[i * r : (i + 1) * r], fw.scale[i * r // 128 : (i + 1) * r // 128], True)
        assert _rel(got[i], ref.fp8_linear_ref(x[i].float(), part)) < 2.5e-3


def test_gemv_rejects_shapes_that_do_not_fit():
    gen = torch.Generator().manual_seed(1)
    fw = _weight(256, 256, gen)
    xq, xs = quant_act_1x128(torch.randn(2, 256, generator=gen).to(DEVICE, torch.bfloat16), True)
    with pytest.raises(ValueError, match="do not fit"):
        G.fp8_gemv(xq, xs, fw.weight, fw.scale, torch.empty(2, 128, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="do not fit"):  # 3 groups do not split 256 rows into 128-blocks
        G.fp8_gemv(xq.expand(3, 2, 256), xs.expand(3, 2, 2), fw.weight, fw.scale, torch.empty(3, 2, 85, device=DEVICE))


@pytest.mark.parametrize("k,tile,want", [(4096, 16384, 4), (1024, 16384, 16), (8192, 16384, 2), (128, 65536, 128)])
def test_block_n(k, tile, want):
    assert G.block_n(k, tile) == want


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="GPU only: compiled kernel at V4-Flash shapes")
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(1536, 4096), (32768, 1024), (4096, 8192), (8192, 1024), (4096, 2048)])
def test_gemv_at_v4_flash_shapes_and_under_a_graph(m, n, k):
    """The engine's entry point with the switch on equals the reference, eager and replayed from a CUDA graph."""
    from dsv4_kernels import deepgemm_linear as dgl

    gen = torch.Generator().manual_seed(n + k + m)
    fw = _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    xq, xs = quant_act_1x128(x, True)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    G.fp8_gemv(xq, xs, fw.weight, fw.scale, out)
    want = ref.fp8_linear_ref(x.float(), fw)
    assert _rel(out, want) < 2.5e-3
    graph = torch.cuda.CUDAGraph()
    replayed = torch.zeros_like(out)
    with torch.cuda.graph(graph):
        G.fp8_gemv(xq, xs, fw.weight, fw.scale, replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)  # no atomics, no split: the same sums in the same order
    if has_deep_gemm() and G.takes_gemv(m, fw.weight):  # the engine's entry point takes the same kernel
        assert torch.equal(dgl.fp8_gemm(x, fw), out)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="GPU only: compiled grouped kernel at wo_a's shape")
@pytest.mark.parametrize("t", [1, 3])
def test_grouped_gemv_at_wo_a_shape(t):
    g, r, k = 8, 1024, 4096
    gen = torch.Generator().manual_seed(t)
    fw = _weight(g * r, k, gen)
    x = torch.randn(t, g, k, generator=gen).to(DEVICE, torch.bfloat16).transpose(0, 1)
    xq, xs = quant_act_1x128_grouped(x, True)
    got = G.fp8_gemv(xq, xs, fw.weight, fw.scale, torch.empty(g, t, r, dtype=torch.bfloat16, device=DEVICE))
    for i in range(g):
        part = ref.Fp8Weight(fw.weight[i * r : (i + 1) * r], fw.scale[i * 8 : (i + 1) * 8], True)
        assert _rel(got[i], ref.fp8_linear_ref(x[i].float(), part)) < 2.5e-3
