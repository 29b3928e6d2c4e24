"""Triton MoE (dsv4_kernels/triton_moe.py) against dsv4_kernels.moe, and packed MXFP4 experts inside the engine.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (tests/support/triton_env.py), so the
shapes are tiny: the interpreter runs every program in Python.
"""

import pytest
import torch

from dsv4_kernels import moe as ref  # noqa: E402
from dsv4_kernels import triton_moe  # noqa: E402
from dsv4_kernels.quant import dequant_mxfp4, quant_mxfp4  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

DTYPES = [torch.float32, torch.bfloat16]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def router_inputs(t, h, e, v, k, seed):
    g = gen(seed)
    x = torch.randn(t, h, generator=g).to(DEVICE)
    gate = (torch.randn(e, h, generator=g) * h**-0.5).to(DEVICE)
    bias = (torch.randn(e, generator=g) * 0.1).to(DEVICE)
    tid2eid = torch.rand(v, e, generator=g).argsort(dim=1)[:, :k].to(DEVICE)
    token_ids = torch.randint(0, v, (t,), generator=g).to(DEVICE)
    return x, gate, bias, tid2eid, token_ids


def by_id(weights, ids):
    """Rows re-ordered by expert id: the reference's topk(sorted=False) order is unspecified."""
    order = ids.argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


# ---- routing ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("mode", ["bias", "plain", "hash"])
@pytest.mark.parametrize("t", [1, 13])
def test_route_matches_reference(scoring, mode, t):
    e, k = 40, 6  # neither a power of two: padded experts and top-k slots
    x, gate, bias, tid2eid, token_ids = router_inputs(t, 32, e, 50, k, seed=t)
    kwargs = {
        "bias": bias if mode == "bias" else None,
        "tid2eid": tid2eid if mode == "hash" else None,
        "token_ids": token_ids,
    }
    for renorm in (True, False):
        want_w, want_ids = by_id(*ref.route(x, gate, k, 1.5, scoring, renormalize=renorm, **kwargs))
        got_w, got_ids = by_id(*triton_moe.route(x, gate, k, 1.5, scoring, renormalize=renorm, **kwargs))
        assert got_ids.dtype == torch.int64 and torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t,h", [(1, 600), (3, 256), (8, 4096)])  # ragged splits, one split, V4's hidden size
