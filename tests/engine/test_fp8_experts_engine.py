"""FP8 experts for prefill in the engine (engine.model.fp8_expert_weights, EngineOptions.prefill_expert_format): the
format's resolution, the MoE block's reference path on converted experts against the MXFP4 block, whole-engine
tokens with FP8 experts alone (a prefill-only engine) and beside MXFP4, and the fit check's byte count."""

from __future__ import annotations

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from engine.loading.fit_check import weight_bytes_per_rank
from engine.loading.load import load_engine
from engine.loading.make_model import make_model
from engine.loading.memory_plan import activation_reserve, fp8_moe_workspace
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from engine.model.fast_paths import FP8_EXPERT_MIN_TOKENS, resolve_prefill_expert_format
from engine.model.fp8_expert_weights import convert_expert_weights
from engine.model.moe import MoEBlock
from engine.model.parallel import ParallelContext
from tests.support import numerics as NUM


@pytest.fixture(scope="module")
def small_q(tmp_path_factory):
    """The "small" preset (hidden 256, experts 128 wide: whole 128-blocks) in the release formats."""
    return make_model("small", str(tmp_path_factory.mktemp("fp8x") / "q"), seed=3, quantize=True)


@pytest.mark.parametrize(
    "req,prefill_only,packed,want",
    [
        ("auto", True, True, "mxfp4"),  # CPU: no DeepGEMM
        ("auto", False, True, "mxfp4"),
        ("mxfp4", True, True, "mxfp4"),
        ("fp8", True, True, "fp8"),
        ("fp8", False, True, "both"),
        ("fp8", True, False, "mxfp4"),  # nothing packed to convert
    ],
)
def test_resolve_prefill_expert_format(req, prefill_only, packed, want):
    got, why = resolve_prefill_expert_format(req, "cpu", torch.float32, prefill_only, packed)
    assert got == want and why
    with pytest.raises(ValueError, match="prefill_expert_format"):
        resolve_prefill_expert_format("fp4", "cpu", torch.float32, True, True)


@pytest.mark.parametrize("fmt", ["fp8", "both"])
def test_moe_block_fp8_reference_matches_mxfp4_block(small_q, fmt):
    cfg = ModelConfig.from_model_dir(small_q)
    base = load_weights(small_q, cfg, keep_mxfp4_experts=True, keep_fp8=False)
    conv = dict(base)
    report = convert_expert_weights(conv, cfg, fmt)
    assert report.exact and report.tensors == 3 * cfg.num_layers  # quantised weights: spans are small
    assert ("layers.0.ffn.experts.0.w1.weight" in conv) == (fmt == "both")
    layer = 1
    want_block, got_block = MoEBlock(cfg, dict(base), layer), MoEBlock(cfg, dict(conv), layer)
    assert got_block.fp8 is not None and got_block.mxfp4 == (fmt == "both")
    for t in (5, FP8_EXPERT_MIN_TOKENS):  # "both": decode-sized steps keep MXFP4, larger ones take FP8
        x = NUM.randn(t, cfg.hidden_size, seed=t)
        ids = torch.randint(0, cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(t))
        assert got_block.takes_fp8(x) == (fmt == "fp8" or t >= FP8_EXPERT_MIN_TOKENS)
        NUM.assert_close(got_block.routed(x, ids), want_block.routed(x, ids), torch.float32, loose=True)


@pytest.mark.parametrize("prefill_only", [True, False], ids=["fp8-alone", "both"])
def test_engine_tokens_with_fp8_experts(small_q, prefill_only):
    """The conversion is exact on this checkpoint and the CPU runs the dequantising reference: same greedy tokens."""
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 1]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    want = LLM(small_q, keep_mxfp4_experts=True, prefix_cache=False).generate(prompts, params)
    llm = LLM(small_q, keep_mxfp4_experts=True, prefix_cache=False)
    # LLM takes no prefill_expert_format: the engine itself from load_engine, as a worker builds it
    llm.engine = load_engine(
        small_q,
        keep_mxfp4_experts=True,
        prefix_cache=False,
        prefill_expert_format="fp8",
        warmup_decodes=not prefill_only,
    )
    assert all(m.fp8 is not None and m.mxfp4 == (not prefill_only) for m in llm.engine.model.moe)
    assert "FP8 128x128" in llm.engine.model.fast_paths
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("ctx", [None, ParallelContext(2, 1, True)], ids=["tp1", "tp2-ep-r1"])
def test_fit_check_counts_fp8_experts(small_q, ctx):
    """The header estimate with FP8 experts equals the converted (and sharded) dict's bytes; the experts take 2x
    their MXFP4 bytes plus the 128x128 scales."""
    from engine.model.sharding import shard_weights

    cfg = ModelConfig.from_model_dir(small_q)
    w = load_weights(small_q, cfg, keep_mxfp4_experts=True, keep_fp8=True)
    if ctx is not None:
        w = shard_weights(w, cfg, ctx, torch.float32)
    packed_bytes = sum(t.numel() * t.element_size() for t in w.values())
    convert_expert_weights(w, cfg, "fp8")
    real = sum(t.numel() * t.element_size() for t in w.values())
    from engine.loading.fit_check import loaded_meta

    meta = loaded_meta(small_q, cfg, torch.float32, True, True, fp8_experts=True)
    assert weight_bytes_per_rank(small_q, cfg, ctx, torch.float32, meta=meta) == real
    assert real > packed_bytes
    # tensor parallelism without expert parallelism halves the experts' 128 rows: not whole 128-blocks, refused
    half = shard_weights(
        load_weights(small_q, cfg, keep_mxfp4_experts=True), cfg, ParallelContext(2, 0, False), torch.float32
    )
    with pytest.raises(ValueError, match="128-aligned"):
        convert_expert_weights(half, cfg, "fp8")
    assert activation_reserve(cfg, 2048, 8, True) - activation_reserve(cfg, 2048, 8) == fp8_moe_workspace(cfg, 2048)
