"""Routing policy: block hashing, the per-worker prefix LRU, each policy, the hot-spot guard, health."""

import pytest

from engine.execution.block_hash import block_hashes
from router.block_lru import BlockLRU
from router.dispatch import NoWorkerAvailable, WorkerInfo
from router.policy import ESTIMATE_SEED, PolicyConfig, RoutingPolicy


def colocated(wid, running=0, waiting=0, healthy=True, free=10_000):
    return WorkerInfo(wid, "colocated", healthy, running, waiting, free)


def disagg(prefill_loads=(0, 0), decode=((10_000, 0), (10_000, 0))):
    ws = [WorkerInfo(f"p{i}", "prefill", True, load) for i, load in enumerate(prefill_loads)]
    ws += [WorkerInfo(f"d{i}", "decode", True, load, 0, free) for i, (free, load) in enumerate(decode)]
    return ws


def prompt(prefix_id, n_blocks, tail=(), block=16):
    return [prefix_id * 1000 + i for i in range(n_blocks * block)] + list(tail)


# ---- hashing ------------------------------------------------------------------------------------
def hash_blocks(token_ids, block_size):
    """The prompt's block names as RoutingPolicy.place computes them for its estimate (the engine's hasher)."""
    return block_hashes(token_ids, block_size, ESTIMATE_SEED)


def test_hash_blocks_is_chained_and_ignores_partial_tail():
    a = hash_blocks(list(range(40)), 16)
    assert len(a) == 2  # 8-token tail is not a block
    assert hash_blocks(list(range(32)), 16) == a
    assert hash_blocks(list(range(40)), 16) == a  # deterministic (not Python's salted hash)
    b = hash_blocks([999] + list(range(1, 40)), 16)
    assert b[0] != a[0] and b[1] != a[1]  # a change in block 0 changes every later hash
    c = hash_blocks(list(range(16)) + [7] * 16, 16)
    assert c[0] == a[0] and c[1] != a[1]
    assert hash_blocks(list(range(15)), 16) == []
    assert len(hash_blocks(list(range(40)), 4)) == 10
    with pytest.raises(ValueError):
        hash_blocks([1, 2], 0)


def test_block_identity_depends_on_position_in_chain():
    x = list(range(16))
    assert hash_blocks(x + x, 16)[1] != hash_blocks(x, 16)[0]


# ---- LRU ----------------------------------------------------------------------------------------
def test_lru_matches_leading_blocks_only():
    lru = BlockLRU(100)
    lru.insert([1, 2, 3])
    assert lru.match([1, 2, 3, 4]) == 3
    assert lru.match([1, 2, 9]) == 2
    assert lru.match([9, 2, 3]) == 0
    assert len(lru) == 3 and 2 in lru


def test_lru_is_bounded_and_evicts_least_recent_and_chain_tails_first():
    lru = BlockLRU(4)
    lru.insert([1, 2, 3])
    lru.insert([7, 8])  # over capacity by one: the tail of the older chain goes first
    assert len(lru) == 4
    assert 3 not in lru and lru.match([1, 2, 3]) == 2
    assert lru.match([7, 8]) == 2
    lru.insert([1])  # refresh 1: now 2 is the oldest
    lru.insert([5])
    assert 2 not in lru and 1 in lru
    lru.clear()
    assert len(lru) == 0
    with pytest.raises(ValueError):
        BlockLRU(0)


# ---- policies -----------------------------------------------------------------------------------
def test_round_robin_cycles_and_skips_unhealthy():
    pol = RoutingPolicy(PolicyConfig("round_robin"))
    ws = [colocated("a"), colocated("b"), colocated("c")]
    picks = [pol.place([1] * 20, 30, ws).prefill for _ in range(6)]
    assert [d.worker_id for d in picks] == ["a", "b", "c", "a", "b", "c"]
    assert {d.reason for d in picks} == {"round_robin"}
    pol.set_health("b", False)
    assert {pol.place([1] * 20, 30, ws).prefill.worker_id for _ in range(4)} == {"a", "c"}


def test_least_loaded_uses_reported_and_inflight_load():
    pol = RoutingPolicy(PolicyConfig("least_loaded"))
    ws = [colocated("a", running=3), colocated("b", running=1, waiting=1), colocated("c", running=5)]
    d = pol.place([1] * 20, 30, ws).prefill
    assert (d.worker_id, d.reason) == ("b", "least_loaded")
    for _ in range(3):  # reports lag: the router's own in-flight count must spread a burst
        pol.acquire("b")
    assert pol.place([1] * 20, 30, ws).prefill.worker_id == "a"
    for _ in range(3):
        pol.release("b")
    assert pol.inflight("b") == 0


def test_least_loaded_ties_rotate_instead_of_piling_on_the_first_worker():
    pol = RoutingPolicy(PolicyConfig("least_loaded"))
    ws = [colocated("a"), colocated("b")]
    assert {pol.place(prompt(i, 1), 30, ws).prefill.worker_id for i in range(4)} == {"a", "b"}


