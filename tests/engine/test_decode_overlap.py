"""Overlapped decode (engine.execution.decode_overlap), greedy and sampled: launching step N+1 from step N's device tokens before the host
reads them gives exactly the synchronous engine's tokens, log-probs and events, drops the token a finished or
aborted request already ran, and returns every page only after the step that may still write it.

decode_mode="bucketed" runs the graph path's fixed-shape steps without graphs, so the CPU checks all of the
bookkeeping (on the CPU a launch simply runs to completion); the GPU runs it under graphs in
tests/engine/test_gpu_engine.py's graphs-vs-eager comparison (overlap is on by default there)."""

from __future__ import annotations

import pytest
import torch

from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import SchedulerConfig
from engine.loading.make_model import default_model_dir
from engine.loading.weights import load_weights
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig


@pytest.fixture(scope="module")
def weights():
    model_dir = default_model_dir()
    cfg = ModelConfig.from_model_dir(model_dir)
    return cfg, load_weights(model_dir, cfg, dtype=torch.float32, device="cpu")


def _engine(weights, overlap: bool, prefix: bool = False) -> EngineCore:
    cfg, w = weights
    return EngineCore(
        cfg,
        w,
        cache_config=CacheConfig(max_requests=8, max_tokens=4096),
        scheduler_config=SchedulerConfig(max_batch_tokens=64, max_num_seqs=8),
        decode_mode="bucketed",
        prefix_cache=prefix,
        overlap_decode=overlap,
    )


def _spy_lookahead(monkeypatch, engine: EngineCore) -> list:
    """Count the steps launched before their predecessor was read (the overlap actually taken)."""
    launched = []
    real = engine._launch_decode

    def spy(chunks, previous):
        out = real(chunks, previous)
        if previous is not None and out is not None:
            launched.append(len(chunks))
        return out

    monkeypatch.setattr(engine, "_launch_decode", spy)
    return launched


def _run(engine: EngineCore, jobs, arrivals=None, abort_at=None):
    """jobs: [(prompt, SamplingParams)]; arrivals: {step: [(prompt, params)]} added before that step;
    abort_at: {step: job index}. -> (events per request id, request ids in job order)."""
    ids = [engine.add_request(p, sp) for p, sp in jobs]
    events: dict[str, list] = {}
    step = 0
    while engine.has_work:
        for p, sp in (arrivals or {}).get(step, []):
            ids.append(engine.add_request(p, sp))
        if abort_at and step in abort_at:
            engine.abort(ids[abort_at[step]])
        for e in engine.step():
            events.setdefault(e.request_id, []).append(e)
        step += 1
        assert step < 500, "the engine did not drain"
    return events, ids


def _prompts(cfg, lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]


def _summary(events, ids):
    out = []
    for rid in ids:
        evs = events.get(rid, [])
        sampled = [e for e in evs if e.token_id is not None]
        out.append(
            (
                [e.token_id for e in sampled],
                [e.logprob for e in sampled],
                [e.finished for e in evs],
                evs[-1].finish_reason if evs else None,
            )
        )
    return out


def _assert_same(got, want, tol: float = 0.0):
    assert len(got) == len(want)
    for (gt, gl, gf, gr), (wt, wl, wf, wr) in zip(got, want):
        assert (gt, gf, gr) == (wt, wf, wr)
        assert all(abs(a - b) <= tol for a, b in zip(gl, wl) if a is not None), (gl, wl)


def test_overlapped_decode_is_bit_exact_without_arrivals(weights, monkeypatch):
    """The same requests from the start: every step batches the same rows, so every log-prob is bit-equal;
    every decode step is launched ahead except the first and those after which a request has one token left."""
    cfg, _ = weights
    prompts = _prompts(cfg, [5, 40, 131, 9, 17], seed=11)
    jobs = [
        (p, SamplingParams(max_new_tokens=n, temperature=0, logprobs=True)) for p, n in zip(prompts, (12, 7, 20, 3, 15))
    ]
    want, wids = _run(_engine(weights, overlap=False), jobs)
    fast = _engine(weights, overlap=True)
    launched = _spy_lookahead(monkeypatch, fast)
    got, gids = _run(fast, jobs)
    _assert_same(_summary(got, gids), _summary(want, wids))
    assert len(launched) >= 10, f"the overlap was taken on {len(launched)} steps only"


