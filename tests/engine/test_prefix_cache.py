"""Prefix cache (engine.execution.prefix_cache): a request served from cache computes what it computes without one.

Every comparison runs the same requests, in the same order, on an engine with the prefix cache and on one
without (fp32 CPU): tokens equal, logprobs within 1e-5. Configs cover all three layer kinds (SWA, CSA,
HCA), windows that do not divide the block (so a resume point falls mid-window: the ring snapshot must
hold the previous block's tail), HCA ratios below and at the block size, fp8 caches, chunked prefill
starting from a cached boundary, bucketed (CUDA-graph-shaped) decode, eviction under a small pool, and the
disaggregated path (prefill worker with a hit -> page copy -> decode worker) against one engine.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.loading.load import load_engine
from engine.model.allocator import PageAllocator
from tests.support.oracle import make_hf_checkpoint, teacher_forced

TOL = 1e-5

# name -> oracle checkpoint overrides, engine page_tokens (block = lcm(ratios, page spans)).
CONFIGS = {
    # window 12 vs block 16: boundaries at 16, 32, 48 ... fall 4, 8, 0 ... slots into the ring
    "w12_csa_hca16": dict(
        seed=21, overrides=dict(compress_ratios=[0, 4, 16, 4], sliding_window=12), page_tokens=16, block=16
    ),
    # window 40 > block 16: the ring at a boundary spans three earlier blocks; HCA 8 below the block
    "w40_hca8_first": dict(
        seed=22, overrides=dict(compress_ratios=[8, 4, 0, 8], sliding_window=40, index_topk=5), page_tokens=16, block=16
    ),
    # HCA 32 = the block (page span 32 for kv32 with one row a page); window 24
    "w24_hca32": dict(
        seed=23,
        overrides=dict(compress_ratios=[4, 32, 0, 4], sliding_window=24, num_hash_layers=0),
        page_tokens=8,
        block=32,
    ),
}


def _rand(n, seed, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def _params(n=8, **kw):
    return SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True, **kw)


def _run(engine, prompts, params):
    """Requests one after another (each sees the cache the previous ones left)."""
    outs = []
    for i, p in enumerate(prompts):
        rid = engine.add_request(p, params if not isinstance(params, list) else params[i], seed=500 + i)
        while engine.has_work:
            engine.step()
        outs.append(engine.pop_finished(rid))
    return outs


def _assert_same(a, b, what, tol=TOL):
    assert a.output == b.output, f"{what}: tokens differ\n  {a.output}\n  {b.output}"
    for j, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        assert abs(x - y) <= tol, f"{what}: logprob {j}: {x} vs {y}"


def _workload(vocab=128):
    """Shared system prompts, a multi-turn chat (each turn = the last prompt + its answer + a question),
    an identical repeat, and an unrelated prompt."""
    system = _rand(45, 1, vocab)
    a = system + _rand(20, 2, vocab)
    b = system + _rand(27, 3, vocab)
    c = system + _rand(9, 4, vocab)
    return system, [a, b, c, list(b), _rand(70, 5, vocab)]


def _idle(engine):
    assert engine.pool.num_free_pages() == engine.pool.idle_free_pages()
    engine.prefix.clear()
    raw = {n: g.allocator.num_free for n, g in engine.pool.groups.items()}
    assert raw == engine.pool.idle_free_pages(), "pages leaked"
    assert engine.prefix.store.num_free == engine.prefix.store.slots


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            spec = CONFIGS[name]
            made[name] = make_hf_checkpoint(tmp_path_factory.mktemp(name), seed=spec["seed"], **spec["overrides"])
        return made[name]

    return get


# ---- the allocator's view ---------------------------------------------------------------------------
def test_allocator_counts_cache_only_pages_as_evictable():
    alloc = PageAllocator(6, "g")
    a = alloc.allocate(3)
    alloc.hold_cached(a[:2])
    assert alloc.num_evictable == 0  # the request still holds them
    alloc.free(a)
    assert alloc.num_free == 4 and alloc.num_evictable == 2
    alloc.incref(a[:1])  # a hit shares one again
    assert alloc.num_evictable == 1
    with pytest.raises(ValueError, match="already held"):
        alloc.hold_cached(a[:1])
    alloc.release_cached(a[:2])  # evicted: the shared one stays with its request, the other is free
    assert alloc.num_evictable == 0 and alloc.num_free == 5 and alloc.refcount(a[0]) == 1
    alloc.free(a[:1])
    assert alloc.num_free == 6


# ---- exactness on oracle configs -------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_equals_uncached(name, checkpoints):
    spec = CONFIGS[name]
    model_dir = checkpoints(name)
    opts = dict(model_dir=model_dir, page_tokens=spec["page_tokens"], max_batch_tokens=2048)
    cached, plain = load_engine(**opts), load_engine(prefix_cache=False, **opts)
    block = cached.prefix.block
    assert block == spec["block"]
    system, prompts = _workload()
    want = _run(plain, prompts, _params())
    got = _run(cached, prompts, _params())
    for i, (w, g) in enumerate(zip(want, got)):
        _assert_same(g, w, f"{name} request {i}")
    hits = [g.cached_tokens for g in got]
    # The second sharer finds the system prompt's history but no snapshot inside it: it computes from 0
    # and snapshots where it diverged, so the third resumes there; the repeat resumes at its own snapshot.
    assert hits == [0, 0, len(system) // block * block, (len(prompts[3]) - 1) // block * block, 0]
    assert all(h % block == 0 for h in hits)
    _idle(cached)


def test_cached_run_matches_the_oracle(checkpoints):
    """The served-from-cache request against transformers' full forward (fp32 oracle tolerance)."""
    model_dir = checkpoints("w12_csa_hca16")
    engine = load_engine(model_dir=model_dir, page_tokens=16)
    system, prompts = _workload()
    outs = _run(engine, prompts[:3], _params(10))
    assert outs[2].cached_tokens > 0
    ref = teacher_forced(model_dir, prompts[2], outs[2].output)
    diffs = [abs(e - o) for e, o in zip(outs[2].logprobs, ref.gen_lp)]
    assert sum(d <= 2e-3 for d in diffs) / len(diffs) >= 0.99, diffs