def test_cache_aware_follows_the_prefix():
    pol = RoutingPolicy(PolicyConfig(cache_threshold=0.5))
    ws = [colocated("a"), colocated("b")]
    first = pol.place(prompt(1, 4, [5, 6]), 100, ws).prefill
    assert first.reason == "no_match" and first.prompt_blocks == 4
    other = pol.place(prompt(2, 4), 100, ws).prefill
    assert other.reason == "no_match" and other.worker_id != first.worker_id  # fewer cached blocks wins ties
    again = pol.place(prompt(1, 4, [9] * 20), 100, ws).prefill  # same 4 blocks + a new question
    assert (again.worker_id, again.reason, again.matched_blocks) == (first.worker_id, "prefix_hit", 4)
    assert pol.cached_blocks(first.worker_id) == 5  # the new question's full block was recorded too


def test_cache_aware_threshold_on_matched_fraction():
    pol = RoutingPolicy(PolicyConfig(cache_threshold=0.5))
    ws = [colocated("a"), colocated("b")]
    pol.place(prompt(1, 2), 100, ws)
    longer = prompt(1, 2) + prompt(3, 6)  # 2 of 8 blocks known: below the threshold
    assert pol.place(longer, 100, ws).prefill.reason == "no_match"
    assert pol.place(prompt(1, 2) + prompt(5, 2), 100, ws).prefill.reason == "prefix_hit"  # 2 of 4: at it
    assert pol.place(prompt(4, 0, [1, 2, 3]), 100, ws).prefill.reason == "no_match"  # no full block at all


def test_hotspot_guard_sends_a_popular_prefix_elsewhere():
    hot = prompt(7, 4)

    def route(load_a, load_b):
        """A fresh policy that has sent `hot` to a once, then routes it again under the given loads."""
        pol = RoutingPolicy(PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.1))
        assert pol.place(hot, 100, [colocated("a"), colocated("b", running=1)]).prefill.worker_id == "a"
        d = pol.place(hot, 100, [colocated("a", running=load_a), colocated("b", running=load_b)]).prefill
        return d.worker_id, d.reason

    assert route(4, 1) == ("a", "prefix_hit")  # 4 - 1 <= 4: within the abs threshold, the prefix wins
    assert route(6, 1) == ("b", "hotspot_guard")  # 6 - 1 > 4 and 6 > 1.5 x 1
    assert route(20, 14) == ("a", "prefix_hit")  # 20 - 14 > 4 but 20 < 1.5 x 14: not imbalanced
    assert route(22, 14) == ("b", "hotspot_guard")  # 22 > 21


def test_hotspot_guard_warms_a_second_copy_then_equal_matches_go_to_the_less_loaded():
    pol = RoutingPolicy(PolicyConfig(balance_abs_threshold=4, cache_threshold=0.1))
    hot = prompt(7, 4)
    pol.place(hot, 100, [colocated("a"), colocated("b", running=1)])
    assert pol.place(hot, 100, [colocated("a", running=9), colocated("b")]).prefill.reason == "hotspot_guard"
    d = pol.place(hot, 100, [colocated("a", running=3), colocated("b", running=2)]).prefill
    assert (d.worker_id, d.reason, d.matched_blocks) == ("b", "prefix_hit", 4)


def test_unhealthy_worker_is_skipped_forgotten_and_readded():
    pol = RoutingPolicy()
    ws = [colocated("a"), colocated("b")]
    home = pol.place(prompt(1, 4), 100, ws).prefill.worker_id
    assert pol.set_health(home, False) is True and pol.set_health(home, False) is False
    assert pol.cached_blocks(home) == 0  # a dead worker's cache is gone
    d = pol.place(prompt(1, 4), 100, ws).prefill
    assert d.worker_id != home and d.reason == "no_match"
    assert pol.set_health(home, True) is True
    other = d.worker_id
    d = pol.place(prompt(1, 4), 100, ws).prefill
    assert (d.worker_id, d.reason) == (other, "prefix_hit")  # back, but with an empty history
    assert pol.place(prompt(2, 4), 100, ws).prefill.worker_id == home  # and taking new prefixes again


def test_restart_between_probes_forgets_the_workers_blocks():
    pol = RoutingPolicy()
    ws = [WorkerInfo("a", "colocated", incarnation="1"), WorkerInfo("b", "colocated", incarnation="1")]
    home = pol.place(prompt(1, 4), 100, ws).prefill.worker_id
    assert pol.place(prompt(1, 4), 100, ws).prefill.reason == "prefix_hit"
    restarted = [WorkerInfo(w.worker_id, "colocated", incarnation="2" if w.worker_id == home else "1") for w in ws]
    d = pol.place(prompt(1, 4), 100, restarted).prefill
    assert d.reason == "no_match" and pol.cached_blocks(home) == (4 if d.worker_id == home else 0)


