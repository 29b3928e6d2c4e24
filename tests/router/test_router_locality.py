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
    # The queue-vs-cache arithmetic alone (no balance or backlog terms: those have their own tests below).
    pol = RoutingPolicy(PolicyConfig("cache_aware", balance_gain=0.0, backlog_gain=0.0))
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


def shared_context_workers(sessions: int, tools_blocks: int = 8, private_blocks: int = 4):
    """Agent-like traffic: every prompt starts with the same tool context; session i's own blocks follow.
    Workers h0..h{sessions-1} each hold the tools + one session's prompt so far; "cold" holds only the tools."""
    tools = list(range(10_000, 10_000 + tools_blocks * BLOCK))
    own = [tools + list(range(1000 * (i + 1), 1000 * (i + 1) + private_blocks * BLOCK)) for i in range(sessions)]
    ws = [worker(f"h{i}", digest(p, len(p) // BLOCK)) for i, p in enumerate(own)]
    return tools, own, ws + [worker("cold", digest(tools, tools_blocks))]


def test_a_worker_short_of_recent_work_takes_new_sessions_but_does_not_soak_up_held_ones():
    """The balance term scales a worker's misses by its recent work: it must not pull a queue of other sessions'
    next steps onto the one worker that has done less (each would recompute its session's own blocks and wait
    behind the others: the agentic trace's TTFT tail when the term was added to the cost instead)."""
    tools, own, ws = shared_context_workers(6)
    # The balance term alone: with 6 of 7 workers above the mean, the bounded load (its own test below) would move
    # sessions until the cold worker caught up, which is its job, not this term's.
    pol = RoutingPolicy(PolicyConfig("cache_aware", load_cap=100.0))
    for i in range(6):  # the holders computed their sessions recently; "cold" did nothing
        pol._recent.add(f"h{i}", 1000, now=0.0)
    pol._recent_requests.add("", 70 * 8, now=0.0)  # sustained traffic: 80 requests a worker (the full gain) ...
    pol._window_requests.add("", 70 * 8, now=0.0)  # ... in the balance window too (its mean request sets the slack)
    # A burst: every session's next step (one more block) arrives before any prefill ends.
    burst = [p + [7000 + i] * BLOCK for i, p in enumerate(own)]
    picks = [pol.place(p, len(p) + 8, ws, now=1.0).prefill.worker_id for p in burst]
    assert picks.count("cold") <= 1, picks  # (adding the term to the cost put all 6 there)
    assert all(w in (f"h{i}", "cold") for i, w in enumerate(picks))
    # A new session (only the shared tools cached anywhere) goes where recent work is lowest: the cold worker.
    fresh = tools + list(range(50_000, 50_000 + 4 * BLOCK))
    assert pol.place(fresh, len(fresh) + 8, ws, now=1.0).prefill.worker_id == "cold"


def test_a_few_requests_are_no_load_signal():
    """Right after start (or a quiet spell) one worker has all the recent work: the balance term must not send the
    next request sharing its prefix to the idle worker to recompute it (tests/router/test_router_grpc.py's
    repeated prefix, through the real router)."""
    prompt = list(range(40))
    pol = RoutingPolicy(PolicyConfig("cache_aware"))
    ws = [worker("a", digest(prompt, 0)), worker("b", digest(prompt, 0))]
    first = pol.place(prompt, 100, ws, now=0.0).prefill.worker_id
    ws = [worker(w.worker_id, digest(prompt, 9 if w.worker_id == first else 0)) for w in ws]
    pol.prefill_done(first, 40)
    assert pol.place(prompt[:38] + [7, 7], 100, ws, now=1.0).prefill.worker_id == first


def zipf_groups_traffic(pol: RoutingPolicy, shares: tuple[int, ...], workers: int = 4, rounds: int = 8):
    """System-prompt traffic: group g's requests (shares[g] of every sum(shares)) are its 8-block prefix + one own
    block + a token, interleaved; each worker's digest holds every block placed there; no queue (each prefill ends
    before the next request). -> (max/mean of the tokens each worker computed, workers holding each group's prefix,
    requests that found nothing cached)."""
    prefixes = [list(range(10_000 * (g + 1), 10_000 * (g + 1) + 8 * BLOCK)) for g in range(len(shares))]
    order = [g for _ in range(rounds) for g, k in enumerate(shares) for _ in range(k)]
    order = [order[(i * 7) % len(order)] for i in range(len(order))]  # the groups interleaved
    held: dict[str, set[int]] = {f"w{i}": set() for i in range(workers)}
    computed = dict.fromkeys(held, 0)
    misses = 0
    for k, g in enumerate(order):
        prompt = prefixes[g] + list(range(100_000 + k * BLOCK, 100_000 + (k + 1) * BLOCK)) + [1]
        ws = [
            worker(w, PrefixDigest(block_tokens=BLOCK, seed=SEED, hashes=frozenset(h), version=len(h)))
            for w, h in held.items()
        ]
        d = pol.place(tuple(prompt), len(prompt) + 8, ws, now=k * 0.01).prefill
        misses += d.cached_tokens == 0
        computed[d.worker_id] += d.uncached_tokens
        held[d.worker_id] |= set(block_hashes(prompt, BLOCK, SEED))
        pol.prefill_done(d.worker_id, d.uncached_tokens)
    holders = [sum(block_hashes(p, BLOCK, SEED)[-1] in h for h in held.values()) for p in prefixes]
    return max(computed.values()) * workers / sum(computed.values()), holders, misses


def test_a_hot_prefix_overflows_to_a_second_worker_past_the_load_cap():
    """Bounded load: the holder of the most popular prefix (32% of the traffic on 4 workers) gets every cheap hit
    of it; the balance term alone leaves it ~1.3x the mean, while past load_cap x the mean its excess counts as
    queued work and the prefix is copied to a second worker once, every later request still a hit."""
    shares = (16, 12, 11, 11)
    imbalance, holders, misses = zipf_groups_traffic(RoutingPolicy(PolicyConfig("cache_aware")), shares)
    assert imbalance <= 1.15 and holders[0] == 2 and holders[1:] == [1, 1, 1], (imbalance, holders)
    assert misses == 4 + 1  # each group's first request, and the one copy
    uncapped = RoutingPolicy(PolicyConfig("cache_aware", load_cap=100.0))
    imbalance, holders, misses = zipf_groups_traffic(uncapped, shares)
    assert imbalance > 1.2 and holders == [1, 1, 1, 1] and misses == 4


def test_even_prefixes_keep_their_holders_under_the_load_cap():
    """Groups of equal popularity: every holder is at the mean, nothing is copied, every request after a group's
    first is a hit."""
    imbalance, holders, misses = zipf_groups_traffic(RoutingPolicy(PolicyConfig("cache_aware")), (10, 10, 10, 10))
    assert holders == [1, 1, 1, 1] and misses == 4 and imbalance < 1.1


def test_backlog_everywhere_makes_sessions_stick():
    """With every worker queued, recomputing a prefix elsewhere only adds to the total backlog: the same queue gap
    that moves a session when the pool is idle keeps it on its holder when the others are busy too."""
    prompt = list(range(40))  # 10 blocks, 36 tokens cached on a
    ws = [worker("a", digest(prompt, 9)), worker("b", digest(prompt, 0))]

    def choice(a_queue, b_queue, gain):
        pol = RoutingPolicy(PolicyConfig("cache_aware", balance_gain=0.0, backlog_gain=gain))
        pol._pending.update(a=a_queue, b=b_queue)
        return pol.place(prompt, 100, ws).prefill.worker_id

    # a's queue is 80 tokens longer: more than 2 x 36 cached -> b, with or without the backlog term ...
    assert choice(80, 0, 0.0) == choice(80, 0, 0.5) == "b"
    # ... but with 400 tokens queued on b as well, the backlog term keeps the session on a.
    assert choice(480, 400, 0.0) == "b" and choice(480, 400, 0.5) == "a"


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
    """An engine's published digest predicts the engine's own hit for the next prompt, token for token, also when
    the router names the prompt's blocks from memory (router.prompt_hashes: earlier prompts shared its prefix)."""
    engine = load_engine(page_tokens=64)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(2, engine.cfg.vocab_size, (300,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for tail in ([5, 6], [7, 8, 9]):
        engine.add_request(system + tail, params)
        while engine.has_work:
            engine.step()
    # The production path: the router's placement (router/server.py -> RoutingPolicy.place, prompts as tuples)
    # on the digest; one policy for every prompt, so the later ones are named from memory.
    policy = RoutingPolicy(PolicyConfig("cache_aware"))
    follow = system + [11, 12, 13]
    turns = [follow, system[:200] + [14] * 150, follow + [15] * 200, system[:130] + [16] * 10]
    # The engine resumes only at snapshot points: none among the first 200 tokens of the second prompt.
    got, want = [], [256, 0, 256, 128]
    for prompt in turns:
        predicted = policy.place(tuple(prompt), 800, [worker("e", engine.prefix.digest())]).prefill.cached_tokens
        rid = engine.add_request(prompt, params)
        while engine.has_work:
            engine.step()
        got.append((predicted, engine.pop_finished(rid).cached_tokens))
    assert got == [(w, w) for w in want]
    hasher = next(iter(policy._index.hashers.values()))
    assert 0 < hasher.hashed_blocks < sum(len(p) // hasher.block for p in turns)  # some names came from memory


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


def test_one_long_prompt_does_not_push_its_sessions_next_turn_off_its_holder():
    """Requests of unequal size: after a dozen short requests, one long prompt puts its worker well above the mean
    of a 2-worker pool. The same session's next turn (most of it cached there) must stay: load differences within
    half the larger of the mean request and the one at hand are no imbalance, for the balance factor and the cap
    alike (router/policy.py). Before, both moved the follow-up, which recomputed 256 cached tokens elsewhere
    (tests/router/test_router_grpc.py's repeated prefix failed so on a fast run)."""
    block = 16
    pol = RoutingPolicy(PolicyConfig("cache_aware"))
    held: dict[str, set[int]] = {"a": set(), "b": set()}

    def place(prompt, now):
        ws = [
            worker(w, PrefixDigest(block_tokens=block, seed=SEED, hashes=frozenset(h), version=len(h)))
            for w, h in held.items()
        ]
        d = pol.place(tuple(prompt), len(prompt) + 16, ws, now=now).prefill
        held[d.worker_id] |= set(block_hashes(prompt, block, SEED))
        pol.prefill_done(d.worker_id, d.uncached_tokens)
        return d

    for k in range(12):  # short, unrelated requests
        place(list(range(1000 * (k + 1), 1000 * (k + 1) + 11)), now=0.05 * k)
    long_prompt = list(range(500_000, 500_302))
    first = place(long_prompt, now=1.3)
    follow_up = long_prompt[:256] + list(range(900_000, 900_048))
    d = place(follow_up, now=1.4)
    assert (d.worker_id, d.cached_tokens) == (first.worker_id, 256), d