def test_multi_turn_resumes_after_the_previous_answer(checkpoints):
    """Turn 2 = turn 1's prompt + answer + a question: it resumes at the last block boundary crossed while
    turn 1 was decoding (a decode-time snapshot), so only the new tokens (and < 1 block) are computed."""
    model_dir = checkpoints("w12_csa_hca16")
    opts = dict(model_dir=model_dir, page_tokens=16)
    cached, plain = load_engine(**opts), load_engine(prefix_cache=False, **opts)
    turn, prev = _rand(37, 7), 0
    for t in range(3):
        w = _run(plain, [turn], _params(21))[0]
        g = _run(cached, [turn], _params(21))[0]
        _assert_same(g, w, f"turn {t}")
        if t:  # the previous turn computed its prompt + 20 of its 21 answer tokens
            assert g.cached_tokens == (prev + 20) // 16 * 16
            assert len(turn) - g.cached_tokens < 16 + 22  # the question, the last answer token, < one block
        prev = len(turn)
        turn = turn + g.output + _rand(21, 100 + t)
    _idle(cached)


# ---- the tiny preset: budgets, fp8, bucketed decode, eviction ---------------------------------------
@pytest.mark.parametrize("budget", [5, 13, 2048])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_chunked_prefill_from_a_cached_boundary(budget, kv_cache_dtype):
    """Tiny preset (window 16, ratios 0/4/128/4), page_tokens 64 -> 128-token blocks: budgets of 5 / 13
    cut the uncached part at positions that are not multiples of 4, 16 or 128."""
    opts = dict(page_tokens=64, max_batch_tokens=budget, kv_cache_dtype=kv_cache_dtype)
    cached, plain = load_engine(**opts), load_engine(prefix_cache=False, **opts)
    vocab = cached.cfg.vocab_size
    system = _rand(260, 11, vocab)
    prompts = [system + _rand(13, 12, vocab), system + _rand(31, 13, vocab), system[:200], system[:200]]
    want, got = _run(plain, prompts, _params(6)), _run(cached, prompts, _params(6))
    for i, (w, g) in enumerate(zip(want, got)):
        _assert_same(g, w, f"budget {budget} {kv_cache_dtype} request {i}")
    # 273 tokens: snapshot at 256; 200 tokens: history to 128 but no snapshot there until it made one
    assert [g.cached_tokens for g in got] == [0, 256, 0, 128]
    if budget == 2048:  # whole prompts in one chunk: their snapshot points were kept inside the step
        assert cached.prefix.stats.snapshots_in_step >= 2
    _idle(cached)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_bucketed_decode_with_prefix_cache(kv_cache_dtype):
    """The fixed-shape (CUDA-graph) decode path over shared pages: concurrent hits on one prefix."""
    opts = dict(page_tokens=64, kv_cache_dtype=kv_cache_dtype)
    cached, plain = load_engine(decode_mode="bucketed", **opts), load_engine(prefix_cache=False, **opts)
    vocab = cached.cfg.vocab_size
    system = _rand(300, 21, vocab)
    _run(cached, [system + [5]], _params(2))  # warm the cache
    prompts = [system + _rand(k, 30 + k, vocab) for k in (3, 17, 40)]
    ids = [cached.add_request(p, _params(12), seed=i) for i, p in enumerate(prompts)]
    while cached.has_work:
        cached.step()
    got = [cached.pop_finished(r) for r in ids]
    want = [_run(plain, [p], _params(12))[0] for p in prompts]
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.cached_tokens == 256
        _assert_same(g, w, f"bucketed {kv_cache_dtype} request {i}")
    assert cached.decode_runner.steps > 0
    _idle(cached)


