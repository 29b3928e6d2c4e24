"""Prefix locality from the workers' real caches, and the cache-aware prefill choice built on it.

Each worker publishes a `PrefixDigest` with its stats (engine.execution.prefix_cache.PrefixCache.digest): the hashes
of the blocks its prefix cache can resume after, the block size, and the hash seed (model + cache format).
The digest is bounded (one hash per snapshot slot) and replaced whole on every report, so a block the
worker evicted leaves the router's view at the next report, and a dead or restarted worker's view goes
with its WorkerInfo. The router names a prompt's blocks with the same function (`block_hashes`, through
`router.prompt_hashes.PromptHasher`, which remembers the names of prefixes it has seen), once per distinct
(block size, seed), and a worker's cached prefix is the deepest prompt block in its digest
(`CacheIndex.cached`, which `RoutingPolicy.choose_by_cache` calls for every placement).

Choice (`choose_by_cache`), for the healthy prefill candidates, all with digests, n prompt tokens:
- cached(w): prompt tokens w would serve from cache (at most n - 1: one token is always computed): its digest's,
  or deeper, the blocks this router sent to w that its digest does not show yet (router/pending_prefixes.py);
- pending(w): the uncached prompt tokens this router sent to w whose prefill has not finished
  (RoutingPolicy tracks it: it does not lag like a load report): w's queue, this request's wait there;
- cost(w) = pending(w) + weight x (n - cached(w)) x exp(balance_gain x r(w)), the least wins (ties: fewer
  requests there, then rotate). The Dynamo / LMetric family of rules, with three terms from the traffic:
  - weight = uncached_weight (2) x (1 + backlog_gain (0.5) x min_w pending(w) / n). A prefix recomputed
    elsewhere delays every later request there and its copy evicts other prefixes, so a growing session
    leaves the worker holding it only when that queue is longer by more than twice the cached part (at
    weight 1 bursts and heavy-tailed lengths scattered sessions: 86% / 91% of the pooled hit rate on the
    `bursty` / `heavy_tail` traces, 96% / 96% at 2). When every worker has a queue (the shortest one is
    long), moving a session only adds its recompute to the total backlog, so the weight grows with it: at
    twice the traces' arrival rate chat kept 96% of the pooled hit rate (TTFT p99 1.7 s) instead of 92%
    (2.8 s). The per-worker "overlap credit that decays with the holder's backlog" of Dynamo was tried
    and dropped: the queue term already moves sessions off a congested holder, and the decay (credit 2 ->
    1 as the holder's queue passes 16K / 4K tokens) cost chat at twice the rate 3 / 8 points of hit rate
    and 45% / 130% on TTFT p99, and gained nothing at the traces' own rates.
  - r(w) = w's prompt tokens computed recently / the candidates' mean - 1, at most 1; "recently" decays per
    placement with a half-life of `balance_window_requests` (128) requests per candidate, the same window at any
    pool size and rate (a 30 s half-life held 8x fewer requests a worker at 64 workers than at 8); balance_gain
    2.5, ramped in as c / (c + 8), c = the requests placed in the last `balance_half_life_s` on the whole pool.
    Long-run balance that scales what a worker's MISSES cost (x0.08 for a worker with no recent work, x12 at
    twice the mean): a session's next turn (a block or two to compute
    at its holder, the whole context anywhere else) stays put, while a new session (only a shared prefix
    cached anywhere) goes to a worker that has done less, even at the price of that prefix. Added to the
    cost instead (max(0, recent - mean), the earlier rule), the term is tens of thousands of tokens on
    every warm worker, so the one worker below the mean soaked up other sessions' steps and queued them:
    agentic TTFT p99 0.389 s against least_loaded's 0.332 s; with the factor 0.10 s, load max/mean 1.09.
    A linear factor (1 + 0.8 r) did as well at 8 workers but left 64 at max/mean 1.66 on chat (each worker
    holds few sessions there; a new one must be worth moving a shared prefix for): exp(2.5 r) gives 1.18.
  While few requests were placed recently, a difference from the mean within half the request at hand (its
  prompt against the mean recent work, faded like the gain) counts as none: one long prompt among a few short ones
  is no imbalance (router/policy.py).
  A short best match needs no rule of its own: its few cached tokens barely lower the cost (a load-only
  fallback below 10% or 30% of the prompt changed no result on the seven traces).
- bounded load (consistent hashing with bounded loads, Mirrokni et al., in prompt tokens): where r(w) + 1 exceeds
  the cap, load_cap (1.1) + half a request (the rounding up of the cap in requests: the mean one, or the one at hand
  while few were placed; it matters only while the pool has placed few), cost(w) += (r(w) + 1 - cap) x the mean recent work (ramped in like the gain): the excess
  counts as if queued there. The balance factor alone tolerates a holder ~1.4x the mean, since its hits
  are cheap and moving one recomputes the prefix: at 64 workers the hot system prompts' holders ended at 1.42x
  (system_prompts), 1.45x at twice the rate. Past the cap the hot prefix is copied to a second worker once,
  and both take its hits; a session whose context is long stays put (its excess is small next to recomputing the
  context), and so does a huge document's follow-up. With the per-placement window: 1.28 / 1.29 (tests/router/
  test_router_locality.py has the rule on a small Zipf mix). Hard caps (skip a worker past 1.2 / 1.3 x the mean)
  moved those follow-ups too: heavy_tail at 64 workers fell from 98% to 77% of the pooled hit rate.
- anti-hot-spot guard: if the winner's request load exceeds the least-loaded worker's by more than
  `balance_abs_threshold` AND by more than `balance_rel_threshold` x, the least-loaded worker takes the
  request instead (a hot prefix whose prompts are all cheap would otherwise queue on one worker).
Reasons: "prefix_hit" (the winner has some of the prompt cached), "no_match" (nobody does: the least
work wins), "hotspot_guard".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.handoff import PrefixDigest
from router.dispatch import WorkerInfo
from router.prompt_hashes import HashScheme, PromptHasher, PromptHashes


class RecentWork:
    """Prompt tokens sent to each worker, exponentially decayed (half-life in the caller's clock: seconds, or
    placements per worker), O(1) per update: values are stored in units of 2 ** ((t - ref) / half_life), and rebased
    when that grows large."""

    def __init__(self, half_life_s: float):
        self.half_life_s = half_life_s
        self.ref: float | None = None
        self.stored: dict[str, float] = {}

    def scale(self, now: float) -> float:
        """2 ** ((now - ref) / half_life): stored / scale = the decayed value at `now`."""
        if self.ref is None:
            self.ref = now
        x = (now - self.ref) / self.half_life_s
        if x > 60.0:  # rebase before the scale overflows; drop what has decayed to nothing
            f = 2.0**-x
            self.stored = {w: v * f for w, v in self.stored.items() if v * f >= 1.0}
            self.ref, x = now, 0.0
        return 2.0 ** max(x, 0.0)

    def add(self, worker_id: str, tokens: float, now: float) -> None:
        self.stored[worker_id] = self.stored.get(worker_id, 0.0) + tokens * self.scale(now)


class CacheIndex:
    """The router's per-worker index of the workers' digests, inverted (block hash -> workers holding it),
    so a prompt's lookup costs its block count, not workers x blocks. `sync` applies the digests of a
    placement's candidates (a worker bumps its digest's version whenever the content changes, so an unchanged
    version is skipped without comparing sets; a changed one is diffed against the previous one);
    `drop` forgets a worker (down, restarted). on_published(worker, hashes): called with the blocks a worker's new
    digest added (the router's "soon cached" entries for them give way to the digest, router/pending_prefixes.py)."""

    def __init__(self, on_published: Callable[[str, Iterable[int]], None] | None = None):
        self.on_published = on_published
        self.digests: dict[str, PrefixDigest] = {}
        self.where: dict[tuple[int, bytes], dict[int, set[str]]] = {}
        self.hashers: dict[tuple[int, bytes], PromptHasher] = {}  # per (block, seed): the engine's names, remembered

    def sync(self, workers: Sequence[WorkerInfo]) -> None:
        for w in workers:
            d, old = w.prefix, self.digests.get(w.worker_id)
            if d is old or (
                d is not None
                and old is not None
                and d.version == old.version
                and d.block_tokens == old.block_tokens
                and d.seed == old.seed
            ):
                continue
            if d is None or old is None or (d.block_tokens, d.seed) != (old.block_tokens, old.seed):
                self.drop(w.worker_id)
                added, removed = (d.hashes if d is not None else frozenset()), frozenset[int]()
            else:  # the usual report: a few blocks stored or evicted since the last one
                added, removed = d.hashes - old.hashes, old.hashes - d.hashes
            if d is None:
                continue
            where = self.where.setdefault((d.block_tokens, d.seed), {})
            for h in removed:
                holders = where.get(h)
                if holders is not None:
                    holders.discard(w.worker_id)
                    if not holders:
                        del where[h]
            for h in added:
                where.setdefault(h, set()).add(w.worker_id)
            self.digests[w.worker_id] = d
            if self.on_published is not None and added:
                self.on_published(w.worker_id, added)

    def drop(self, worker_id: str) -> None:
        old = self.digests.pop(worker_id, None)
        if old is None:
            return
        where = self.where.get((old.block_tokens, old.seed), {})
        for h in old.hashes:
            holders = where.get(h)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del where[h]

    def scheme(self) -> HashScheme | None:
        """How the digests name blocks (the first scheme, if workers differ; None: no digest yet)."""
        for (block, seed), where in self.where.items():
            if where:
                return HashScheme(block, seed)
        return None

    def cached(
        self,
        prompt_ids: Sequence[int],
        given: PromptHashes | None = None,
        chains: dict[int, Sequence[int]] | None = None,
    ) -> dict[str, int]:
        """worker id -> prompt tokens it would serve from cache (workers absent: none). given: the prompt's hashes
        as its sender computed them (used where they are in the digests' scheme and cover the blocks needed).
        chains: filled with block size -> the prompt's block chain looked up in that scheme."""
        out: dict[str, int] = {}
        for (block, seed), where in self.where.items():
            if not where and chains is None:
                continue
            limit = max(0, (len(prompt_ids) - 1) // block)
            chain = given.covering(block, seed, limit) if given is not None else None
            if chain is None:
                hasher = self.hashers.get((block, seed))
                if hasher is None:
                    hasher = self.hashers[(block, seed)] = PromptHasher(block, seed)
                chain = hasher.hashes(prompt_ids, limit=limit)
            if chains is not None:  # even where nothing is cached yet: the router's own placements name blocks with it
                chains[block] = chain
            # Deepest block first: a worker's first hit is its cached prefix. Set differences run in C, where a
            # block shared by many workers would otherwise cost a Python step per holder per block.
            seen: set[str] = set()
            for k in range(len(chain) - 1, -1, -1):
                holders = where.get(chain[k])
                if holders is None or holders <= seen:
                    continue
                tokens = (k + 1) * block
                for wid in holders - seen:
                    if wid not in out:
                        out[wid] = tokens
                seen |= holders
        return out
