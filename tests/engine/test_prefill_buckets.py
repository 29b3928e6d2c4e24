"""Padded prefill steps (what prefill CUDA graphs replay) compute what content-sized steps compute.

prefill_mode="bucketed" runs engine.model.prefill_batch's padded batches eagerly, so the CPU checks the whole
prefill graph path except the capture itself: the same tokens and log-probs as prefill_mode="eager", the same
bytes on every page a request holds (SWA rings, compressor states, 4:1 and 128:1 entries, indexer keys), and padding
that writes nothing but the scratch pages. On a GPU the same comparison runs under graphs
(tests/engine/test_gpu_prefill_graphs.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.execution.prefill_graphs import padded_inputs
from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import SchedulerConfig
from engine.loading.make_model import default_model_dir
from engine.loading.weights import load_weights
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from engine.model.prefill_batch import PrefillShape, context_buckets, pad_step, signature, token_buckets

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


def _engine(model_dir, mode: str, budget: int, prefix_cache=False, **cache) -> EngineCore:
    cfg = ModelConfig.from_model_dir(model_dir)
    weights = load_weights(model_dir, cfg, dtype=torch.float32, device="cpu")
    return EngineCore(
        cfg,
        weights,
        cache_config=CacheConfig(max_requests=8, max_tokens=4096, **cache),
        scheduler_config=SchedulerConfig(max_batch_tokens=budget, max_num_seqs=8),
        decode_mode="eager",
        prefill_mode=mode,
        prefill_min_tokens=16,
        prefix_cache=prefix_cache,
    )


def _prompts(lens, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _run(engine: EngineCore, prompts, new_tokens: int):
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=True)
    for p in prompts:
        engine.add_request(p, params)
    events = []
    while engine.has_work:
        events.extend((e.request_id, e.token_id, e.logprob) for e in engine.step())
    return events


def _pages_equal(a: EngineCore, b: EngineCore) -> None:
    """Every page but the scratch one (page 0: engine.model.cache) holds the same values (packed fp8 pages: nearly
    all bytes; a last-bit fp32 difference can move a value across an e4m3 rounding edge)."""
    for name, group in a.pool.groups.items():
        rows = group.spec.page_rows
        x, y = group.tensor[:, rows:], b.pool.groups[name].tensor[:, rows:]
        if x.dtype == torch.uint8:
            assert (x != y).float().mean() < 1e-3, name
        else:
            torch.testing.assert_close(y, x, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize(
    "kv_cache_dtype,lens,budget",
    [
        # One request a step: chunks of 48 (a bucket of 64: 16 padding tokens), the last one short; 200 tokens cross
        # the first 128-token HCA window and 50 ratio-4 windows, a chunk ending mid-window.
        ("auto", [200], 48),
        ("auto", [131], 50),  # a budget that is no power of two: the last bucket is 50, the chunks fill it
        # Several requests a step, prompts of no bucket size, decode tokens of finished prefills beside the chunks
        ("auto", [37, 130, 9, 77, 3], 40),
        ("fp8", [37, 130, 9, 77, 3], 40),
        ("fp8", [200], 48),
    ],
)
def test_padded_prefill_matches_eager(model_dir, kv_cache_dtype, lens, budget):
    eager = _engine(model_dir, "eager", budget, kv_cache_dtype=kv_cache_dtype)
    padded = _engine(model_dir, "bucketed", budget, kv_cache_dtype=kv_cache_dtype)
    assert eager.prefill_runner is None and padded.prefill_runner is not None
    prompts = _prompts(lens, eager.cfg.vocab_size, seed=len(lens) + budget)
    want = _run(eager, prompts, new_tokens=3)
    got = _run(padded, prompts, new_tokens=3)
    assert padded.prefill_runner.steps >= -(-sum(lens) // budget), "the prefill steps did not take the padded path"
    assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
    assert all(abs(a - b) <= TOL for (_, _, a), (_, _, b) in zip(got, want) if a is not None)
    # Not bitwise: the padding tokens join routed experts' groups, and the reference's per-expert GEMMs round a
    # row differently at another row count (M = 1 vs 2 in fp32 on the CPU), so values agree to the last bits only.
    _pages_equal(eager, padded)


def test_padded_prefill_with_prefix_cache(model_dir):
    """Prefix-cache snapshots kept inside a padded chunk (staging-page writes beside the ring writes) and requests
    resuming from a cached prefix (a first chunk that starts mid-prompt, reading restored rings): same tokens and
    log-probs as the eager engine with the same cache, and the hits happen."""
    from engine.execution.prefix_cache import STAGING_PAGES, PrefixCacheConfig

    config = PrefixCacheConfig(snapshot_interval=64)
    # 128-token blocks (page_tokens 128: one kv128 row a page), snapshot points every block; 200-token chunks
    cache = dict(staging_pages=STAGING_PAGES, page_tokens=128)
    eager = _engine(model_dir, "eager", 200, config, **cache)
    padded = _engine(model_dir, "bucketed", 200, config, **cache)
    runner = padded.prefill_runner
    seen = []
    run = runner.run
    runner.run = lambda ids, starts, tables, snaps=None: (
        seen.append(any(snaps or ())) or run(ids, starts, tables, snaps)
    )
    (shared,) = _prompts([200], eager.cfg.vocab_size, seed=21)
    tails = _prompts([37, 90, 5], eager.cfg.vocab_size, seed=22)
    prompts = [shared + tails[0], shared + tails[1], shared[:150] + tails[2]]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=True)
    out = []
    for engine in (eager, padded):
        events = []
        for p in prompts:  # one after another: each sees the cache the previous ones left
            engine.add_request(p, params)
            while engine.has_work:
                events.extend(engine.step())
        out.append(events)
    want, got = out
    assert any(seen), "no padded step kept an in-step snapshot"
    assert [e.cached_tokens for e in got] == [e.cached_tokens for e in want] and max(
        e.cached_tokens for e in got
    ) >= 128
    assert [(e.request_id, e.token_id) for e in got] == [(e.request_id, e.token_id) for e in want]
    assert all(abs(a.logprob - b.logprob) <= TOL for a, b in zip(got, want) if a.logprob is not None)


def test_padding_writes_only_scratch_pages(model_dir):
    """A step of padding only (what capture and its warm-up run) changes nothing but the scratch pages; so does a
    real step's padding: pages held by no request stay as they were."""
    engine = _engine(model_dir, "bucketed", 64)
    before = {n: g.tensor.clone() for n, g in engine.pool.groups.items()}
    pad = pad_step(engine.pool, PrefillShape(64, 4, 256), [], [], [])
    engine.model.forward(pad.batch("cpu"), engine.pool)
    for name, group in engine.pool.groups.items():
        rows = group.spec.page_rows
        assert torch.equal(group.tensor[:, rows:], before[name][:, rows:]), name
    assert any(
        not torch.equal(g.tensor[:, : g.spec.page_rows], before[n][:, : g.spec.page_rows])
        for n, g in engine.pool.groups.items()
    )  # the padding did run and wrote its scratch rows

    # A real request's step, padded (37 tokens in a 64-token bucket): only its pages and the scratch ones change.
    pages: dict = {}
    engine.pool.grow(pages, 300)
    before = {n: g.tensor.clone() for n, g in engine.pool.groups.items()}
    inputs = padded_inputs(engine.prefill_runner, [list(range(1, 38))], [0], [pages])
    assert inputs is not None
    engine.model.forward(inputs.batch("cpu"), engine.pool)
    for name, group in engine.pool.groups.items():
        rows, mine = group.spec.page_rows, set(pages.get(name, ()))
        # [layers, pages x page rows, ...]: page p is rows p * page_rows.. of dim 1
        others = [
            r for p in range(1, group.tensor.shape[1] // rows) if p not in mine for r in range(p * rows, (p + 1) * rows)
        ]
        assert torch.equal(group.tensor[:, others], before[name][:, others]), name
        assert not torch.equal(group.tensor, before[name]), name  # the request's own pages were written


def test_same_shape_same_layout(model_dir):
    """Two steps of one bucket upload alike (a graph's static buffer takes either), whatever their contents."""
    engine = _engine(model_dir, "bucketed", 64)
    a, b = {}, {}
    engine.pool.grow(a, 500)
    engine.pool.grow(b, 300)
    shape = PrefillShape(64, 4, 256)
    one = pad_step(engine.pool, shape, [[5] * 40], [100], [a])
    two = pad_step(engine.pool, shape, [[1] * 3, [2] * 20, [3]], [0, 7, 250], [a, b, b])
    empty = pad_step(engine.pool, shape, [], [], [])
    assert signature(one.host.arrays) == signature(two.host.arrays) == signature(empty.host.arrays)
    snap = pad_step(engine.pool, shape, [[4] * 60], [0], [a], [(40, {"swa": 1})])  # an in-step snapshot
    assert signature(snap.host.arrays) == signature(one.host.arrays)
    # the static layout: the upload's bytes have one size per shape
    assert one.upload("cpu")[1].numel() == two.upload("cpu")[1].numel()
    # the real rows' logit rows: each request's last token
    assert two.host.arrays["logit_rows"][:3].tolist() == [2, 22, 23]


def test_shapes(model_dir):
    assert token_buckets(512, 8192) == [512, 1024, 2048, 4096, 8192]
    assert token_buckets(500, 3000) == [512, 1024, 2048, 3000]
    assert token_buckets(512, 300) == [300]
    assert context_buckets(1024, 4096) == [1024, 1536, 2048, 3072, 4096]
    assert context_buckets(1024, 3000) == [1024, 1536, 2048, 3000]
    assert context_buckets(1024, 1000) == [1024]
    with pytest.raises(ValueError, match="slots < tokens"):
        PrefillShape(4, 4, 4)
    runner = _engine(model_dir, "bucketed", 64).prefill_runner
    assert runner.tokens == [16, 32, 64]
    assert runner.shape_for([64], [64]) == PrefillShape(64, 1, 64)  # fills its bucket: no padding row
    assert runner.shape_for([37], [37]) == PrefillShape(64, 2, 64)
    assert runner.shape_for([37], [300]) == PrefillShape(64, 2, 384)
    assert runner.shape_for([37], [4000]) == PrefillShape(64, 2, 4096)  # the model's last position
    assert runner.shape_for([10, 1, 1], [10, 50, 9]) == PrefillShape(16, 4, 64)
    assert runner.shape_for([65], [65]) is None  # past the step budget: eager
    assert runner.shape_for([1] * 9, [1] * 9) is None  # more requests than rows
    assert runner.shape_for([8], [4097]) is None  # past the model's positions


def test_eager_fallbacks(model_dir):
    """Prompt log-probs stay on the content-sized path (its logit rows are per token), with the same results."""
    eager = _engine(model_dir, "eager", 48)
    padded = _engine(model_dir, "bucketed", 48)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    (prompt,) = _prompts([70], eager.cfg.vocab_size, seed=9)
    out = []
    for e in (eager, padded):
        e.add_request(prompt, params, request_id="a")
        events = []
        while e.has_work:
            events.extend(e.step())
        out.append(([ev.token_id for ev in events], [p for ev in events for p in ev.prompt_logprobs]))
    assert padded.prefill_runner.steps == 0
    assert out[0][0] == out[1][0] and len(out[0][1]) == 69
    assert np.allclose(out[0][1], out[1][1], atol=TOL)


def test_prefill_mode_validation(model_dir):
    with pytest.raises(ValueError, match="prefill_mode"):
        _engine(model_dir, "fast", 64)
    with pytest.raises(ValueError, match="CUDA"):
        _engine(model_dir, "graphs", 64)
    assert _engine(model_dir, "auto", 64).prefill_runner is None  # CPU: eager


@pytest.mark.parametrize("name", ["wide_hc4_w16", "real128", "csa_hca16_yarn"])
def test_padded_prefill_on_oracle_configs(name, tmp_path):
    """Other shapes (hc 4, window 16, ratios 8 / 16 / 128, YaRN, hash layers, head dims 16 / 48) and the oracle
    tests' chunk budgets (13, 61: no power of two), prompts run together: padded steps equal content-sized ones."""
    from tests.engine.test_oracle import CONFIGS
    from tests.engine.test_oracle import _prompts as oracle_prompts
    from tests.support.oracle import make_hf_checkpoint

    spec = CONFIGS[name]
    model_dir = make_hf_checkpoint(tmp_path / name, seed=spec["seed"], **spec["overrides"])
    budget = spec["max_batch_tokens"]
    eager, padded = _engine(model_dir, "eager", budget), _engine(model_dir, "bucketed", budget)
    prompts = oracle_prompts(spec)
    want, got = _run(eager, prompts, new_tokens=4), _run(padded, prompts, new_tokens=4)
    assert padded.prefill_runner.steps >= 1, "the prefill steps did not take the padded path"
    assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in want]
    assert all(abs(a - b) <= TOL for (_, _, a), (_, _, b) in zip(got, want) if a is not None)
    _pages_equal(eager, padded)