def test_eviction_under_a_small_pool():
    """A pool of 512 tokens: cached blocks are evicted LRU to admit new prompts; a hot system prompt stays
    cached, and every answer is still exact."""
    opts = dict(page_tokens=64, max_cached_tokens=512, max_num_seqs=4)
    cached, plain = load_engine(**opts), load_engine(prefix_cache=False, **opts)
    vocab = cached.cfg.vocab_size
    systems = [_rand(200, 40 + s, vocab) for s in range(6)]
    order = [0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 1]
    prompts = [systems[s] + _rand(20, 60 + k, vocab) for k, s in enumerate(order)]
    want, got = _run(plain, prompts, _params(4)), _run(cached, prompts, _params(4))
    for i, (w, g) in enumerate(zip(want, got)):
        _assert_same(g, w, f"eviction request {i}")
    assert cached.prefix.stats.evicted_blocks > 0
    assert [g.cached_tokens for k, g in enumerate(got) if order[k] == 0][1:] == [128] * 5
    assert cached.load().kv_free_tokens == plain.load().kv_free_tokens  # cached pages count as free
    _idle(cached)


def test_prompt_logprobs_are_never_served_from_cache():
    engine = load_engine(page_tokens=64)
    prompt = _rand(200, 3, engine.cfg.vocab_size)
    _run(engine, [prompt], _params(2))
    out = _run(engine, [prompt], _params(2, prompt_logprobs=True))[0]
    assert out.cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
    assert _run(engine, [prompt], _params(2))[0].cached_tokens == 128


def test_block_hashes_name_the_format():
    """Two cache formats of one model never share a block name (hash seed covers the format)."""
    a, b = load_engine(page_tokens=64), load_engine(page_tokens=64, kv_cache_dtype="fp8")
    assert a.prefix.seed != b.prefix.seed and a.prefix.block == b.prefix.block == 128