def test_router_gemv_partials_sum_to_the_fp32_matmul(t, h):
    from dsv4_kernels import triton_router

    x, gate, *_ = router_inputs(t, h, 40, 10, 6, seed=h + t)  # 40 experts: a ragged expert block
    for xs, gs in ((x, gate), (x.bfloat16(), gate.bfloat16())):
        parts = triton_router.router_partials(xs, gs)
        assert parts.shape == (-(-h // triton_router.BLOCK_H), t, 40) and parts.dtype == torch.float32
        torch.testing.assert_close(parts.sum(0), xs.float() @ gs.float().t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("mode", ["bias", "hash"])
def test_route_on_gemv_partials_matches_reference(monkeypatch, mode):
    """The routing kernel adding the GEMV's split-K partials (the CUDA path of decode-sized steps) as it loads them."""
    from dsv4_kernels import triton_router

    monkeypatch.setattr(triton_router, "takes_gemv", lambda x: x.shape[0] <= triton_router.GEMV_MAX_TOKENS)
    e, k, t = 40, 6, 5
    x, gate, bias, tid2eid, token_ids = router_inputs(t, 700, e, 50, k, seed=3)
    kwargs = {"bias": bias if mode == "bias" else None, "tid2eid": tid2eid if mode == "hash" else None}
    want_w, want_ids = by_id(*ref.route(x, gate, k, 1.5, "sqrtsoftplus", token_ids=token_ids, **kwargs))
    got_w, got_ids = by_id(*triton_moe.route(x, gate, k, 1.5, "sqrtsoftplus", token_ids=token_ids, **kwargs))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(
    DEVICE == "cpu",
    reason="GPU only: bf16 router weights multiply with fp32 output on CUDA "
    "(torch.mm(out_dtype=)); elsewhere router_logits is the reference's fp32 matmul itself",
)
def test_router_logits_of_bf16_weights_are_the_fp32_matmul():
    """bf16 x and gate at V4 widths: the cuBLAS bf16 GEMM with fp32 output equals x.float() @ gate.float().t() to
    fp32 rounding (exact products, fp32 sums in another order), and the path did not fall back."""
    x, gate, *_ = router_inputs(300, 4096, 256, 10, 6, seed=7)
    x, gate = x.bfloat16(), gate.bfloat16()
    got = triton_moe.router_logits(x, gate)
    assert got.dtype == torch.float32 and triton_moe._MM_OUT_DTYPE[0]
    torch.testing.assert_close(got, x.float() @ gate.float().t(), **NUM.TOL[torch.float32])


def test_route_softplus_extremes():
    """Large logits take softplus' identity branch; very negative ones need the accurate log1p."""
    x = torch.ones(1, 1, device=DEVICE)
    gate = torch.tensor([[40.0], [25.0], [-30.0], [0.5], [-90.0]], device=DEVICE)  # the logits
    want_w, want_ids = by_id(*ref.route(x, gate, 4, 1.0))
    got_w, got_ids = by_id(*triton_moe.route(x, gate, 4, 1.0))
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=0, rtol=1e-5)


# ---- MXFP4 experts --------------------------------------------------------------------------------------
def packed_experts(e, h, inter, seed):
    """-> (packed dict w1,s1,w2,s2,w3,s3 as uint8, dequantised fp32 w1, w2, w3)."""
    g = gen(seed)
    out, dense = {}, {}
    for name, shape in (("w1", (e, inter, h)), ("w3", (e, inter, h)), ("w2", (e, h, inter))):
        w = torch.randn(*shape, generator=g) * shape[-1] ** -0.5 * 2
        packed, scale = quant_mxfp4(w)
        out[name], out["s" + name[1]] = packed.to(DEVICE), scale.view(torch.uint8).to(DEVICE)
        dense[name] = dequant_mxfp4(packed, scale).to(DEVICE)
    return out, dense


def run_both(x, weights, ids, pk, dense, limit=1.5, **kwargs):
    dt = x.dtype
    want = ref.moe_experts(x, weights, ids, dense["w1"].to(dt), dense["w2"].to(dt), dense["w3"].to(dt), limit)
    got = triton_moe.mxfp4_moe(
        x, weights, ids, pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"], limit, **kwargs
    )
    assert got.dtype == dt and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **NUM.tol(dt, loose=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 6, 29])
def test_mxfp4_moe_biased_routing(dtype, t):
    e, h, inter, k = 16, 96, 64, 4  # H = 96: a K tile (128) with a masked tail; T=1 leaves 12 experts empty
    pk, dense = packed_experts(e, h, inter, seed=t)
    x, gate, bias, _, _ = router_inputs(t, h, e, 8, k, seed=100 + t)
    weights, ids = ref.route(x, gate, k, 1.5, bias=bias)
    run_both(x.to(dtype), weights, ids, pk, dense)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_moe_hash_routing_with_unused_experts(dtype):
    e, h, inter, k, t = 8, 64, 32, 2, 21
    pk, dense = packed_experts(e, h, inter, seed=7)
    x, gate, _, tid2eid, token_ids = router_inputs(t, h, e, 30, k, seed=8)
    tid2eid = tid2eid % 5  # experts 5..7 never picked (duplicates within a row are fine for the kernels)
    weights, ids = ref.route(x, gate, k, 1.5, tid2eid=tid2eid, token_ids=token_ids)
    run_both(x.to(dtype), weights, ids, pk, dense)


def test_mxfp4_moe_tiling_options(monkeypatch):
    """Several K steps (block_k 32), wide row tiles, and token chunks (as at prefill) change nothing."""
    e, h, inter, k, t = 8, 64, 64, 2, 19
    pk, dense = packed_experts(e, h, inter, seed=11)
    x, gate, bias, _, _ = router_inputs(t, h, e, 8, k, seed=12)
    weights, ids = ref.route(x, gate, k, 1.5, bias=bias)
    run_both(x, weights, ids, pk, dense, limit=0.7, block_k=32, block_n=16, block_m=32)
    monkeypatch.setattr(triton_moe, "MAX_CHUNK_TOKENS", 8)
    run_both(x, weights, ids, pk, dense)


def test_sort_by_expert_covers_every_pair_once():
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [2, 3]] * 5, device=DEVICE)
    e, bm = 6, 4
    order, expert, start, stop = triton_moe.sort_by_expert(ids, e, bm)
    assert expert.numel() == triton_moe.max_tiles(ids.numel(), e, bm)
    flat, seen = ids.reshape(-1).cpu(), []
    for ex, a, b in zip(expert.tolist(), start.tolist(), stop.tolist(), strict=True):
        if ex == e:
            continue  # spare tile
        assert 0 < b - a <= bm
        pairs = order[a:b].cpu()
        assert (flat[pairs] == ex).all()
        seen += pairs.tolist()
    assert sorted(seen) == list(range(ids.numel()))


