"""The Marlin MXFP4 MoE candidate (dsv4_kernels/marlin_moe.py) against the reference experts on their
dequantised weights, on fresh random experts and routes (CUDA with the candidate's wheels only:
tools/device_wheels/marlin_wheel.py)."""

import pytest
import torch

from dsv4_kernels import moe as ref
from dsv4_kernels.gpu import has_marlin_moe, why_not_marlin_moe
from dsv4_kernels.quant import dequant_mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not has_marlin_moe(),
        reason="the Marlin MoE candidate needs a CUDA GPU and its wheels "
        f"(tools/device_wheels/marlin_wheel.py): {why_not_marlin_moe()}",
    ),
]


def _experts(e, h, inter, gen):
    packed, dense = {}, {}
    for name, (n, k) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
        w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = torch.randint(119, 124, (e, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        packed[name], packed["s" + name[1]] = w, s
        dense[name] = dequant_mxfp4(w, s).to(torch.bfloat16)
    return packed, dense


@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
def test_matches_the_reference_experts(tokens):
    """Decode sizes (8-route blocks) to a prefill-sized step (wider blocks), top-6 of 16 experts."""
    from dsv4_kernels import marlin_moe

    e, h, inter, k = 16, 512, 256, 6
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    packed, dense = _experts(e, h, inter, gen)
    ex = marlin_moe.prepare(packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"], packed["s3"])
    x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
    gate = torch.randn(e, h, device="cuda", generator=gen) * h**-0.5
    weights, ids = ref.route(x, gate, k, 1.5)
    got = marlin_moe.marlin_moe(x, weights, ids, ex, 10.0)
    want = ref.moe_experts_grouped(x, weights, ids, dense["w1"], dense["w2"], dense["w3"], 10.0)
    assert got.shape == want.shape and torch.isfinite(got).all()
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < 2e-2, rel  # bf16 activations and intermediates, fp32 accumulation in both

    shared = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
    with_shared = marlin_moe.marlin_moe(x, weights, ids, ex, 10.0, shared=shared)
    torch.testing.assert_close(with_shared.float(), got.float() + shared.float(), atol=0.05, rtol=0.02)


def test_rejects_shapes_marlin_cannot_tile():
    from dsv4_kernels import marlin_moe

    w = torch.zeros(2, 96, 64, dtype=torch.uint8, device="cuda")  # hidden 128: not a multiple of 256
    s = torch.zeros(2, 96, 4, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="hidden"):
        marlin_moe.prepare(
            w,
            s,
            torch.zeros(2, 128, 48, dtype=torch.uint8, device="cuda"),
            torch.zeros(2, 128, 3, dtype=torch.uint8, device="cuda"),
            w,
            s,
        )
