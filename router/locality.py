"""Prefix locality from the workers' real caches, and the cache-aware prefill choice built on it.

Each worker publishes a `PrefixDigest` with its stats (engine.execution.prefix_cache.PrefixCache.digest): the hashes
of the blocks its prefix cache can resume after, the block size, and the hash seed (model + cache format).
The digest is bounded (one hash per snapshot slot) and replaced whole on every report, so a block the
worker evicted leaves the router's view at the next report, and a dead or restarted worker's view goes
with its WorkerInfo. The router names a prompt's blocks with the same function (`block_hashes`), once per
distinct (block size, seed), and a worker's cached prefix is the deepest prompt block in its digest
(`CacheIndex.cached`, which `RoutingPolicy.choose_by_cache` calls for every placement).

Choice (`choose_by_cache`), for the healthy prefill candidates, all with digests:
- cached(w): prompt tokens w would serve from cache (at most prompt - 1: one token is always computed);
- cost(w) = pending(w) + prompt - cached(w): the prompt tokens w must compute before this request's first
  token, where pending(w) is the uncached prompt tokens this router sent to w whose prefill has not
  finished (RoutingPolicy tracks it: it does not lag like a load report). This is the Dynamo / LMetric
  family of rules, with the prompt's uncached tokens weighted by `PolicyConfig.uncached_weight` (2): a prefix
  recomputed elsewhere delays every later request and its copy evicts other prefixes, so a growing session
  leaves the worker holding it only when that worker's queue is longer by more than twice the cached part.
  With weight 1 (overlap worth exactly the compute it saves) bursts and heavy-tailed lengths scattered
  sessions: 86% / 91% of the pooled hit rate on the `bursty` / `heavy_tail` traces, 96% / 96% at 2.
- the lowest cost wins (ties: fewer requests there, then fewer pending tokens, then rotate);
- anti-hot-spot guard: if the winner's request load exceeds the least-loaded worker's by more than
  `balance_abs_threshold` AND by more than `balance_rel_threshold` x, the least-loaded worker takes the
  request instead (a hot prefix whose prompts are all cheap would otherwise queue on one worker).
Reasons: "prefix_hit" (the winner has some of the prompt cached), "no_match" (nobody does: the least
work wins), "hotspot_guard".
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.execution.block_hash import block_hashes
from engine.handoff import PrefixDigest
from router.dispatch import WorkerInfo


class RecentWork:
    """Prompt tokens sent to each worker, exponentially decayed (half-life in seconds), O(1) per update:
    values are stored in units of 2 ** ((t - ref) / half_life), and rebased when that grows large."""

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
    `drop` forgets a worker (down, restarted)."""

    def __init__(self):
        self.digests: dict[str, PrefixDigest] = {}
        self.where: dict[tuple[int, bytes], dict[int, set[str]]] = {}

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
                added, removed = (d.hashes if d is not None else ()), ()
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

    def cached(self, prompt_ids: Sequence[int]) -> dict[str, int]:
        """worker id -> prompt tokens it would serve from cache (workers absent: none)."""
        out: dict[str, int] = {}
        for (block, seed), where in self.where.items():
            if not where:
                continue
            chain = block_hashes(prompt_ids, block, seed, limit=(len(prompt_ids) - 1) // block)
            for k in range(len(chain) - 1, -1, -1):
                for wid in where.get(chain[k], ()):
                    if wid not in out:
                        out[wid] = (k + 1) * block
        return out
