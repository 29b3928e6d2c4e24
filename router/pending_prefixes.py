"""Blocks a router sent to a prefill worker whose prefill has not been published yet: "soon cached" there.

A worker's `PrefixDigest` shows only prefills that ended (router/locality.py). In a saturated pool a session's
next turn often arrives while its last turn still waits in a worker's queue: the digests show its prefix
nowhere, so `cache_aware` placed it as a new session and it recomputed the whole context elsewhere (bursty
traffic at twice its rate: 58% of prefix-sharing requests arrived so, and cache_aware reached 78% of the pooled
hit rate). The engine looks a request's prefix up when it is admitted, not when it arrives
(engine.execution.scheduler.Scheduler._admit), so a turn queued behind its last turn on the same worker resumes
after it. Like SGLang's approximate tree, which inserts a prompt on dispatch, the router counts the blocks it
placed as cached on that worker until the worker's digest holds them (then the digest stands for them).

Bounded, and best-effort:
- an entry leaves when the worker's digest adds its block (`published`), after `ttl_s` (a prefill that failed,
  or a block the worker never snapshots: the digest holds only resumable blocks), or when the worker holds
  more than `max_blocks` entries (oldest first);
- a worker marked down, restarted or gone is forgotten (`drop`);
- per router replica: each replica knows only what it placed itself, so another replica places a follow-up on
  the digests alone, as before (no state is shared; every replica can still place any request).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PendingPrefixes:
    """worker -> block hash -> expiry (insertion order = age), and its inverse for lookups: hash -> its worker, or a
    set of them for a block sent to several. One worker is kept as its id, not a set of one: `add` runs inside
    every placement, and a set a block (a GC-tracked object) made the collector's full passes land there (decision
    p99 at 64 workers on the Mooncake trace 543 us, 219 us with the collector off)."""

    def __init__(self, ttl_s: float, max_blocks: int):
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.by_worker: dict[str, OrderedDict[int, float]] = {}
        self.where: dict[int, str | set[str]] = {}

    def __len__(self) -> int:
        return sum(len(b) for b in self.by_worker.values())

    def add(self, worker_id: str, chain: Sequence[int], now: float, cached_blocks: int = 0) -> None:
        """The prompt blocks `chain` (block 0 first) were sent to the worker at `now`; its digest shows the first
        `cached_blocks` (they need no entry). A prefill computing block k holds blocks 0..k after it, so the deepest
        entry alone says where the prefix will be: from the deepest block down, only blocks not sent there before are
        added (a session's next turn adds its new blocks, not its whole context: this runs on every placement)."""
        blocks = self.by_worker.setdefault(worker_id, OrderedDict())
        where, expiry = self.where, now + self.ttl_s
        for k in range(len(chain) - 1, cached_blocks - 1, -1):
            h = chain[k]
            if h in blocks:
                break
            blocks[h] = expiry
            holders = where.get(h)
            if holders is None:
                where[h] = worker_id
            elif isinstance(holders, str):
                if holders != worker_id:
                    where[h] = {holders, worker_id}
            else:
                holders.add(worker_id)
        self._trim(worker_id, blocks, now)

    def published(self, worker_id: str, hashes: Iterable[int]) -> None:
        """The worker's digest now holds these blocks: the digest stands for them from here on."""
        blocks = self.by_worker.get(worker_id)
        if not blocks:
            return
        for h in hashes:
            if blocks.pop(h, None) is not None:
                self._unindex(h, worker_id)

    def drop(self, worker_id: str) -> None:
        for h in self.by_worker.pop(worker_id, {}):
            self._unindex(h, worker_id)

    def cached(self, chain: Sequence[int], block_tokens: int, now: float) -> dict[str, int]:
        """worker id -> prompt tokens of `chain`'s deepest block sent there and not expired (workers absent: none)."""
        out: dict[str, int] = {}
        if not self.where:
            return out
        # Deepest block first: a worker's first live entry is its deepest. A block sent to many workers (a shared
        # system prompt) is skipped in one set test once they all have a deeper one (as in CacheIndex.cached).
        where, by_worker = self.where, self.by_worker
        found: set[str] = set()
        for k in range(len(chain) - 1, -1, -1):
            h = chain[k]
            holders = where.get(h)
            if holders is None:
                continue
            if isinstance(holders, str):
                if holders not in found and by_worker[holders][h] > now:
                    out[holders] = (k + 1) * block_tokens
                    found.add(holders)
                continue
            if holders <= found:
                continue
            for wid in holders - found:
                if by_worker[wid][h] > now:
                    out[wid] = (k + 1) * block_tokens
                    found.add(wid)
        return out

    def _trim(self, worker_id: str, blocks: OrderedDict[int, float], now: float) -> None:
        """Oldest first: expired entries, then any beyond max_blocks (entries are in the order they were sent; a
        chain's deepest block first, so a capped chain keeps its prefix)."""
        while blocks:
            h, expiry = next(iter(blocks.items()))
            if expiry > now and len(blocks) <= self.max_blocks:
                break
            del blocks[h]
            self._unindex(h, worker_id)

    def _unindex(self, h: int, worker_id: str) -> None:
        holders = self.where.get(h)
        if holders is None:
            return
        if isinstance(holders, str):
            if holders == worker_id:
                del self.where[h]
            return
        holders.discard(worker_id)
        if len(holders) == 1:
            self.where[h] = next(iter(holders))
        elif not holders:
            del self.where[h]