def test_overlapped_decode_equals_synchronous(weights, monkeypatch):
    """Mixed lengths (requests reach max_new_tokens on different steps), a stop id hit mid-stream, a request
    arriving during decode (the overlap drains and resumes), a sampled request among greedy ones: every
    event equal, and the overlap was taken on most decode steps."""
    cfg, _ = weights
    prompts = _prompts(cfg, [5, 40, 131, 9, 17], seed=11)
    greedy = [SamplingParams(max_new_tokens=n, temperature=0, logprobs=True) for n in (12, 7, 20, 3, 15)]
    # a stop id that request 0 samples mid-stream: take its synchronous output first
    probe, pids = _run(_engine(weights, overlap=False), [(prompts[0], greedy[0])])
    stop_tok = _summary(probe, pids)[0][0][5]
    greedy[0] = SamplingParams(max_new_tokens=12, temperature=0, logprobs=True, stop_token_ids=(stop_tok,))
    jobs = list(zip(prompts, greedy))
    arrivals = {
        6: [(prompts[1][:11], SamplingParams(max_new_tokens=6, temperature=0))],
        9: [(prompts[2][:7], SamplingParams(max_new_tokens=5, temperature=0.8, seed=3))],
    }

    want, wids = _run(_engine(weights, overlap=False), jobs, arrivals)
    fast = _engine(weights, overlap=True)
    launched = _spy_lookahead(monkeypatch, fast)
    got, gids = _run(fast, jobs, arrivals)
    # A request added while a step is launched joins one step later than on the synchronous engine (as with
    # vLLM's async scheduling), so some steps batch other rows: fp32 log-probs may move in the last bits.
    _assert_same(_summary(got, gids), _summary(want, wids), tol=1e-5)
    assert _summary(got, gids)[0][3] == "stop" and len(_summary(got, gids)[0][0]) == 6
    assert len(launched) >= 5, f"the overlap was taken on {len(launched)} steps only"
    assert fast.pool.num_free_pages() == fast.pool.idle_free_pages()  # every page back, deferred ones included


def test_overlapped_sampled_decode_draws_the_synchronous_tokens(weights, monkeypatch):
    """Seeded sampled requests (plain temperature, top-p, top-k, one greedy among them): a step launched before
    its predecessor is read draws each token with the index it will have, so every token and log-prob equals the
    synchronous engine's, bit for bit, and the overlap is taken."""
    cfg, _ = weights
    prompts = _prompts(cfg, [6, 33, 70, 12], seed=5)
    # ignore_eos: a sampled EOS would end a request one launched step late, and the rows batched with it in that
    # step could then move in the last bits (as with an arrival, in the test above); here every step batches alike
    params = [
        SamplingParams(max_new_tokens=14, temperature=1.0, seed=21, logprobs=True, ignore_eos=True),
        SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, seed=22, logprobs=True, ignore_eos=True),
        SamplingParams(max_new_tokens=17, temperature=1.3, top_k=5, seed=23, logprobs=True, ignore_eos=True),
        SamplingParams(max_new_tokens=11, temperature=0, logprobs=True, ignore_eos=True),
    ]
    jobs = list(zip(prompts, params))
    want, wids = _run(_engine(weights, overlap=False), jobs)
    fast = _engine(weights, overlap=True)
    launched = _spy_lookahead(monkeypatch, fast)
    got, gids = _run(fast, jobs)
    _assert_same(_summary(got, gids), _summary(want, wids))
    assert len(launched) >= 6, f"the overlap was taken on {len(launched)} steps only"
    again, aids = _run(
        _engine(weights, overlap=True),
        [(prompts[0], SamplingParams(max_new_tokens=14, temperature=1.0, seed=99, logprobs=True, ignore_eos=True))],
    )
    assert _summary(again, aids)[0][0] != _summary(got, gids)[0][0]  # the draws follow the seed


