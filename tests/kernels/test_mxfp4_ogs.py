"""Routed MXFP4 experts through OpenAI's triton_kernels (dsv4_kernels.mxfp4_ogs) against the reference on the
dequantised checkpoint bytes (CUDA with triton_kernels installed only: it has no CPU/interpreter path)."""

import pytest
import torch

from dsv4_kernels.gpu import has_triton_kernels, why_not
from dsv4_kernels.moe import moe_experts, route
from dsv4_kernels.quant import dequant_mxfp4, quant_mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not has_triton_kernels(),
        reason="triton_kernels' MXFP4 matmul needs a CUDA GPU with tokenspeed-triton-kernels "
        "installed (pip install '.[gpu]'): " + (why_not("triton_kernels.matmul") or "no CUDA device"),
    ),
]


def _experts(e, h, inter, gen):
    """Checkpoint-format experts (quant_mxfp4: low nibble = even element) and their dequantised bf16 copies."""
    packed, dense = {}, {}
    for name, (n, k) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
        w = torch.randn(e, n, k, generator=gen) * k**-0.5
        q, s = quant_mxfp4(w.reshape(e * n, k))
        q, s = q.view(e, n, k // 2).cuda(), s.view(torch.uint8).view(e, n, k // 32).cuda()
        packed[name], packed["s" + name[1]] = q, s
        dense[name] = dequant_mxfp4(q, s).to(torch.bfloat16)
    return packed, dense


@pytest.mark.parametrize(
    "t,e,h,inter,k", [(1, 8, 256, 128, 2), (37, 16, 512, 256, 4), (64, 32, 1024, 512, 6), (4100, 16, 512, 256, 4)]
)  # 4100: prefill-sized constraints
def test_ogs_moe_matches_reference(t, e, h, inter, k):
    from dsv4_kernels import mxfp4_ogs

    gen = torch.Generator().manual_seed(t * 7 + e)
    packed, dense = _experts(e, h, inter, gen)
    ex = mxfp4_ogs.prepare(packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"], packed["s3"])
    x = torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16)
    gate = (torch.randn(e, h, generator=gen) * h**-0.5).cuda()
    weights, ids = route(x, gate, k, 1.5, bias=torch.zeros(e, device="cuda"))
    got = mxfp4_ogs.ogs_moe(x, weights, ids, ex, 10.0)
    want = moe_experts(x.float(), weights, ids, dense["w1"].float(), dense["w2"].float(), dense["w3"].float(), 10.0)
    assert got.shape == (t, h) and torch.isfinite(got).all()
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel  # bf16 activations and intermediate, fp32 accumulation


def test_ogs_moe_under_cuda_graph():
    from dsv4_kernels import mxfp4_ogs

    gen = torch.Generator().manual_seed(5)
    packed, _ = _experts(16, 512, 256, gen)
    ex = mxfp4_ogs.prepare(packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"], packed["s3"])
    x = torch.randn(8, 512, generator=gen).to("cuda", torch.bfloat16)
    gate = (torch.randn(16, 512, generator=gen) * 512**-0.5).cuda()
    weights, ids = route(x, gate, 4, 1.5, bias=torch.zeros(16, device="cuda"))
    eager = mxfp4_ogs.ogs_moe(x, weights, ids, ex, 10.0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            mxfp4_ogs.ogs_moe(x, weights, ids, ex, 10.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mxfp4_ogs.ogs_moe(x, weights, ids, ex, 10.0)
    ids2 = torch.randint(0, 16, ids.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mxfp4_ogs.ogs_moe(x, weights, ids, ex, 10.0))
    assert not torch.equal(out, eager)


def test_variant_sweep_leaves_no_step_size_to_compile():
    """engine.execution.warmup's MoE sweep (one call per mxfp4_ogs.variant_key class) compiles every variant of
    triton_kernels' matmul a step of up to max_tokens tokens can need: random step sizes afterwards, and the
    ~520-token one that compiled mid-request on the H200 after the ladder, specialise nothing new."""
    from dsv4_kernels import mxfp4_ogs
    from engine.telemetry.compile_watch import install_variant_log

    log = install_variant_log()
    gen = torch.Generator().manual_seed(11)
    e, h, inter, k, top = 16, 512, 256, 4, 1100
    packed, _ = _experts(e, h, inter, gen)
    ex = mxfp4_ogs.prepare(packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"], packed["s3"])
    x = torch.randn(top, h, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.randint(0, e, (top, k), generator=gen).cuda()
    weights = torch.rand(top, k, generator=gen).cuda()
    for t in mxfp4_ogs.variant_tokens(top, e, k):
        mxfp4_ogs.ogs_moe(x[:t], weights[:t], ids[:t], ex, 10.0)
    mark = len(log.variants)
    sizes = sorted({520, 547, top, *torch.randint(1, top + 1, (48,), generator=gen).tolist()})
    for t in sizes:
        mxfp4_ogs.ogs_moe(x[:t], weights[:t], ids[:t], ex, 10.0)
    new = [line for line in log.explain(mark) if line.startswith("_matmul") or line.startswith("_p_matmul")]
    assert new == [], new