# ---- disaggregated --------------------------------------------------------------------------------
def _copy_pages(src_pool, src_pages, dst_pool, dst_pages):
    for name, group in src_pool.groups.items():
        rows = group.spec.page_rows
        for sp, dp in zip(src_pages.get(name, []), dst_pages.get(name, [])):
            dst_pool.groups[name].tensor[:, dp * rows : (dp + 1) * rows] = group.tensor[:, sp * rows : (sp + 1) * rows]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_disaggregated_hit_equals_one_engine(kv_cache_dtype):
    """Prefill worker serves a shared prefix from cache, its pages (shared ones included) are copied to a
    decode worker: the same tokens and logprobs as one engine without any cache."""
    opts = dict(page_tokens=64, kv_cache_dtype=kv_cache_dtype)
    prefill, decode = load_engine(max_batch_tokens=9, **opts), load_engine(max_batch_tokens=64, **opts)
    colocated = load_engine(prefix_cache=False, **opts)
    vocab = prefill.cfg.vocab_size
    system = _rand(270, 70, vocab)
    prompts = [system + _rand(k, 80 + k, vocab) for k in (4, 19, 33)]
    # fp8: prefill in 9-token chunks vs one chunk differs by ~1e-5 with or without the cache, which can
    # flip a sampled token; greedy there, sampling on exact caches.
    fp8 = kv_cache_dtype == "fp8"
    params = _params(10) if fp8 else _params(10, temperature=0.9, top_p=0.9)
    want = [_run(colocated, [p], params)[0] for p in prompts]
    # each colocated run used seed 500; use the same seed on the split path
    hits = []
    for i, p in enumerate(prompts):
        rid = prefill.add_request(p, params, request_id=f"p{i}", prefill_only=True, seed=500)
        while prefill.has_work:
            prefill.step()
        req = prefill.held_request(rid)
        hits.append(req.cached_tokens)
        pages = decode.reserve_import(req.prompt, params, f"d{i}", req.seed, req.output[0], req.logprobs[0])
        _copy_pages(prefill.pool, req.pages, decode.pool, pages)
        prefill.release(rid)
        decode.commit_import(f"d{i}")
        while decode.has_work:
            decode.step()
        _assert_same(
            decode.pop_finished(f"d{i}"), want[i], f"disaggregated {kv_cache_dtype} request {i}", 1e-4 if fp8 else TOL
        )
    assert hits == [0, 256, 256]
    _idle(prefill)
    _idle(decode)


def test_decode_worker_caches_imported_prompts():
    """The decode side registers imported prompts' blocks too, so a later request prefilled locally there
    (conditional disaggregation) hits on them."""
    opts = dict(page_tokens=64)
    prefill, decode, plain = load_engine(**opts), load_engine(**opts), load_engine(prefix_cache=False, **opts)
    vocab = prefill.cfg.vocab_size
    prompt = _rand(250, 90, vocab)
    params = _params(140)
    rid = prefill.add_request(prompt, params, request_id="p", prefill_only=True, seed=500)
    while prefill.has_work:
        prefill.step()
    req = prefill.held_request(rid)
    pages = decode.reserve_import(req.prompt, params, "d", req.seed, req.output[0], req.logprobs[0])
    _copy_pages(prefill.pool, req.pages, decode.pool, pages)
    prefill.release(rid)
    decode.commit_import("d")
    while decode.has_work:
        decode.step()
    first = decode.pop_finished("d")
    follow = prompt + first.output + _rand(10, 91, vocab)
    got = _run(decode, [follow], _params(5))[0]
    want = _run(plain, [follow], _params(5))[0]
    assert got.cached_tokens == (len(prompt) + len(first.output) - 1) // 128 * 128
    assert math.isclose(got.logprobs[0], want.logprobs[0], abs_tol=TOL)
    _assert_same(got, want, "local prefill on the decode worker")


# ---- snapshots kept inside a longer chunk ---------------------------------------------------------------
def _steps_of(engine, prompt, params):
    rid = engine.add_request(prompt, params, seed=900)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    return engine.pop_finished(rid), steps