def test_empty_batch():
    pk, _ = packed_experts(4, 64, 32, seed=0)
    x = torch.zeros(0, 64, device=DEVICE)
    w, ids = triton_moe.route(x, torch.ones(4, 64, device=DEVICE), 2, 1.0)
    assert w.shape == ids.shape == (0, 2)
    out = triton_moe.mxfp4_moe(x, w, ids, pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"], 1.0)
    assert out.shape == (0, 64)


def test_mxfp4_moe_rejects_bad_shapes():
    pk, _ = packed_experts(4, 64, 32, seed=0)
    x = torch.zeros(2, 64, device=DEVICE)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="w2 must be uint8"):
        triton_moe.mxfp4_moe(
            x,
            torch.ones(2, 2, device=DEVICE),
            ids,
            pk["w1"],
            pk["s1"],
            pk["w2"][:, :32],
            pk["s2"],
            pk["w3"],
            pk["s3"],
            1.0,
        )


# ---- engine -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_q(tmp_path_factory):
    from engine.loading.make_model import make_model

    return make_model("tiny", tmp_path_factory.mktemp("tiny_q"), seed=5, quantize=True)


def test_load_weights_keeps_mxfp4_experts_packed(tiny_q, tmp_path):
    from engine.loading.make_model import make_model
    from engine.loading.weights import load_weights
    from engine.model.config import ModelConfig

    cfg = ModelConfig.from_model_dir(tiny_q)
    dense = load_weights(tiny_q, cfg)
    kept = load_weights(tiny_q, cfg, keep_mxfp4_experts=True)
    name = "layers.1.ffn.experts.3.w2.weight"
    assert kept[name].dtype == torch.uint8 and kept[name].shape == (cfg.hidden_size, cfg.moe_intermediate_size // 2)
    scale = kept["layers.1.ffn.experts.3.w2.scale"]
    assert scale.dtype == torch.uint8 and scale.shape == (cfg.hidden_size, cfg.moe_intermediate_size // 32)
    assert torch.equal(dequant_mxfp4(kept[name], scale), dense[name])
    shared = "layers.1.ffn.shared_experts.w1.weight"  # FP8: dequantised as before
    assert torch.equal(kept[shared], dense[shared])
    plain = make_model("tiny", tmp_path, seed=5)  # unquantised experts: the flag changes nothing
    assert not any(n.endswith(".scale") for n in load_weights(plain, cfg, keep_mxfp4_experts=True))


def test_take_experts_mixed_layer_is_dequantised():
    """A layer with some experts packed and some dense (an odd checkpoint) falls back to dense stacks."""
    from engine.model.moe import PackedExperts, take_experts

    pk, dense = packed_experts(2, 64, 32, seed=4)
    weights = {}
    for e in range(2):
        for w in ("w1", "w2", "w3"):
            name = f"ffn.experts.{e}.{w}.weight"
            weights[name] = pk[w][e].cpu()
            weights[f"ffn.experts.{e}.{w}.scale"] = pk["s" + w[1]][e].cpu()
    whole = take_experts(dict(weights), "ffn.", 2, torch.float32)
    assert isinstance(whole, PackedExperts) and torch.equal(whole.w2, pk["w2"].cpu())
    weights["ffn.experts.1.w3.weight"] = dense["w3"][1].cpu()
    del weights["ffn.experts.1.w3.scale"]
    w1, w2, w3 = take_experts(weights, "ffn.", 2, torch.float32)
    assert not weights  # everything popped, scales included
    for got, name in ((w1, "w1"), (w2, "w2"), (w3, "w3")):
        torch.testing.assert_close(got, dense[name].cpu(), atol=0, rtol=0)


def _generate(tiny_q, monkeypatch, keep: bool, kernel: str):
    from engine.execution.sampling_params import SamplingParams
    from engine.llm import LLM

    monkeypatch.setenv("DSV4_MXFP4_MOE", kernel)
    llm = LLM(tiny_q, device=DEVICE, keep_mxfp4_experts=keep)
    assert (llm.engine.model.moe[0].packed is not None) == keep
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    return llm.generate([list(range(3, 13)), [5, 6, 7]], params)


def test_engine_packed_experts_match_dequantised(tiny_q, monkeypatch):
    """fp32 tiny model, MXFP4 experts: dequantised at load vs kept packed (Triton kernel, and the
    dequantise-on-the-fly reference, which must be bit-identical to dequantising at load)."""
    want = _generate(tiny_q, monkeypatch, keep=False, kernel="0")
    fallback = _generate(tiny_q, monkeypatch, keep=True, kernel="0")
    fast = _generate(tiny_q, monkeypatch, keep=True, kernel="1")
    for w, f, o in zip(want, fallback, fast, strict=True):
        assert f.token_ids == w.token_ids and f.logprobs == w.logprobs and f.prompt_logprobs == w.prompt_logprobs
        assert o.token_ids == w.token_ids
        assert o.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert o.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)
