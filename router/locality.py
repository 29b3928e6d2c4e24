"""Prefix locality from the workers' real caches, and the cache-aware prefill choice built on it.

Each worker publishes a `PrefixDigest` with its stats (engine.prefix_cache.PrefixCache.digest): the hashes
of the blocks its prefix cache can resume after, the block size, and the hash seed (model + cache format).
The digest is bounded (one hash per snapshot slot) and replaced whole on every report, so a block the
worker evicted leaves the router's view at the next report, and a dead or restarted worker's view goes
with its WorkerInfo. The router names a prompt's blocks with the same function (`block_hashes`), once per
distinct (block size, seed), and a worker's cached prefix is the deepest prompt block in its digest.

Choice (`choose_by_cache`), for the healthy prefill candidates, all with digests:
- cached(w): prompt tokens w would serve from cache (at most prompt - 1: one token is always computed);
- cost(w) = pending(w) + prompt - cached(w): the prompt tokens w must compute before this request's first
  token, where pending(w) is the uncached prompt tokens this router sent to w whose prefill has not
  finished (RoutingPolicy tracks it: it does not lag like a load report). This is the Dynamo / LMetric
  family of rules: overlap is worth exactly the compute it saves, load costs exactly the compute queued.
- the lowest cost wins (ties: fewer requests there, then fewer pending tokens, then rotate);
- anti-hot-spot guard: if the winner's request load exceeds the least-loaded worker's by more than
  `balance_abs_threshold` AND by more than `balance_rel_threshold` x, the least-loaded worker takes the
  request instead (a hot prefix whose prompts are all cheap would otherwise queue on one worker).
Reasons: "prefix_hit" (the winner has some of the prompt cached), "no_match" (nobody does: the least
work wins), "hotspot_guard".
"""

from __future__ import annotations

from typing import Sequence

from engine.block_hash import block_hashes
from router.dispatch import WorkerInfo


def cached_tokens(prompt_ids: Sequence[int], workers: Sequence[WorkerInfo]) -> dict[str, int]:
    """worker id -> prompt tokens its digest says it would serve from cache (0 without a digest)."""
    n = len(prompt_ids)
    hashes: dict[tuple[int, bytes], tuple[list[int], frozenset]] = {}
    out = {}
    for w in workers:
        d = w.prefix
        if d is None or not d.hashes:
            out[w.worker_id] = 0
            continue
        key = (d.block_tokens, d.seed)
        if key not in hashes:  # a resume point must leave >= 1 prompt token to compute
            chain = block_hashes(prompt_ids, d.block_tokens, d.seed, limit=(n - 1) // d.block_tokens)
            hashes[key] = chain, frozenset(chain)
        chain, members = hashes[key]
        best = 0
        if members.isdisjoint(d.hashes):  # most workers hold none of the prompt: one C-level test
            out[w.worker_id] = 0
            continue
        for k in range(len(chain) - 1, -1, -1):
            if chain[k] in d.hashes:
                best = (k + 1) * d.block_tokens
                break
        out[w.worker_id] = best
    return out


def costs(prompt_len: int, cached: dict[str, int], pending: dict[str, int],
          recent: dict[str, float] | None = None) -> dict[str, float]:
    """worker id -> prompt tokens it must compute before this request's first token, plus (balance) its
    recent work above the candidates' mean."""
    excess = {}
    if recent:
        mean = sum(recent.values()) / len(recent)
        excess = {w: max(0.0, r - mean) for w, r in recent.items()}
    return {w: pending.get(w, 0) + prompt_len - c + excess.get(w, 0.0) for w, c in cached.items()}
