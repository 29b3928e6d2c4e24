"""Routing by the workers' real prefix caches (router/locality.py, RoutingPolicy.choose_by_cache)."""

from __future__ import annotations

import torch

from engine.execution.block_hash import block_hashes
from engine.execution.sampling_params import SamplingParams
from engine.handoff import PrefixDigest
from engine.loading.load import load_engine
from router import locality
from router.dispatch import WorkerInfo
from router.policy import PolicyConfig, RoutingPolicy

SEED = b"12345678"
BLOCK = 4


def digest(tokens, upto_blocks, block=BLOCK, seed=SEED):
    # A worker bumps its digest's version whenever the content changes (the router's index relies on it).
    return PrefixDigest(
        block_tokens=block,
        seed=seed,
        hashes=frozenset(block_hashes(tokens, block, seed)[:upto_blocks]),
        version=upto_blocks,
    )


def worker(wid, prefix, running=0, waiting=0):
    return WorkerInfo(wid, "colocated", True, running, waiting, 1 << 20, prefix=prefix)


def cached_tokens(prompt, workers):
    """worker id -> prompt tokens its digest would serve, through what placement calls (RoutingPolicy.place ->
    choose_by_cache -> CacheIndex.sync / cached); 0 for a worker without a hit."""
    index = locality.CacheIndex()
    index.sync(workers)
    got = index.cached(prompt)
    return {w.worker_id: got.get(w.worker_id, 0) for w in workers}


def test_cached_tokens_is_the_deepest_published_block_and_leaves_one_token():
    prompt = list(range(100, 120))  # 5 blocks of 4
    ws = [
        worker("a", digest(prompt, 2)),
        worker("b", digest(prompt, 5)),
        worker("c", None),
        worker(
            "d",
            PrefixDigest(
                block_tokens=BLOCK, seed=b"otherfmt", hashes=frozenset(block_hashes(prompt, BLOCK, b"otherfmt"))
            ),
        ),
    ]
    got = cached_tokens(prompt, ws)
    # b holds all 5 blocks but a hit must leave the last token to compute: 4 blocks; other format: none
    assert got == {"a": 8, "b": 16, "c": 0, "d": 16}
    only_last = PrefixDigest(block_tokens=BLOCK, seed=SEED, hashes=frozenset(block_hashes(prompt, BLOCK, SEED)[3:4]))
    assert cached_tokens(prompt, [worker("e", only_last)]) == {"e": 16}  # snapshot at 16 suffices
    assert cached_tokens(prompt[:3], ws)["b"] == 0


def test_cache_aware_follows_real_cache_until_queued_work_outweighs_it():
    prompt = list(range(40))  # 10 blocks
    pol = RoutingPolicy(PolicyConfig("cache_aware"))
    ws = [worker("a", digest(prompt, 9)), worker("b", digest(prompt, 0)), worker("c", digest(prompt, 0))]
    p = pol.place(prompt, 100, ws).prefill
    assert (p.worker_id, p.reason, p.cached_tokens, p.uncached_tokens) == ("a", "prefix_hit", 36, 4)
    assert pol.pending_tokens("a") == 4
    # Uncached tokens count twice (PolicyConfig.uncached_weight): another 4 queued on a: 4 + 2 x 4 = 12 there
    # vs 2 x 40 elsewhere, still a.
    assert pol.place(prompt, 100, ws).prefill.worker_id == "a" and pol.pending_tokens("a") == 8
    # A long prefill queued there (65 tokens): 73 + 2 x 4 > 2 x 40 -> the idle workers take it.
    pol._pending["a"] += 65
    p = pol.place(prompt, 100, ws).prefill
    assert p.worker_id in ("b", "c") and p.reason == "no_match" and pol.pending_tokens(p.worker_id) == 40
    pol.prefill_done("a", 73)
    assert pol.pending_tokens("a") == 0


def test_real_view_records_no_estimate_and_guard_still_applies():
    prompt = list(range(40))
    pol = RoutingPolicy(PolicyConfig("cache_aware", balance_abs_threshold=2, balance_rel_threshold=1.5))
    ws = [worker("a", digest(prompt, 9), running=9), worker("b", digest(prompt, 0))]
    d = pol.place(prompt, 100, ws).prefill
    assert (d.worker_id, d.reason) == ("b", "hotspot_guard")
    assert pol.cached_blocks("a") == pol.cached_blocks("b") == 0  # nothing estimated
    rr = RoutingPolicy(PolicyConfig("round_robin"))
    assert rr.place(prompt, 100, ws).prefill.uncached_tokens == 40