def test_dispatcher_reported_unhealthy_and_exclusions():
    pol = RoutingPolicy()
    ws = [colocated("a"), colocated("b", healthy=False)]
    assert {pol.place(prompt(i, 1), 30, ws).prefill.worker_id for i in range(4)} == {"a"}
    with pytest.raises(NoWorkerAvailable):
        pol.place(prompt(1, 1), 30, ws, exclude=["a"])
    with pytest.raises(NoWorkerAvailable):
        pol.place(prompt(1, 1), 30, [])


# ---- decode -------------------------------------------------------------------------------------
def test_colocated_worker_decodes_its_own_prefill():
    pol = RoutingPolicy()
    p = pol.place(prompt(1, 1), 30, [colocated("a"), colocated("b")])
    assert p.decode.worker_id == p.prefill.worker_id and p.decode.reason == "colocated"


def test_decode_prefers_free_capacity_then_load():
    pol = RoutingPolicy()
    p = pol.place(prompt(1, 1), 500, disagg(decode=((1000, 5), (4000, 9))))
    assert p.prefill.worker_id.startswith("p") and (p.decode.worker_id, p.decode.reason) == ("d1", "kv_capacity")
    p = pol.place(prompt(1, 1), 500, disagg(decode=((4000, 5), (4000, 2))))
    assert p.decode.worker_id == "d1"  # equal capacity: less load
    p = pol.place(prompt(1, 1), 5000, disagg(decode=((1000, 0), (3000, 9))))
    assert (p.decode.worker_id, p.decode.reason) == ("d1", "no_capacity")  # nothing fits: most room, queue


def test_decode_counts_in_flight_reservations_so_a_burst_spreads():
    pol = RoutingPolicy()
    ws = disagg(decode=((4000, 0), (3000, 0)))
    chosen = []
    for i in range(4):
        d = pol.place(prompt(i, 1), 1500, ws).decode
        pol.acquire(d.worker_id, 1500)  # what the server does while the request runs
        chosen.append(d.worker_id)
    assert chosen == ["d0", "d1", "d0", "d1"]  # 4000 / 3000 -> 2500 / 3000 -> 2500 / 1500 -> 1000 / 1500
    assert pol.effective_free_tokens(ws[2]) == 1000
    pol.release("d0", 1500)
    assert pol.effective_free_tokens(ws[2]) == 2500


def test_no_decode_worker_is_unavailable():
    pol = RoutingPolicy()
    with pytest.raises(NoWorkerAvailable):
        pol.place(prompt(1, 1), 30, disagg(decode=()))


def test_config_validation():
    with pytest.raises(ValueError):
        PolicyConfig("random")
    with pytest.raises(ValueError):
        PolicyConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError):
        PolicyConfig(cache_threshold=2)
    with pytest.raises(ValueError, match="balance_gain"):
        PolicyConfig(balance_gain=-1.0)
    with pytest.raises(ValueError, match="backlog_gain"):
        PolicyConfig(backlog_gain=-0.5)
    with pytest.raises(ValueError):
        WorkerInfo("x", "both")


def test_draining_worker_takes_no_new_placement_and_a_removed_one_leaves_the_index():
    """Elastic pools (service/pools.py): a draining worker is healthy but never chosen, for either phase nor for
    admission; a worker no longer listed is forgotten, its published digest with it."""
    from dataclasses import replace

    from engine.execution.block_hash import block_hashes as hashes
    from engine.handoff import PrefixDigest

    p = prompt(1, 4)
    digest = PrefixDigest(block_tokens=16, seed=b"s" * 8, hashes=frozenset(hashes(p, 16, b"s" * 8)))
    ws = [
        WorkerInfo("p0", "prefill", True, prefix=digest),
        WorkerInfo("p1", "prefill", True, prefix=PrefixDigest(block_tokens=16, seed=b"s" * 8, hashes=frozenset())),
        *disagg()[2:],
    ]
    policy = RoutingPolicy(PolicyConfig(name="cache_aware"))
    assert policy.place(p, 100, ws).prefill.worker_id == "p0"  # it holds the prefix
    draining = [replace(w, draining=True) if w.worker_id in ("p0", "d0") else w for w in ws]
    for _ in range(4):
        placement = policy.place(p, 100, draining)
        assert (placement.prefill.worker_id, placement.decode.worker_id) == ("p1", "d1")
    only_draining_decode = [w for w in draining if w.worker_id != "d1"]
    assert policy.can_admit(100, only_draining_decode)  # no candidate at all: the engine answers, not a queue
    with pytest.raises(NoWorkerAvailable):
        policy.place(p, 100, only_draining_decode)
    assert "p0" in policy._index.digests
    policy.place(p, 100, [w for w in ws if w.worker_id != "p0"])  # p0 left its pool
    assert "p0" not in policy._index.digests and "p0" not in policy._incarnation
    assert all("p0" not in holders for where in policy._index.where.values() for holders in where.values())
