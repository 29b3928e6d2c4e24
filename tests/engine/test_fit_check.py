"""The start-up fit check (engine.loading.fit_check): per-rank weight bytes from the headers equal what the loader and
the sharder really hold; a budget too small is a ValueError with the numbers and what to change; V4-Flash's
release layout against an H200."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.loading.fit_check import check_fit, meta_from_stored, weight_bytes_per_rank
from engine.loading.load import load_engine
from engine.loading.make_model import default_model_dir, make_model
from engine.loading.memory_plan import GIB, activation_reserve, cap_context, pool_bytes
from engine.loading.weights import load_weights
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from engine.model.parallel import ParallelContext
from engine.model.sharding import shard_weights
from tests.support.configs import flash_config
from tests.support.flash_layout import flash_release_layout

H200_GIB = 140.4  # what an H200 reports (143771 MiB)


@pytest.fixture(scope="module")
def quantised(tmp_path_factory):
    """The tiny model in the release formats: FP8 dense projections, MXFP4 experts."""
    out = tmp_path_factory.mktemp("fit") / "q"
    make_model("tiny", str(out), seed=1, quantize=True)
    return str(out)


def _real_bytes(model_dir, dtype, keep, ctx) -> int:
    cfg = ModelConfig.from_model_dir(model_dir)
    w = load_weights(model_dir, cfg, dtype=dtype, keep_mxfp4_experts=keep, keep_fp8=keep)
    if ctx is not None:
        w = shard_weights(w, cfg, ctx, dtype)
    return sum(t.numel() * t.element_size() for t in w.values())


@pytest.mark.parametrize(
    "ctx",
    [None, ParallelContext(2, 0, True), ParallelContext(2, 1, True), ParallelContext(2, 1, False)],
    ids=["tp1", "tp2-ep-r0", "tp2-ep-r1", "tp2-r1"],
)
@pytest.mark.parametrize("keep", [False, True], ids=["dequantised", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_header_estimate_equals_loaded_and_sharded_bytes(quantised, ctx, keep, dtype):
    cfg = ModelConfig.from_model_dir(quantised)
    est = weight_bytes_per_rank(quantised, cfg, ctx, dtype, keep_mxfp4_experts=keep, keep_fp8=keep)
    assert est == _real_bytes(quantised, dtype, keep, ctx)


def _need(model_dir, cfg, cache, max_batch_tokens, ctx=None) -> int:
    return (
        weight_bytes_per_rank(model_dir, cfg, ctx, torch.float32)
        + activation_reserve(cfg, max_batch_tokens, cache.max_requests)
        + pool_bytes(cfg, dataclasses.replace(cache, max_tokens=cfg.max_position_embeddings), torch.float32)
    )


def test_fits_when_the_budget_holds_the_need():
    d = default_model_dir()
    cfg = ModelConfig.from_model_dir(d)
    cache = CacheConfig(max_requests=8, max_tokens=1)
    need = _need(d, cfg, cache, 512)
    fit = check_fit(d, cfg, cache, torch.float32, 512, need)
    assert fit.fits and fit.need_bytes == need and fit.min_cache_tokens == cfg.max_position_embeddings


def test_too_small_a_budget_names_the_numbers_and_the_remedies():
    d = default_model_dir()
    cfg = ModelConfig.from_model_dir(d)
    cache = CacheConfig(max_requests=8, max_tokens=1)
    need = _need(d, cfg, cache, 512)
    with pytest.raises(ValueError) as e:
        check_fit(d, cfg, cache, torch.float32, 512, need - 1, utilization=0.5)
    msg = str(e.value)
    assert "does not fit" in msg and "GiB of weights per rank" in msg and "--gpu-memory-utilization 0.50" in msg
    assert f"{need / GIB:.2f} GiB needed" in msg and f"{(need - 1) / GIB:.2f} GiB available" in msg
    assert "--tensor-parallel-size" in msg and "--expert-parallel" in msg and "--max-model-len" in msg


def test_the_advice_names_the_smallest_group_that_fits():
    d = default_model_dir()
    cfg = ModelConfig.from_model_dir(d)
    cache = CacheConfig(max_requests=8, max_tokens=1)
    tp2 = _need(d, cfg, cache, 512, ParallelContext(2, 0, True))
    with pytest.raises(ValueError, match=re.escape("--tensor-parallel-size 2 --expert-parallel")):
        check_fit(d, cfg, cache, torch.float32, 512, tp2)  # TP 1 needs more; TP 2 + EP fits exactly
    check_fit(d, cfg, cache, torch.float32, 512, tp2, ctx=ParallelContext(2, 0, True))


def test_max_model_len_shrinks_the_minimum_cache():
    d = default_model_dir()
    cfg = ModelConfig.from_model_dir(d)
    cache = CacheConfig(max_requests=8, max_tokens=1)
    full = check_fit(d, cfg, cache, torch.float32, 512, 1 << 40)
    short = check_fit(d, cap_context(cfg, 512), cache, torch.float32, 512, 1 << 40)
    assert short.min_cache_tokens == 512 and short.min_cache_bytes < full.min_cache_bytes
    with pytest.raises(ValueError, match="--max-model-len 99999 must be in"):
        cap_context(cfg, 99999)


def test_load_engine_serves_at_most_max_model_len():
    engine = load_engine(default_model_dir(), max_model_len=64, max_cached_tokens=4096)
    assert engine.cfg.max_position_embeddings == 64
    with pytest.raises(ValueError, match="maximum of 64 positions"):
        engine.validate(list(range(1, 60)), SamplingParams(max_new_tokens=8))


def test_v4_flash_on_h200s():
    """V4-Flash (about 145 GiB as loaded) does not fit one H200 at 0.90 and the advice says TP 2 + EP; at TP 4 +
    EP (the Helm example's layout) it fits with room for the KV pool."""
    cfg = flash_config(quantization_config={"weight_block_size": [128, 128]})
    meta = meta_from_stored(flash_release_layout(cfg), cfg, torch.bfloat16, True, True)
    # No 149 GB checkpoint in CI: its release layout (names, shapes, formats) stands in for the headers.
    cache = CacheConfig(max_requests=256, max_tokens=1, kv_cache_dtype="fp8")
    budget = int(0.90 * H200_GIB * GIB)
    with pytest.raises(ValueError, match=re.escape("--tensor-parallel-size 2 --expert-parallel")) as e:
        check_fit(None, cfg, cache, torch.bfloat16, 16384, budget, None, True, True, meta=meta)
    assert re.search(r"14[0-9]\.\d\d GiB of weights per rank", str(e.value)), str(e.value)
    fit = check_fit(
        None,
        cap_context(cfg, 262144),
        cache,
        torch.bfloat16,
        16384,
        budget,
        ParallelContext(4, 0, True),
        True,
        True,
        meta=meta,
    )
    assert fit.weight_bytes < 40 * GIB and budget - fit.need_bytes > 40 * GIB


def test_when_the_cache_alone_does_not_fit_more_ranks_are_not_advised():
    d = default_model_dir()
    cfg = ModelConfig.from_model_dir(d)
    cache = CacheConfig(max_requests=8, max_tokens=1)
    with pytest.raises(ValueError, match="More ranks would not help") as e:
        check_fit(d, cfg, cache, torch.float32, 512, 1 << 20)  # 1 MiB: less than the reserve
    assert "--tensor-parallel-size" not in str(e.value) and "--max-model-len" in str(e.value)