def test_abort_during_a_launched_step_drops_its_token_and_frees_after(weights, monkeypatch):
    """An abort between steps hits a request whose next step is already launched: no token of it is reported
    after the abort, its pages stay out of the pool while that step is unread, and all return at the end."""
    cfg, _ = weights
    prompts = _prompts(cfg, [9, 12, 20], seed=4)
    jobs = [(p, SamplingParams(max_new_tokens=16, temperature=0)) for p in prompts]
    eng = _engine(weights, overlap=True)
    launched = _spy_lookahead(monkeypatch, eng)
    ids = [eng.add_request(p, sp) for p, sp in jobs]
    seen: dict[str, int] = {}
    while not launched:  # run until a step is launched ahead of its predecessor's read-back
        for e in eng.step():
            seen[e.request_id] = seen.get(e.request_id, 0) + (e.token_id is not None)
    assert eng._launched is not None
    before = eng.pool.num_free_pages()
    eng.abort(ids[1])
    assert eng.pool.num_free_pages() == before, "pages came back while a launched step may write them"
    after_abort = []
    while eng.has_work:
        after_abort += eng.step()
    assert all(e.request_id != ids[1] for e in after_abort)
    assert {e.request_id for e in after_abort if e.finished} == {ids[0], ids[2]}
    assert eng.pool.num_free_pages() == eng.pool.idle_free_pages()


def test_prefix_cache_snapshots_are_not_overlapped(weights, monkeypatch):
    """With the prefix cache on, a step after which a request stands on a block boundary (where completing the
    step may snapshot its state) is never followed by a launched step; the outputs still equal the
    synchronous engine's, and a second identical request hits the cache the first one filled."""
    cfg, _ = weights
    eng_sync, eng = _engine(weights, overlap=False, prefix=True), _engine(weights, overlap=True, prefix=True)
    block = eng.prefix.block
    starts = []
    real = eng._launch_decode

    def spy(chunks, previous):
        if previous is not None:
            starts.extend(c.start for c in chunks)
        return real(chunks, previous)

    monkeypatch.setattr(eng, "_launch_decode", spy)
    prompt = _prompts(cfg, [block - 3], seed=8)[0]
    sp = SamplingParams(max_new_tokens=block + 6, temperature=0, logprobs=True)
    want, wids = _run(eng_sync, [(prompt, sp)])
    got, gids = _run(eng, [(prompt, sp)])
    assert _summary(got, gids) == _summary(want, wids)
    assert starts and all(s % block != 0 for s in starts), "a step was launched past a snapshot point"


def test_deferred_frees_return_on_release(weights):
    eng = _engine(weights, overlap=False)
    pool = eng.pool
    idle = pool.num_free_pages()
    table: dict = {}
    pool.grow(table, 300)
    taken = pool.num_free_pages()
    pool.defer_frees()
    pool.free(table)
    assert table == {} and pool.num_free_pages() == taken
    pool.release_deferred_frees()
    assert pool.num_free_pages() == idle


def test_import_after_abort_gets_the_pages_a_launched_step_held(weights, monkeypatch):
    """Pages of requests aborted while a step is launched are held back until it completes; a KV import that
    needs them must not fail: the engine waits for the launched step and takes them (the decode worker's
    reserve path, and the slice bench that aborts one batch and imports the next)."""
    cfg, _ = weights
    eng = _engine(weights, overlap=True)
    idle_tokens = eng.pool.free_tokens()
    launched = _spy_lookahead(monkeypatch, eng)
    ids = [
        eng.add_request(p, SamplingParams(max_new_tokens=64, temperature=0))
        for p in _prompts(cfg, [1200, 1000, 900], seed=5)
    ]
    while not launched:
        eng.step()
    for rid in ids:
        eng.abort(rid)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    prompt = _prompts(cfg, [min(idle_tokens, cfg.max_position_embeddings) - 96], seed=6)[0]
    assert eng.pool.free_tokens() < len(prompt) + 8 <= idle_tokens, "the aborted requests' pages are held back"
    pages = eng.reserve_import(prompt, params, "imp", seed=0, first_token=3, first_logprob=0.0)
    assert pages and not eng.pool.has_deferred_frees
    eng.abort("imp")
    while eng.has_work:
        eng.step()
    assert eng.pool.num_free_pages() == eng.pool.idle_free_pages()
