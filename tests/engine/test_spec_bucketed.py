"""Speculation through fixed-shape verify steps (engine.execution.verify_graphs, engine.model.verify_batch) and the
drafting policy (engine.execution.spec_policy): greedy output equals non-speculative output token for token (fp32,
eager bucketed mode: the shapes CUDA graphs replay), with drafts forced from the known continuation so long
accepted runs and rejections at every depth occur; the GPU test pins graphs against eager bucketed steps."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import SchedulerConfig
from engine.execution.spec_policy import SpecGate, SpecPolicy
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from engine.telemetry.metrics import SpecCounters
from tests.engine.test_speculative import _forced, _prompts, _run
from tests.engine.test_speculative import model as model  # noqa: F401 (the module fixture)


def _engine(
    model, k, kv="exact", mode="bucketed", policy=None, budget=2048, device="cpu", dtype=torch.float32, overlap=None
):
    cfg, weights = model
    return EngineCore(
        cfg,
        weights,
        device=device,
        dtype=dtype,
        cache_config=CacheConfig(max_requests=8, max_tokens=4096, page_tokens=16, kv_cache_dtype=kv),
        scheduler_config=SchedulerConfig(max_batch_tokens=budget, max_num_seqs=8),
        decode_mode=mode,
        overlap_decode=overlap,
        prefix_cache=True,
        speculative_tokens=k,
        speculative_policy=policy or SpecPolicy(max_batch=8),
    )


def _case(model, seed):
    cfg = model[0]
    prompts = _prompts(seed, [1, 5, 17, 33, 40], cfg.vocab_size)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 9, 24, 30, 11)]
    return prompts, params


@pytest.mark.parametrize(
    "k,kv,corrupt,budget",
    [
        (1, "exact", 0.2, 2048),
        (2, "exact", 0.3, 2048),
        (2, "exact", 0.3, 7),
        (1, "fp8", 0.3, 2048),
        (2, "fp8", 0.2, 2048),
    ],
)
def test_bucketed_verify_equals_non_speculative(model, monkeypatch, k, kv, corrupt, budget):
    """budget 7: chunked prefill, so steps mixing prefill with decode take the varlen path between bucketed ones."""
    prompts, params = _case(model, k)
    base = _run(_engine(model, 0, kv, mode="eager"), prompts, params)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, base)}
    _forced(monkeypatch, refs, corrupt, seed=k)
    spec = _engine(model, k, kv, budget=budget)
    outs = _run(spec, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    for o, b in zip(outs, base):
        torch.testing.assert_close(torch.tensor(o.logprobs or []), torch.tensor(b.logprobs or []))
    s = spec.speculator.stats
    assert spec.speculator.verify.steps > 0  # the fixed-shape path ran
    assert s["accepted"] > s["drafted"] // 2 and s["accepted"] < s["drafted"]


def test_policy_turns_drafting_off_above_the_batch_and_back_on(model, monkeypatch):
    """5 requests, max_batch 2: no drafts while more than 2 decode; as they finish (2, 9, 11, 24, 30 tokens) the
    batch drops to 2 and drafting resumes from a complete MTP KV; the output is the non-speculative one."""
    prompts, params = _case(model, 5)
    base = _run(_engine(model, 0, mode="eager"), prompts, params)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, base)}
    _forced(monkeypatch, refs, 0.2, seed=5)
    spec = _engine(model, 2, policy=SpecPolicy(max_batch=2))
    ids = [spec.add_request(p, q) for p, q in zip(prompts, params)]
    drafted_at = []  # (decoding requests, drafts made) after each step
    while spec.has_work:
        spec.step()
        drafted_at.append((len(spec.scheduler.running), len(spec.speculator.drafts)))
    outs = [spec.pop_finished(i).to_output() for i in ids]
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert all(d == 0 for n, d in drafted_at if n > 2)
    assert any(d > 0 for n, d in drafted_at if n <= 2)
    assert spec.speculator.stats["undrafted_steps"] > 0 and spec.speculator.stats["accepted"] > 0
    counters = SpecCounters("decode", "gate-test")  # what the worker exports: the paused steps, counted
    counters.observe(spec.speculator.stats)
    labels = {"role": "decode", "worker": "gate-test"}
    paused = REGISTRY.get_sample_value("dsv4_spec_undrafted_steps_total", labels)
    assert paused == spec.speculator.stats["undrafted_steps"]
    # max_batch 0: never drafts, output unchanged
    never = _engine(model, 2, policy=SpecPolicy(max_batch=0))
    assert [o.token_ids for o in _run(never, prompts, params)] == [o.token_ids for o in base]
    assert never.speculator.stats["drafted"] == 0


def test_acceptance_floor_pauses_and_probes():
    gate = SpecGate(SpecPolicy(max_batch=4, min_acceptance=0.5, decay=0.0, probe_every=3))
    assert gate.should_draft(1) and not gate.should_draft(5)
    gate.observe(4, 0)  # acceptance 0 < 0.5: paused, a probe every 3rd step
    assert [gate.should_draft(1) for _ in range(6)] == [False, False, True, False, False, True]
    gate.observe(2, 2)
    assert gate.should_draft(1)


def test_measured_rates_pause_drafting_where_it_loses_and_probe():
    gate = SpecGate(SpecPolicy(max_batch=64, decay=0.0, probe_every=4, compare_rates=True))
    # nothing measured yet: draft, and every 4th step of a batch bucket runs a plain step to measure it
    assert [gate.should_draft(1) for _ in range(4)] == [True, True, True, False]
    gate.observe_rate(1, True, 2, 0.004)  # 500 tokens/s with drafts
    gate.observe_rate(1, False, 1, 0.0014)  # 714 tokens/s without: drafting loses at bucket 1
    assert [gate.should_draft(1) for _ in range(4)] == [False, False, False, True]  # paused; the 4th probes
    assert gate.should_draft(16)  # bucket 16 (9..16 requests) is measured on its own
    gate.observe_rate(1, True, 2, 0.002)  # 1000 tokens/s (decay 0: the newest sample): drafting pays again
    assert gate.should_draft(1)
    gate.observe_rate(1, True, 2, 1.0)  # an interval far past its mode's average (the loop idled): ignored
    assert gate.rates[(1, True)] == pytest.approx(1000.0)
    gate.observe_rate(2, False, 2, 0.5)  # a first plain sample at bucket 2 that stalled (4 tokens/s) ...
    gate.observe_rate(2, False, 2, 0.002)  # ... is replaced by the first normal one, not averaged with it
    assert gate.rates[(2, False)] == pytest.approx(1000.0)


def test_rate_gate_switching_modes_keeps_output_exact(model, monkeypatch):
    """compare_rates with a probe every 2nd step: drafting and plain steps alternate by measured (CPU) rates, and
    the greedy output is still the non-speculative one (the MTP KV stays complete while drafts pause)."""
    prompts, params = _case(model, 7)
    base = _run(_engine(model, 0, mode="eager"), prompts, params)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, base)}
    _forced(monkeypatch, refs, 0.2, seed=7)
    spec = _engine(model, 2, policy=SpecPolicy(max_batch=8, probe_every=2, compare_rates=True))
    assert [o.token_ids for o in _run(spec, prompts, params)] == [o.token_ids for o in base]
    gate, stats = spec.speculator.gate, spec.speculator.stats
    assert {drafted for _, drafted in gate.rates} == {True, False}  # both modes were measured
    assert stats["drafted"] > 0 and stats["undrafted_steps"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: CUDA graphs of verify steps")
@pytest.mark.parametrize("k", [1, 2])
def test_graph_verify_steps_equal_eager_bucketed(tmp_path, monkeypatch, k):
    """bf16 on CUDA (graphs need it): the graph verify steps give the tokens the eager bucketed steps give (forced
    drafts: accepted runs and rejections), and the warm-up captured every verify bucket the run used."""
    from engine.execution.warmup import warm_engine
    from engine.loading.make_model import make_model
    from engine.loading.weights import load_weights

    d = make_model("tiny", tmp_path / "m", seed=11, mtp_layers=1)
    cfg = ModelConfig.from_model_dir(d)
    gpu = (cfg, load_weights(d, cfg, dtype=torch.bfloat16, device="cuda", mtp=True))
    prompts, params = _case(gpu, 7)
    # (not overlapped: an overlapped step takes its drafts on the device, where the forcing below does not reach)
    graphs = _engine(gpu, k, mode="graphs", device="cuda", dtype=torch.bfloat16, overlap=False)
    warm_engine(graphs, sweep_gemms=False, decodes=True)  # before forcing: its prompts have no reference
    want = _run(_engine(gpu, 0, mode="bucketed", device="cuda", dtype=torch.bfloat16), prompts, params)
    _forced(monkeypatch, {tuple(p): o.token_ids for p, o in zip(prompts, want)}, 0.3, seed=k)
    eager = _engine(gpu, k, device="cuda", dtype=torch.bfloat16)
    bucketed = [o.token_ids for o in _run(eager, prompts, params)]
    captured = len(graphs.speculator.verify.graphs)
    assert captured > 0
    assert [o.token_ids for o in _run(graphs, prompts, params)] == bucketed
    assert len(graphs.speculator.verify.graphs) == captured  # nothing captured while serving
    assert graphs.speculator.verify.steps > 0 and graphs.speculator.stats["accepted"] > 0


def test_one_query_verify_batch_is_the_decode_batch(model):
    """queries = 1: derive_verify_batch gives derive_decode_batch_reference's tensors (the decode step's indices)."""
    from dataclasses import fields

    from engine.model.decode_batch import DecodeInputs, DecodeShape, derive_decode_batch_reference
    from engine.model.verify_batch import VerifyInputs, VerifyShape, derive_verify_batch

    engine = _engine(model, 1)
    pool, tables = engine.pool, engine.speculator.verify.decode.block_tables
    pages = [
        {name: [1 + b + 3 * i for i in range(1 if g.spec.fixed else 3)] for name, g in pool.groups.items()}
        for b in range(3)
    ]
    rows = tables.rows_for(["a", "b", "c"], pages)
    shape = DecodeShape(4, 256)
    tokens, positions = [5, 6, 7], [3, 40, 127]
    dec = derive_decode_batch_reference(
        pool, tables, DecodeInputs.make(tokens, positions, rows, shape, tables.pad_row), shape
    )
    ver = derive_verify_batch(
        pool,
        tables,
        VerifyInputs.make([[t] for t in tokens], positions, rows, VerifyShape(shape, 1), tables.pad_row).packed,
        VerifyShape(shape, 1),
    )

    def same(a, b, where):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), where
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif hasattr(a, "__dataclass_fields__"):
            for f in fields(a):
                same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        else:
            assert a == b, where

    same(dec, ver, "batch")