def test_router_hashes_prompts_like_the_engine_caches_them():
    """An engine's published digest predicts the engine's own hit for the next prompt, token for token."""
    engine = load_engine(page_tokens=64)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(2, engine.cfg.vocab_size, (300,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for tail in ([5, 6], [7, 8, 9]):
        engine.add_request(system + tail, params)
        while engine.has_work:
            engine.step()
    follow = system + [11, 12, 13]
    # The production path: the router's placement (router/server.py -> RoutingPolicy.place) on the digest.
    placed = RoutingPolicy(PolicyConfig("cache_aware")).place(follow, 400, [worker("e", engine.prefix.digest())])
    predicted = placed.prefill.cached_tokens
    rid = engine.add_request(follow, params)
    while engine.has_work:
        engine.step()
    assert predicted == engine.pop_finished(rid).cached_tokens == 256


def test_conditional_disaggregation_prefills_short_uncached_parts_on_the_decode_worker():
    prompt = list(range(40))  # 10 blocks of 4
    pol = RoutingPolicy(PolicyConfig("cache_aware", local_prefill_tokens=8))
    prefill = WorkerInfo("p", "prefill", True, 0, 0, 1 << 20, prefix=digest(prompt, 0))
    dec = WorkerInfo("d", "decode", True, 0, 0, 1 << 20, prefix=digest(prompt, 8))  # 32 of 40 cached there
    p = pol.place(prompt, 100, [prefill, dec])
    assert (p.prefill.worker_id, p.prefill.reason, p.prefill.uncached_tokens) == ("d", "local_prefill", 8)
    assert p.decode.worker_id == "d" and pol.pending_tokens("d") == 8
    cold = WorkerInfo("d", "decode", True, 0, 0, 1 << 20, prefix=digest(prompt, 2))
    p = pol.place(prompt, 100, [prefill, cold])  # 32 tokens to compute: the prefill pool does it
    assert (p.prefill.worker_id, p.decode.worker_id) == ("p", "d")
    assert RoutingPolicy(PolicyConfig("cache_aware")).place(prompt, 100, [prefill, dec]).prefill.worker_id == "p"


def test_decode_worker_local_generation_equals_one_engine():
    """DecodeWorker.generate_local (the dispatcher's local_prefill path) streams what one engine generates,
    and serves a repeated prefix from its cache."""
    import asyncio

    from decode_worker.worker import DecodeWorker

    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (300,), generator=g).tolist()]
    prompts.append(prompts[0][:280] + [7, 8, 9])
    ref = load_engine(prefix_cache=False)
    want = []
    for p in prompts:
        rid = ref.add_request(p, params, seed=5)
        while ref.has_work:
            ref.step()
        want.append(ref.pop_finished(rid))
    worker = DecodeWorker("d0", None, {"page_tokens": 64})
    try:

        async def run(rid, p):
            return [ev async for ev in worker.generate_local(rid, p, params, 5)]

        for i, (p, w) in enumerate(zip(prompts, want)):
            events = asyncio.run(run(f"r{i}", p))
            got = [e.token_id for e in events if e.token_id is not None]
            assert got == w.output
            assert events[-1].finished and events[-1].cached_tokens == (256 if i else 0)
        assert worker.engine.pool.num_free_pages() == worker.engine.pool.idle_free_pages()
    finally:
        worker.shutdown()


def test_a_worker_going_down_leaves_the_index():
    prompt = list(range(40))
    pol = RoutingPolicy(PolicyConfig("cache_aware"))
    ws = [worker("a", digest(prompt, 9)), worker("b", digest(prompt, 0))]
    assert pol.place(prompt, 100, ws).prefill.worker_id == "a"
    assert "a" in pol._index.digests
    pol.set_health("a", False)
    assert "a" not in pol._index.digests and pol._index.cached(prompt) == {}
    p = pol.place(prompt, 100, ws).prefill
    assert (p.worker_id, p.reason) == ("b", "no_match")
