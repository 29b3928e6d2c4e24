"""Speculative decoding across the disaggregated hand-off (tests/support/handoff.py, tcp backend): the prefill engine
runs the MTP layer over each prompt (no drafts for a prefill-only request), the MTP layer's KV moves with the swa
group's ring page, and the decode engine drafts after its first one-token step. Greedy output equals one
non-speculative engine's; the decode side's drafts equal a colocated speculative engine's at the same points
(they would not without the MTP KV: wiping it on import changes them)."""

from __future__ import annotations

import random

import pytest

from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import SchedulerConfig
from engine.execution.speculative import Speculator
from engine.loading.make_model import make_model
from engine.loading.weights import load_weights
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from tests.support.handoff import run_colocated, run_handoff

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_model("tiny", tmp_path_factory.mktemp("spech") / "m", seed=11, mtp_layers=1)
    cfg = ModelConfig.from_model_dir(d)
    return cfg, load_weights(d, cfg, mtp=True)


def _engine(model, k):
    cfg, weights = model
    return EngineCore(
        cfg,
        weights,
        cache_config=CacheConfig(max_requests=8, max_tokens=4096, page_tokens=16, kv_cache_dtype="exact"),
        scheduler_config=SchedulerConfig(max_batch_tokens=2048, max_num_seqs=8),
        decode_mode="eager",
        speculative_tokens=k,
    )


def _prompts(vocab):
    g = random.Random(5)
    return [[g.randrange(2, vocab) for _ in range(n)] for n in (5, 20, 40)]


def _record(monkeypatch) -> dict:
    """Every draft the Speculators make, by (prompt, output length) -> drafts."""
    seen, original = {}, Speculator._keep_drafts

    def draft(self, plans, drafts, q):
        original(self, plans, drafts, q)
        for p in plans:
            req = p.chunk.request
            if req.request_id in self.drafts:
                seen[(tuple(req.prompt), len(req.output))] = self.draft_tokens(req.request_id)

    monkeypatch.setattr(Speculator, "_keep_drafts", draft)
    return seen


def _wipe_mtp_kv_on_import(decode):
    """The hand-off without the MTP layer's KV: its rows of the arriving ring page set to 0 before the request runs."""
    original, group = decode.commit_import, decode.pool.groups["swa"]
    rows = group.spec.page_rows
    mtp_layer = decode.cfg.num_layers

    def commit(request_id):
        page = decode.imports[request_id].pages["swa"][0]
        group.layer(mtp_layer)[page * rows : (page + 1) * rows] = 0
        original(request_id)

    decode.commit_import = commit


def test_handoff_with_speculation_equals_one_engine(model, monkeypatch):
    prompts = _prompts(model[0].vocab_size)
    want = [r.output for r in run_colocated(_engine(model, 0), prompts, PARAMS)]
    seen = _record(monkeypatch)
    run_colocated(_engine(model, 2), prompts, PARAMS)
    colocated, handoff = dict(seen), seen
    handoff.clear()
    decode = _engine(model, 2)
    outs = run_handoff("tcp", _engine(model, 2), decode, prompts, PARAMS, ("spec-prefill", "spec-decode"))
    assert [r.output for r in outs] == want
    assert decode.speculator.stats["drafted"] > 0
    # the decode side never drafts before its first step (it lacks the streams of the last prompt position)
    assert all(n >= 2 for _, n in handoff)
    common = set(colocated) & set(handoff)
    assert len(common) >= 6
    assert {key: handoff[key] for key in common} == {key: colocated[key] for key in common}
    # companion: without the MTP KV of the prompt the decode side's drafts differ
    handoff.clear()
    decode = _engine(model, 2)
    _wipe_mtp_kv_on_import(decode)
    outs = run_handoff("tcp", _engine(model, 2), decode, prompts, PARAMS, ("spec-prefill2", "spec-decode2"))
    assert [r.output for r in outs] == want  # still exact: drafts only change the speed
    common = set(colocated) & set(handoff)
    assert any(handoff[key] != colocated[key] for key in common)


def test_handoff_from_a_prefill_engine_without_speculation_is_refused(model):
    """Cache layouts differ (the MTP layer's rows): the transfer backend refuses the peer, naming the layouts."""
    from kv_transfer.base import TransferError
    from kv_transfer.registry import make_backend

    src, dst = make_backend("tcp", _engine(model, 0).pool), make_backend("tcp", _engine(model, 1).pool)
    try:
        with pytest.raises(TransferError, match="layout"):
            dst.add_peer(src.worker_name, src.metadata())
    finally:
        src.close()
        dst.close()
