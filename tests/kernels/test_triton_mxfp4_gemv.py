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
    # the config's split-K target and tile: more programs wanted, or fewer tiles, split K further
    assert G.splits_for(4096, 4096, 6, G.GemvConfig(target_programs=4096)) > G.splits_for(4096, 4096, 6)
    assert G.splits_for(4096, 4096, 6, G.GemvConfig(block_sr=8)) > G.splits_for(4096, 4096, 6)
    assert G.splits_for(4096, 4096, 6, G.GemvConfig(kc=8, target_programs=1 << 16)) == 8  # 64 chunks / 8 a step


# Tiles smaller and larger than the default (kc 8 > the 4 chunks of K 192 padded: a masked step), split-K from
# one split to several; num_warps / num_stages mean nothing to the interpreter, only to the compiled kernel.
CONFIGS = [
    G.GemvConfig(block_sr=1, kc=1, num_warps=2, target_programs=4096),
    G.GemvConfig(block_sr=8, kc=8, num_warps=8, num_stages=1, target_programs=64),
    G.GemvConfig(block_sr=4, kc=4, num_warps=16, num_stages=5, target_programs=2048),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"sr{c.block_sr}-kc{c.kc}-tp{c.target_programs}")
def test_configs_compute_the_defaults_sums(cfg):
    """gemv's split-K partials (summed) and gemv_moe under a non-default GemvConfig = the default's, to fp32
    summation order; the padded [384, 192] layouts cover partial scale-row groups and K steps."""
    gen = torch.Generator().manual_seed(5)
    w, s = _bytes(3, 384, 192, gen)
    wt = G._weights(G.swizzle_value(w.to(DEVICE)), G.swizzle_scale(s.to(DEVICE)), 384, 192)
    x = NUM.randn(2, 192, seed=3, device=DEVICE)
    ids = torch.tensor([2, -1, 0, 1], device=DEVICE)
    want = G.gemv(wt, x, ids, x_div=2)
    got = G.gemv(wt, x, ids, x_div=2, config=cfg)
    assert got.shape[1:] == want.shape[1:]
    NUM.assert_close(got.sum(0).cpu(), want.sum(0).cpu(), torch.float32, scaled=True)
    assert torch.equal(got[:, 1].cpu(), torch.zeros_like(got[:, 1].cpu()))  # the dead route still writes zeros

    packed, _ = _experts(5, 256, 128, gen)
    ex = G.from_checkpoint(*(packed[n].to(DEVICE) for n in ("w1", "s1", "w2", "s2", "w3", "s3")))
    xm = NUM.randn(2, 256, seed=4, device=DEVICE)
    ids = torch.tensor([[4, 0, 2], [1, -1, 3]], device=DEVICE)
    weights = torch.rand(2, 3, generator=gen).to(DEVICE) + 0.1
    want = G.gemv_moe(xm, weights, ids, ex, 3.0)
    NUM.assert_close(G.gemv_moe(xm, weights, ids, ex, 3.0, config=cfg).cpu(), want.cpu(), torch.float32, scaled=True)


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_sr", 3),
        ("block_sr", 16),  # past the scale rows' padding to 8
        ("kc", 0),
        ("kc", 2.0),
        ("num_warps", 6),
        ("num_stages", 0),
        ("target_programs", 0),
        ("target_programs", True),
        ("target_programs", 1 << 20),
    ],
)
def test_bad_config_values_raise(field, value):
    with pytest.raises(ValueError, match=f"GemvConfig.{field} .*got {value!r}"):
        G.GemvConfig(**{field: value})


def test_config_must_be_a_gemv_config():
    w, s = _bytes(1, 64, 64, torch.Generator().manual_seed(0))
    wt = G._weights(G.swizzle_value(w), G.swizzle_scale(s), 64, 64)
    x, ids = torch.zeros(1, 64), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="GemvConfig"):  # checked before anything launches
        G.gemv(wt, x, ids, config={"kc": 4})


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


def test_gemv_sweep_plumbing(tmp_path, monkeypatch):
    """`dsv4 bench kernels moe --gemv-sweep` on the interpreter at a tiny shape, times faked (the GPU run has one
    try): stages, the check against the default, the tables, the JSON (GemvConfig-constructible), the ogs column."""
    import itertools
    import json
    import types

    from benchmarks.kernels import moe as bench_moe
    from benchmarks.kernels import moe_gemv_sweep as S

    monkeypatch.setattr(S, "stage_a", lambda cuda: [G.DEFAULT_CONFIG, G.GemvConfig(block_sr=4, kc=4)])
    runs = itertools.count()
    monkeypatch.setattr(S.Sweep, "_time", lambda self, fn, reps: 100.0 - next(runs))  # later runs "faster"
    out, best = tmp_path / "sweep.md", tmp_path / "best.json"
    argv = "--device cpu --hidden 64 --inter 32 --experts 8 --topk 2 --tokens 1 --gemv-sweep".split()
    assert bench_moe.main(argv + ["--gemv-out", str(out), "--gemv-best-out", str(best)]) == 0
    got = json.loads(best.read_text())
    assert set(got) == {"1", "overall"} and got["1"]["default_us"] is not None
    assert G.GemvConfig(**got["1"]["config"]) != G.DEFAULT_CONFIG  # timed last, so fastest here
    G.GemvConfig(**got["overall"]["config"])
    table = out.read_text()
    d = G.DEFAULT_CONFIG
    default_row = f"| {d.block_sr} | {d.kc} | {d.num_warps} | {d.num_stages} | {d.target_programs} |"
    assert default_row in table and "| 4 | 4 | 4 | 3 | 64 |" in table  # stage B's split target
    assert S.Sweep([], None, 1.0, False, 1.0).best({}) == {}  # nothing timed: no pick
    # the GPU-only tail: the triton_kernels reference beside the tables and in the JSON
    shapes = types.SimpleNamespace(hidden=64, inter=32)
    sweep = S.Sweep([S.Case(1, None, None, None, 1e6)], shapes, 1000.0, True, 1.0)
    sweep.us[(G.DEFAULT_CONFIG, 1)], sweep.err[(G.DEFAULT_CONFIG, 1)] = [10.0], 0.0
    args = bench_moe.argparse.Namespace(topk=2, command="x", hidden=64, inter=32, experts=8)
    args.gemv_out, args.gemv_best_out = str(out), str(best)
    assert S.report(sweep, args, {1: 20.0}, 1000.0, "gpu", tables=True)["1"]["ogs_us"] == 20.0
    assert "triton_kernels ogs_moe 20.0 us" in out.read_text() and json.loads(best.read_text())["1"]["us"] == 10.0
