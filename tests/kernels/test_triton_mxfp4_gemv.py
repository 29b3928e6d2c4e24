"""Routed MXFP4 experts as split-K GEMVs over triton_kernels' Hopper layouts (dsv4_kernels.triton_mxfp4_gemv).

CPU (Triton interpreter, tests/support/triton_env.py): the torch copies of the Hopper swizzles against the
library (where tokenspeed-triton-kernels is installed), the GEMV against dense matmuls of the dequantised bytes,
and the whole MoE against dsv4_kernels.moe.moe_experts. GPU only: against mxfp4_ogs.ogs_moe on the same
OgsExperts at V4-Flash shapes, and under CUDA-graph capture.
"""

import pytest
import torch

from dsv4_kernels import triton_mxfp4_gemv as G  # noqa: E402
from dsv4_kernels.moe import moe_experts  # noqa: E402
from dsv4_kernels.quant import dequant_mxfp4, quant_mxfp4  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

GPU_ONLY = "GPU only: "


def _bytes(e, n, k, gen, device="cpu"):
    """Random checkpoint bytes: every e2m1 code, scales 2^-8 .. 2^1 (uint8 [E, N, K/2], [E, N, K/32])."""
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(119, 128, (e, n, k // 32), dtype=torch.uint8, generator=gen)
    return w.to(device), s.to(device)


def _dense(w, s):
    e, n, kb = w.shape
    return dequant_mxfp4(w.reshape(e * n, kb), s.reshape(e * n, -1)).view(e, n, 2 * kb).float()


def _experts(e, h, inter, gen):
    """Checkpoint-format experts from quant_mxfp4 of random weights and their dequantised fp32 copies."""
    packed, dense = {}, {}
    for name, (n, k) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
        w = torch.randn(e, n, k, generator=gen) * k**-0.5
        q, s = quant_mxfp4(w.reshape(e * n, k))
        q, s = q.view(e, n, k // 2), s.view(torch.uint8).view(e, n, k // 32)
        packed[name], packed["s" + name[1]] = q, s
        dense[name] = _dense(q, s)
    return packed, dense


def _library_layouts():
    from dsv4_kernels.gpu import _triton_kernels_shims

    try:
        _triton_kernels_shims()
        from triton_kernels import tensor
        from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout
    except ImportError as exc:
        pytest.skip(GPU_ONLY + f"tokenspeed-triton-kernels (the gpu extra) is not installed: {exc}")
    return tensor, HopperMXValueLayout, HopperMXScaleLayout


@pytest.mark.parametrize("e,n,k", [(2, 256, 256), (3, 384, 192), (1, 64, 128), (2, 4096, 128)])
def test_swizzles_match_triton_kernels(e, n, k):
    """swizzle_value / swizzle_scale = the library's convert_layout from the strided K-major wrap that
    mxfp4_ogs._wrap makes of the checkpoint bytes: same bytes, shape and strides."""
    tensor, value_layout, scale_layout = _library_layouts()
    w, s = _bytes(e, n, k, torch.Generator().manual_seed(n + k))
    lib_w = tensor.convert_layout(
        tensor.wrap_torch_tensor(w.transpose(1, 2), dtype=tensor.FP4), value_layout(mx_axis=-2, mma_version=3)
    ).storage.data
    lib_s = tensor.convert_layout(
        tensor.wrap_torch_tensor(s.transpose(1, 2)), scale_layout(mx_axis=-2, num_warps=8)
    ).storage.data
    ours_w, ours_s = G.swizzle_value(w), G.swizzle_scale(s)
    assert ours_w.shape == lib_w.shape and ours_w.stride() == lib_w.stride() and torch.equal(ours_w, lib_w)
    assert ours_s.shape == lib_s.shape and ours_s.stride() == lib_s.stride() and torch.equal(ours_s, lib_s)


@pytest.mark.parametrize(
    "e,n,k,splits",
    [(2, 256, 256, 1), (2, 256, 256, 3), (3, 384, 192, None), (1, 64, 128, 2)],  # 384, 192: padded layouts
)
def test_gemv_matches_dense(e, n, k, splits):
    """Partial sums over the splits = dequantised W[ids[p]] @ x[p // 2] in fp32; a -1 route gives zeros."""
    gen = torch.Generator().manual_seed(e * n + k)
    w, s = _bytes(e, n, k, gen)
    dense = _dense(w, s)
    wt = G._weights(G.swizzle_value(w.to(DEVICE)), G.swizzle_scale(s.to(DEVICE)), n, k)
    x = NUM.randn(3, k, seed=k, device=DEVICE)
    ids = torch.tensor([e - 1, -1, 0, 1 % e, (2 % e) - (e == 1)][:5], device=DEVICE)
    part = G.gemv(wt, x, ids, x_div=2, splits=splits)
    assert part.dim() == 3 and part.shape[1:] == (5, n)
    want = torch.stack([dense[i] @ x[p // 2].cpu() if i >= 0 else torch.zeros(n) for p, i in enumerate(ids.tolist())])
    NUM.assert_close(part.sum(0).cpu(), want, torch.float32, scaled=True)


CASES = [  # (tokens, top-k, experts, hidden, inter)
    (1, 1, 3, 256, 128),
    (1, 6, 7, 256, 128),
    (2, 8, 9, 128, 256),
    (4, 3, 5, 256, 128),
    (3, 2, 16, 384, 128),
]


@pytest.mark.parametrize("t,k,e,h,inter", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_moe_matches_moe_experts(t, k, e, h, inter, dtype):
    gen = torch.Generator().manual_seed(t * 100 + k * 10 + e)
    packed, dense = _experts(e, h, inter, gen)
    ex = G.from_checkpoint(*(packed[n].to(DEVICE) for n in ("w1", "s1", "w2", "s2", "w3", "s3")))
    x = NUM.randn(t, h, seed=t + k, scale=2.0)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if t * k > 2:
        ids[0, -1] = -1  # another rank's expert: skipped
    weights = torch.rand(t, k, generator=gen) + 0.1
    shared = NUM.randn(t, h, seed=7, dtype=dtype)
    got = G.gemv_moe(x.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE), ex, 3.0, shared=shared.to(DEVICE))
    assert got.dtype == dtype and got.shape == (t, h)
    # (bf16 on the CPU: the interpreter's fp32 -> bf16 cast truncates where the GPU rounds to nearest, so the
    # kernel's bf16 roundings err ~3x torch's here; fp32 checks the arithmetic to 1e-6)
    w1, w2, w3 = (dense[n].to(dtype) for n in ("w1", "w2", "w3"))
    want = moe_experts(x.to(dtype), weights, ids, w1, w2, w3, 3.0) + shared
    NUM.assert_close(got.cpu(), want, dtype, scaled=True, loose=True)


def test_dead_routes_empty_steps_and_limits():
    gen = torch.Generator().manual_seed(3)
    packed, _ = _experts(4, 128, 128, gen)
    ex = G.from_checkpoint(*(packed[n].to(DEVICE) for n in ("w1", "s1", "w2", "s2", "w3", "s3")))
    x = NUM.randn(2, 128, seed=1, device=DEVICE)
    shared = NUM.randn(2, 128, seed=2, device=DEVICE)
    ids = torch.full((2, 3), -1, device=DEVICE)
    w = torch.ones(2, 3, device=DEVICE)
    assert torch.equal(G.gemv_moe(x, w, ids, ex, 10.0, shared=shared), shared)
    assert torch.equal(G.gemv_moe(x, w, ids, ex, 10.0), torch.zeros_like(x))
    empty = G.gemv_moe(x[:0], w[:0], ids[:0], ex, 10.0)
    assert empty.shape == (0, 128)
    assert G.fits(1, 6) and G.fits(4, 8) and not G.fits(5, 8) and not G.fits(0, 6)
    with pytest.raises(ValueError, match="at most"):
        G.gemv_moe(x.repeat(17, 1), w.repeat(17, 1), ids.repeat(17, 1), ex, 10.0)
    with pytest.raises(ValueError, match="x"):
        G.gemv_moe(x[:, :64], w, ids, ex, 10.0)


def test_splits_fill_the_gpu_and_depend_on_shapes_only():
    assert G.splits_for(4096, 4096, 6) >= 2  # V4-Flash gate|up at one token: 384 tiles -> split K
    assert G.splits_for(4096, 4096, 32) == 1  # 32 routes fill the GPU without splits
    assert G.splits_for(256, 64, 1) == 1  # one K step: nothing to split


# ---- GPU only: against triton_kernels on the same OgsExperts ---------------------------------------------------


def _ogs_or_skip():
    from dsv4_kernels.gpu import has_triton_kernels, why_not

    if not torch.cuda.is_available() or not has_triton_kernels():
        pytest.skip(GPU_ONLY + f"triton_kernels needs CUDA ({why_not('triton_kernels.matmul') or 'no CUDA device'})")
    from dsv4_kernels import mxfp4_ogs

    return mxfp4_ogs


def _v4_flash(mxfp4_ogs, e=256, h=4096, inter=2048):
    """Random bytes (every code, scales near 2^-4) at V4-Flash's expert shapes, in triton_kernels' layouts."""
    g = torch.Generator(device="cuda").manual_seed(11)
    parts = []
    for n, k in ((inter, h), (h, inter), (inter, h)):  # w1, w2, w3
        parts.append(torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=g))
        parts.append(torch.randint(119, 126, (e, n, k // 32), dtype=torch.uint8, device="cuda", generator=g))
    return mxfp4_ogs.prepare(*parts)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4])
def test_gpu_matches_ogs_moe_at_v4_flash_shapes(t):
    mxfp4_ogs = _ogs_or_skip()
    ex = _v4_flash(mxfp4_ogs)
    gx = G.from_ogs(ex)
    x = NUM.randn(t, 4096, seed=t, dtype=torch.bfloat16, device="cuda")
    ids = torch.stack([torch.randperm(256, generator=torch.Generator().manual_seed(t + r))[:6] for r in range(t)])
    ids = ids.cuda()
    weights = torch.rand(t, 6, device="cuda") + 0.1
    shared = NUM.randn(t, 4096, seed=9, dtype=torch.bfloat16, device="cuda")
    got = G.gemv_moe(x, weights, ids, gx, 10.0, shared=shared)
    want = mxfp4_ogs.ogs_moe(x, weights, ids, ex, 10.0, shared=shared)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < 1e-2, rel  # same roundings, other fp32 summation orders
    NUM.assert_close(got, want, torch.bfloat16, scaled=True, loose=True)


@pytest.mark.gpu
def test_gpu_matches_reference_on_selected_experts():
    """The GEMV at V4 widths against moe_experts on the dequantised selected experts (small E: the dense copy)."""
    mxfp4_ogs = _ogs_or_skip()
    gen = torch.Generator().manual_seed(4)
    packed, dense = _experts(8, 1024, 512, gen)
    ex = mxfp4_ogs.prepare(*(packed[n].cuda() for n in ("w1", "s1", "w2", "s2", "w3", "s3")))
    x = NUM.randn(3, 1024, seed=5, dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([[0, 3, 7], [1, 3, -1], [5, 6, 2]], device="cuda")
    weights = torch.rand(3, 3, generator=gen).cuda() + 0.1
    got = G.gemv_moe(x, weights, ids, G.from_ogs(ex), 10.0)
    want = moe_experts(x.float(), weights, ids, *(dense[n].cuda() for n in ("w1", "w2", "w3")), 10.0)
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.gpu
def test_gpu_under_cuda_graph():
    mxfp4_ogs = _ogs_or_skip()
    ex = _v4_flash(mxfp4_ogs, e=16)
    gx = G.from_ogs(ex)
    x = NUM.randn(2, 4096, seed=1, dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], device="cuda")
    weights = torch.rand(2, 6, device="cuda") + 0.1
    eager = G.gemv_moe(x, weights, ids, gx, 10.0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            G.gemv_moe(x, weights, ids, gx, 10.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gemv_moe(x, weights, ids, gx, 10.0)
    ids.copy_(torch.tensor([[15, 14, 13, 12, 11, -1], [0, 2, 4, 6, 8, 10]], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, G.gemv_moe(x, weights, ids, gx, 10.0))
    assert not torch.equal(out, eager)
