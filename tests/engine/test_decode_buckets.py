"""Fixed-shape decode steps (what CUDA graphs replay) compute what the content-sized steps compute.

decode_mode="bucketed" runs engine.model.decode_batch's padded batches eagerly, so the CPU checks the whole
graph path except the capture itself: same tokens and logprobs as decode_mode="eager", the same cache
contents on every request page, and padding rows that touch nothing but the scratch page. On a GPU the
same comparison runs with decode_mode="graphs" (tests/engine/test_gpu_engine.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.execution.cuda_graphs import context_buckets, slot_buckets
from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.loading.make_model import default_model_dir
from engine.loading.weights import load_weights
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from engine.model.decode_batch import DecodeShape, build_decode_step

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


def _engine(model_dir, mode: str, **cache) -> EngineCore:
    cfg = ModelConfig.from_model_dir(model_dir)
    weights = load_weights(model_dir, cfg, dtype=torch.float32, device="cpu")
    return EngineCore(
        cfg, weights, cache_config=CacheConfig(max_requests=8, max_tokens=4096, **cache), decode_mode=mode
    )


def _prompts(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _run_until(engine: EngineCore, prompts, new_tokens: int, steps: int):
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=True)
    ids = [engine.add_request(p, params) for p in prompts]
    events = []
    for _ in range(steps):
        events.extend((e.request_id, e.token_id, e.logprob) for e in engine.step())
    return ids, events


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_bucketed_decode_matches_eager(model_dir, kv_cache_dtype):
    """Prompts of 125-131 tokens cross the first 128-token HCA window and several ratio-4 windows while
    decoding; 5 requests pad to an 8-slot bucket. Tokens, logprobs and cache rows must agree."""
    eager = _engine(model_dir, "eager", kv_cache_dtype=kv_cache_dtype)
    bucketed = _engine(model_dir, "bucketed", kv_cache_dtype=kv_cache_dtype)
    prompts = _prompts([125, 131, 127, 9, 3], eager.cfg.vocab_size, seed=3)
    _, want = _run_until(eager, prompts, new_tokens=40, steps=14)
    _, got = _run_until(bucketed, prompts, new_tokens=40, steps=14)
    assert bucketed.decode_runner.steps >= 10, "the decode steps did not take the fixed-shape path"
    assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
    # fp8: a 1-ulp fp32 difference (other matmul shapes) can move a value across an e4m3 rounding edge.
    tol = TOL if kv_cache_dtype == "auto" else 1e-3
    for (_, _, a), (_, _, b) in zip(got, want):
        if a is not None:
            assert abs(a - b) <= tol
    # Every row a request holds is the same; only the scratch page (0) may differ.
    for name, group in eager.pool.groups.items():
        page_rows = group.spec.page_rows
        a, b = group.tensor[:, page_rows:], bucketed.pool.groups[name].tensor[:, page_rows:]
        if a.dtype == torch.uint8:  # packed rows: nearly all bytes equal (see the rounding note above)
            assert (a != b).float().mean() < 1e-3, name
        else:
            torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=name)


def test_padding_rows_write_only_the_scratch_page(model_dir):
    engine = _engine(model_dir, "bucketed")
    before = {n: g.tensor.clone() for n, g in engine.pool.groups.items()}
    batch = build_decode_step(engine.pool, [], [], [], DecodeShape(4, 256), "cpu")
    engine.model.forward(batch, engine.pool)
    for name, group in engine.pool.groups.items():
        rows = group.spec.page_rows
        assert torch.equal(group.tensor[:, rows:], before[name][:, rows:]), name
    assert any(
        not torch.equal(g.tensor[:, : g.spec.page_rows], before[n][:, : g.spec.page_rows])
        for n, g in engine.pool.groups.items()
    )  # the padding did run and wrote its scratch rows


def test_build_decode_step_rejects_what_does_not_fit(model_dir):
    engine = _engine(model_dir, "bucketed")
    with pytest.raises(ValueError, match="do not fit"):
        build_decode_step(engine.pool, [1, 2, 3], [5, 6, 7], [{}, {}, {}], DecodeShape(2, 256), "cpu")
    with pytest.raises(ValueError, match="position 256"):
        build_decode_step(engine.pool, [1], [256], [{}], DecodeShape(2, 256), "cpu")
    with pytest.raises(ValueError, match="slots >= 1"):
        DecodeShape(0, 256)


def test_buckets():
    assert slot_buckets(1) == [1]
    assert slot_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert slot_buckets(100)[-2:] == [96, 100]
    assert context_buckets(4096) == [256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert context_buckets(300) == [256, 300]
    assert context_buckets(100) == [100]


def test_decode_mode_validation(model_dir):
    with pytest.raises(ValueError, match="decode_mode"):
        _engine(model_dir, "fast")
    with pytest.raises(ValueError, match="CUDA"):
        _engine(model_dir, "graphs")
    assert _engine(model_dir, "auto").decode_mode == "eager"  # CPU


def test_block_tables_rewrite_a_reused_request_id(model_dir):
    """A request id that comes back with other pages (a retry, a new request) must not reuse stale rows."""
    from engine.model.decode_batch import BlockTables

    engine = _engine(model_dir, "bucketed")
    tables = BlockTables(engine.pool, 4, 1024, "cpu")
    first, second = {}, {}
    engine.pool.grow(first, 600)
    engine.pool.grow(second, 600)  # same page counts, other pages
    (row,) = tables.rows_for(["a"], [first])
    assert tables.tables["kv4"][row, 0].item() == first["kv4"][0]
    assert tables.rows_for(["a"], [second]) == [row]
    assert tables.tables["kv4"][row, 0].item() == second["kv4"][0] != first["kv4"][0]
    # More live requests than rows: rows of requests absent from the step are reclaimed.
    rows = tables.rows_for(["b", "c", "d", "e"], [second] * 4)
    assert sorted(rows) == [0, 1, 2, 3]


@pytest.mark.parametrize("name", ["wide_hc4_w16", "heads8_l5"])
def test_bucketed_decode_on_oracle_configs(name, tmp_path):
    """Other shapes (hc 4, windows 16, ratios 8 / 32, 5 layers, 3 hash layers, head dim 16 / 48): the
    padded decode steps still equal content-sized ones."""
    from tests.engine.test_oracle import CONFIGS, _prompts
    from tests.support.oracle import make_hf_checkpoint

    spec = CONFIGS[name]
    model_dir = make_hf_checkpoint(tmp_path / name, seed=spec["seed"], **spec["overrides"])
    eager, bucketed = _engine(model_dir, "eager"), _engine(model_dir, "bucketed")
    prompts = _prompts(spec)[:4]
    _, want = _run_until(eager, prompts, new_tokens=24, steps=30)
    _, got = _run_until(bucketed, prompts, new_tokens=24, steps=30)
    assert bucketed.decode_runner.steps >= 20, "the decode steps did not take the fixed-shape path"
    assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
    assert all(abs(a - b) <= TOL for (_, _, a), (_, _, b) in zip(got, want) if a is not None)
