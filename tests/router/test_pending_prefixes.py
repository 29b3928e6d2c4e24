"""A router's "soon cached" blocks (router/pending_prefixes.py): a follow-up that arrives before its first turn's
prefill is published goes where that prefill was sent; the entries are bounded and give way to the digest."""

from __future__ import annotations

from engine.execution.block_hash import block_hashes
from engine.handoff import PrefixDigest
from router.dispatch import WorkerInfo
from router.pending_prefixes import PendingPrefixes
from router.policy import PolicyConfig, RoutingPolicy

SEED = b"12345678"
BLOCK = 4
EMPTY = PrefixDigest(block_tokens=BLOCK, seed=SEED, hashes=frozenset(), version=0)


def workers(digests=None):
    """Three idle workers publishing empty digests (their caches hold nothing yet), unless given others."""
    digests = digests or {}
    return [WorkerInfo(w, "colocated", True, 0, 0, 1 << 20, prefix=digests.get(w, EMPTY)) for w in "abc"]


def policy(ttl_s=60.0):
    # The queue-vs-cache rule alone (the balance and backlog terms have their own tests).
    return RoutingPolicy(PolicyConfig("cache_aware", balance_gain=0.0, backlog_gain=0.0, pending_prefix_ttl_s=ttl_s))


def test_follow_up_before_publication_goes_where_its_prefix_is_being_computed():
    first = list(range(40))  # 10 blocks; placed, its prefill not ended: no digest shows it
    follow = first + list(range(500, 508))
    pol = policy()
    a = pol.place(first, 100, workers(), now=0.0).prefill
    p = pol.place(follow, 100, workers(), now=1.0).prefill
    # 9 of first's blocks (a hit leaves one token: 39 // 4) count as cached where first was sent: 40 queued there +
    # 2 x (48 - 36) beats 2 x 48 on an idle worker.
    assert (p.worker_id, p.reason, p.cached_tokens, p.soon_cached_tokens) == (a.worker_id, "prefix_hit", 0, 36)
    assert p.uncached_tokens == 12 and pol.pending_tokens(a.worker_id) == 40 + 12
    # Without the rule (entries expire at once) the follow-up goes to an idle worker and recomputes everything.
    off = policy(ttl_s=0.0)
    a = off.place(first, 100, workers(), now=0.0).prefill
    p = off.place(follow, 100, workers(), now=1.0).prefill
    assert p.worker_id != a.worker_id and p.soon_cached_tokens == 0 and p.uncached_tokens == 48


def test_stale_entries_expire_and_published_ones_give_way_to_the_digest():
    first = list(range(40))
    follow = first + list(range(500, 508))
    pol = policy(ttl_s=5.0)
    a = pol.place(first, 100, workers(), now=0.0).prefill.worker_id
    assert pol.place(follow, 100, workers(), now=6.0).prefill.soon_cached_tokens == 0  # placed 6 s ago: expired
    # Published: the digest's blocks stand for the entries (the cached part is the digest's, none is "soon").
    pol = policy()
    a = pol.place(first, 100, workers(), now=0.0).prefill.worker_id
    published = PrefixDigest(
        block_tokens=BLOCK, seed=SEED, hashes=frozenset(block_hashes(first, BLOCK, SEED)), version=1
    )
    pol.observe(workers({a: published}))
    pol.prefill_done(a, 40)
    p = pol.place(follow, 100, workers({a: published}), now=1.0).prefill
    assert (p.worker_id, p.cached_tokens, p.soon_cached_tokens) == (a, 40, 0)


def test_a_worker_gone_down_loses_its_entries():
    first = list(range(40))
    pol = policy()
    a = pol.place(first, 100, workers(), now=0.0).prefill.worker_id
    pol.set_health(a, False)
    pol.set_health(a, True)
    p = pol.place(first + [7], 100, workers(), now=1.0).prefill
    assert p.soon_cached_tokens == 0


def test_entries_are_bounded_per_worker_and_stay_a_prefix():
    chain = block_hashes(list(range(40)), BLOCK, SEED)  # 10 blocks
    soon = PendingPrefixes(ttl_s=60.0, max_blocks=3)
    soon.add("a", chain, now=0.0)
    assert len(soon) == 3
    # The tail went first: what is left is the chain's first 3 blocks, a prefix the worker will hold.
    assert soon.cached(chain, BLOCK, now=1.0) == {"a": 12}
    soon.add("b", chain[:2], now=0.0)
    soon.published("a", chain[:1])
    assert soon.cached(chain, BLOCK, now=1.0) == {"a": 12, "b": 8}
    assert soon.cached(chain[:1], BLOCK, now=1.0) == {"b": 4}  # a's block 0 is in a's digest now
    soon.drop("a")
    soon.drop("b")
    assert len(soon) == 0 and not soon.where
