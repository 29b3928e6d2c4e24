"""Triton MoE glue (dsv4_kernels/triton_moe_glue.py) against the torch expressions it replaces.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (tests/support/triton_env.py).
"""

import pytest
import torch

from dsv4_kernels import triton_moe_glue as glue  # noqa: E402
from dsv4_kernels.moe import swiglu as ref_swiglu  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [True, False])
def test_swiglu_matches_reference(dtype, fused):
    """fused: gate and up are the two halves of one [P, 2I] GEMM output (strided views), as the MoE uses them.
    Values span the clamp (limit 3 here) on both sides."""
    p, inter, limit = 5, 80, 3.0
    if fused:
        h = NUM.randn(p, 2 * inter, dtype=dtype, device=DEVICE, seed=1, scale=4.0)
        gate, up = h[:, :inter], h[:, inter:]
    else:
        gate = NUM.randn(p, inter, dtype=dtype, device=DEVICE, seed=2, scale=4.0)
        up = NUM.randn(p, inter, dtype=dtype, device=DEVICE, seed=3, scale=4.0)
    out = glue.swiglu(gate, up, limit)
    assert out.dtype == dtype and out.shape == (p, inter)
    NUM.assert_close(out, ref_swiglu(gate, up, limit), dtype)
    NUM.assert_close(
        glue.swiglu(gate, up, limit, out_dtype=torch.bfloat16),
        ref_swiglu(gate, up, limit).to(torch.bfloat16),
        torch.bfloat16,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_shared", [True, False])
def test_combine_matches_reference(dtype, with_shared):
    t, k, h = 4, 3, 72
    y = NUM.randn(t, k, h, dtype=dtype, device=DEVICE, seed=4)
    shared = NUM.randn(t, h, dtype=dtype, device=DEVICE, seed=5) if with_shared else None
    expected = y.float().sum(dim=1).to(dtype)
    if with_shared:
        expected = expected + shared
    out = glue.combine(y, shared)
    assert out.dtype == dtype and out.shape == (t, h)
    NUM.assert_close(out, expected, dtype)


def test_empty_and_bad_shapes():
    z = torch.zeros(0, 8, device=DEVICE)
    assert glue.swiglu(z, z, 1.0).shape == (0, 8)
    assert glue.combine(torch.zeros(0, 2, 8, device=DEVICE)).shape == (0, 8)
    with pytest.raises(ValueError, match="differ"):
        glue.swiglu(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 4, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="shared"):
        glue.combine(torch.zeros(2, 3, 8, device=DEVICE), torch.zeros(2, 4, device=DEVICE))


@pytest.mark.parametrize("t,k,e", [(5, 3, 8), (16, 6, 32), (1, 2, 4)])
def test_sort_pairs_matches_torch_sort(t, k, e):
    """Against dsv4_kernels.mxfp4_ogs.sort_pairs' torch reference (stable argsort) + the gammas gather, with
    repeated experts (ties keep pair order) and -1 pairs (expert parallelism: expert 0, weight 0)."""
    gen = torch.Generator().manual_seed(t * 100 + k)
    ids = torch.randint(-1, e, (t, k), generator=gen).to(DEVICE)
    weights = torch.rand(t, k, generator=gen).to(DEVICE)
    order, rows, counts, gammas = glue.sort_pairs(ids, weights, e)
    flat = ids.clamp_min(0).reshape(-1)
    want_order = flat.argsort(stable=True)
    assert order.dtype == rows.dtype == counts.dtype == torch.int32
    assert torch.equal(order.long(), want_order)
    assert torch.equal(rows.long(), want_order // k)
    assert torch.equal(counts.long(), torch.bincount(flat, minlength=e))
    want_gammas = weights.masked_fill(ids < 0, 0.0).reshape(-1)[want_order]
    torch.testing.assert_close(gammas, want_gammas, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("p,inter", [(5, 256), (1, 128), (3, 200)])
def test_swiglu_quant_matches_swiglu_then_quantiser(dtype, pow2, p, inter):
    """= dsv4_kernels.fp8_linear.quant_act_1x128(swiglu(gate, up)) (the reference quantiser on the reference SwiGLU,
    rounded to the dtype): scales within the dtype's tolerance (a 16-bit SwiGLU may round its largest value one
    ulp apart from torch's, which moves a non-power-of-two scale by that ulp), values within one e4m3 step."""
    from dsv4_kernels import fp8_linear

    h = NUM.randn(p, 2 * inter, dtype=dtype, device=DEVICE, seed=p + inter, scale=4.0)
    gate, up = h[:, :inter], h[:, inter:]
    q, s = glue.swiglu_quant(gate, up, 3.0, pow2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (p, inter) and s.stride(0) == 1
    rq, rs = fp8_linear.quant_act_1x128(ref_swiglu(gate, up, 3.0).cpu(), pow2)
    torch.testing.assert_close(s.cpu(), rs, atol=0, rtol=NUM.tol(dtype)["rtol"])
    back, want = fp8_linear.dequant_act(q.cpu(), s.cpu()), fp8_linear.dequant_act(rq, rs)
    # e4m3: 3 mantissa bits; below its smallest normal (2**-6 of the scale) steps are absolute
    torch.testing.assert_close(back, want, atol=rs.max().item() * 2**-6, rtol=2**-3)
