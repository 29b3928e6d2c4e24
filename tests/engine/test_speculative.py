"""MTP speculative decoding (engine.execution.speculative): greedy output with speculation equals greedy output
without it, token for token (fp32), whatever the drafts are: the checkpoint's random MTP layer (almost always
rejected: rollback), and drafts forced from the known continuation with random corruptions (long accepted runs,
rejections at every depth), over chunked prefill, prefix-cache hits, fp8 caches, EOS / stop tokens and
max_tokens boundaries."""

from __future__ import annotations

import random

import pytest
import torch

from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import SchedulerConfig
from engine.execution.speculative import Speculator
from engine.loading.make_model import make_model
from engine.loading.weights import load_weights
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_model("tiny", tmp_path_factory.mktemp("spec") / "m", seed=11, mtp_layers=1)
    cfg = ModelConfig.from_model_dir(d)
    return cfg, load_weights(d, cfg, mtp=True)


def _engine(model, k, kv="exact", batch_tokens=2048, prefix=True):
    cfg, weights = model
    return EngineCore(
        cfg,
        weights,
        cache_config=CacheConfig(max_requests=8, max_tokens=4096, page_tokens=16, kv_cache_dtype=kv),
        scheduler_config=SchedulerConfig(max_batch_tokens=batch_tokens, max_num_seqs=8),
        decode_mode="eager",
        prefix_cache=prefix,
        speculative_tokens=k,
    )


def _run(engine, prompts, params):
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    while engine.has_work:
        engine.step()
    return [engine.pop_finished(i).to_output() for i in ids]


def _prompts(seed, lens, vocab):
    g = random.Random(seed)
    return [[g.randrange(2, vocab) for _ in range(n)] for n in lens]


def _forced(monkeypatch, refs: dict, corrupt: float, seed: int):
    """Drafts = the known greedy continuation (by prompt), each corrupted with probability `corrupt`."""
    g = random.Random(seed)
    original = Speculator._keep_drafts

    def draft(self, plans, drafts, q):
        original(self, plans, drafts, q)
        for p in plans:
            req = p.chunk.request
            rid = req.request_id
            if rid not in self.drafts:
                continue
            ref = refs[tuple(req.prompt)]
            n = len(req.output)
            want = ref[n : n + len(self.drafts[rid])]
            self.drafts[rid] = [t if g.random() > corrupt else (t + 1) % 512 for t in want] or self.drafts[rid]

    monkeypatch.setattr(Speculator, "_keep_drafts", draft)


CASES = [  # (k, kv cache, batch tokens, corrupt)
    (1, "exact", 2048, 0.2),
    (2, "exact", 7, 0.3),
    (3, "exact", 13, 0.1),
    (3, "fp8", 2048, 0.3),
]


@pytest.mark.parametrize("k,kv,budget,corrupt", CASES)
def test_greedy_output_equals_non_speculative(model, monkeypatch, k, kv, budget, corrupt):
    cfg = model[0]
    prompts = _prompts(k, [1, 5, 17, 33, 40], cfg.vocab_size)
    prompts.append(prompts[3][:32] + [7, 8])  # a prefix-cache hit on the 33-token prompt's first 2 blocks
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 9, 24, 30, 11)]
    base = _run(_engine(model, 0, kv, budget), prompts, params)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, base)}
    # the model's own (random) MTP drafts
    spec = _engine(model, k, kv, budget)
    assert [o.token_ids for o in _run(spec, prompts, params)] == [o.token_ids for o in base]
    assert spec.speculator.stats["drafted"] > 0
    # forced drafts: long accepted runs and rejections at every depth
    _forced(monkeypatch, refs, corrupt, seed=k)
    spec = _engine(model, k, kv, budget)
    outs = _run(spec, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    for o, b in zip(outs, base):
        torch.testing.assert_close(torch.tensor(o.logprobs or []), torch.tensor(b.logprobs or []))
    s = spec.speculator.stats
    assert s["accepted"] > s["drafted"] // 2 and s["accepted"] < s["drafted"]
    # a second pass over the same prompts hits the prefix cache (blocks and snapshots of speculative runs)
    again = _run(spec, prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in base]


def test_stop_tokens_and_eos(model, monkeypatch):
    cfg = model[0]
    prompts = _prompts(9, [6, 21], cfg.vocab_size)
    free = [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 2
    base = _run(_engine(model, 0), prompts, free)
    refs = {tuple(p): o.token_ids for p, o in zip(prompts, base)}
    stops = [SamplingParams(max_new_tokens=20, stop_token_ids=[b.token_ids[5]]) for b in base]
    want = _run(_engine(model, 0), prompts, stops)
    _forced(monkeypatch, refs, 0.0, seed=0)  # every draft right: the stop token arrives mid-verify
    got = _run(_engine(model, 3), prompts, stops)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert all(o.finish_reason == "stop" and len(o.token_ids) <= 6 for o in got)


def test_generate_cli_reports_drafted_and_accepted(tmp_path, capsys):
    import json

    from service.cli import main

    d = make_model("tiny", tmp_path / "m", seed=11, mtp_layers=1)
    args = [
        "generate",
        "--model",
        d,
        "--prompt-ids",
        "5,6,7,8,9",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
        "--kv-cache-dtype",
        "exact",
    ]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out.strip())
    assert main(args + ["--speculative-tokens", "2"]) == 0
    spec = json.loads(capsys.readouterr().out.strip())
    assert spec["token_ids"] == plain["token_ids"] and plain["drafted_tokens"] == 0
    assert spec["drafted_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]


def test_spec_counters_mirror_the_speculator(model):
    """engine.telemetry.metrics.SpecCounters (what a worker publishes): the counters move by the stats' deltas."""
    from prometheus_client import REGISTRY

    from engine.telemetry.metrics import SpecCounters

    def value(name):
        return REGISTRY.get_sample_value(name, {"role": "decode", "worker": "spec-test"})

    counters = SpecCounters("decode", "spec-test")
    assert value("dsv4_spec_draft_tokens_total") == 0
    spec = _engine(model, 2)
    prompts = _prompts(3, [4, 9], model[0].vocab_size)
    _run(spec, prompts, [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 2)
    counters.observe(spec.speculator.stats)
    _run(spec, prompts, [SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)] * 2)
    counters.observe(spec.speculator.stats)
    s = spec.speculator.stats
    assert s["drafted"] > 0
    assert (
        value("dsv4_spec_draft_tokens_total"),
        value("dsv4_spec_accepted_tokens_total"),
        value("dsv4_spec_verify_steps_total"),
    ) == (s["drafted"], s["accepted"], s["verify_chunks"])