@pytest.mark.parametrize("name", ["w40_hca8_first", "w12_csa_hca16"])
def test_snapshot_inside_the_chunk_keeps_the_prompt_one_step(name, checkpoints, monkeypatch):
    """The prompt's last block boundary (the identical repeat's resume point) falls inside its one prefill chunk:
    the step writes the rings there into staging pages, so the prompt runs in one step, not two; the repeat
    resumes there and computes what an engine without a prefix cache computes. Without staging pages free, the
    chunk ends at the boundary as before (two steps), with the same tokens."""
    spec = CONFIGS[name]
    opts = dict(model_dir=checkpoints(name), page_tokens=spec["page_tokens"], max_batch_tokens=2048)
    plain = load_engine(prefix_cache=False, **opts)
    prompt = _rand(70, 11)
    params = _params(6)
    want = _run(plain, [prompt, prompt], params)

    cached = load_engine(**opts)
    block = cached.prefix.block
    first, steps = _steps_of(cached, prompt, params)
    assert steps == 1 + params.max_new_tokens - 1, "the prompt took more than one step"
    assert cached.prefix.stats.snapshots_in_step == 1
    again = _run(cached, [prompt], params)[0]
    assert again.cached_tokens == (len(prompt) - 1) // block * block
    _assert_same(first, want[0], f"{name}: first run")
    _assert_same(again, want[1], f"{name}: repeat from the in-step snapshot")
    _idle(cached)

    cut = load_engine(**opts)
    monkeypatch.setattr(cut.prefix, "_stage", lambda plan, point: False)  # no staging pages free
    first_cut, steps_cut = _steps_of(cut, prompt, params)
    assert steps_cut == steps + 1 and cut.prefix.stats.snapshots_in_step == 0
    again_cut = _run(cut, [prompt], params)[0]
    assert again_cut.cached_tokens == again.cached_tokens
    _assert_same(first_cut, want[0], f"{name}: first run, chunk cut at the boundary")
    _assert_same(again_cut, want[1], f"{name}: repeat, snapshot after a step")
    _idle(cut)


def test_a_full_engine_still_snapshots_inside_the_chunk(checkpoints):
    """An engine running as many requests as it takes (max_num_seqs 1 here) keeps spare fixed pages for the
    staging (engine.execution.prefix_cache.STAGING_PAGES): its long prompt still runs in one step. Before, the one request
    held every fixed page and the chunk was cut at the snapshot point (the H200 slice's 8K prompt ran in two)."""
    spec = CONFIGS["w12_csa_hca16"]
    engine = load_engine(
        model_dir=checkpoints("w12_csa_hca16"), page_tokens=spec["page_tokens"], max_batch_tokens=2048, max_num_seqs=1
    )
    params = _params(3)
    _, steps = _steps_of(engine, _rand(70, 12), params)
    assert steps == params.max_new_tokens and engine.prefix.stats.snapshots_in_step == 1
    _idle(engine)


def test_staging_pages_return_when_the_request_leaves(checkpoints):
    """A chunk that kept an in-step snapshot point holds one staging page in each snapshotted ring group until
    its step is read back; a request that leaves before that (aborted) gives them back."""
    spec = CONFIGS["w40_hca8_first"]
    engine = load_engine(
        model_dir=checkpoints("w40_hca8_first"), page_tokens=spec["page_tokens"], max_batch_tokens=2048
    )
    idle = {n: g.allocator.num_free for n, g in engine.pool.groups.items()}
    rid = engine.add_request(_rand(70, 12), _params(4))
    [chunk] = engine.scheduler.schedule()  # admits the request and cuts its chunk (not run)
    assert (chunk.num_tokens, chunk.snapshot_at) == (70, 64)
    staging = engine.prefix.staging(chunk.request)
    assert set(staging) == set(engine.prefix.rings) == {"swa", "state4", "index_state"}
    assert all(engine.pool.groups[g].allocator.num_free == idle[g] - 2 for g in staging)  # its page + staging
    engine.abort(rid)
    _idle(engine)
    assert {n: g.allocator.num_free for n, g in engine.pool.groups.items()} == idle
