"""Where a request runs: prefix locality and load for prefill, free KV capacity and load for decode.

Pure Python (no gRPC, no torch: the engine's block hasher it imports is pure Python) so every rule is unit-tested on its own (tests/router/test_router_policy.py).
Not thread-safe: the router calls it from one asyncio event loop.

Prefix locality is approximate, as in SGLang's cache-aware router and llm-d's hashed-block scorer: the
router cannot see a worker's cache, so it remembers which prompt blocks it SENT to which prefill worker
(`BlockLRU`, bounded, least recently routed first out) and assumes those are still cached there. Blocks
are fixed-size runs of `block_size` tokens hashed as a chain (block i's hash covers blocks 0..i, like vLLM
and SGLang prefix caching), so "block i matches" implies the whole prefix up to i matches. The hasher is
the engine's (`engine.execution.block_hash.block_hashes`), the one the real-locality path below uses too.

Prefill rule of `cache_aware` (the default), for the healthy prefill candidates:
1. match = the longest run of leading prompt blocks a worker has seen. If the best match covers less
   than `cache_threshold` of the prompt's blocks (or the prompt has no full block) -> least loaded,
   reason "no_match".
2. best = the worker with the best match (ties: least loaded). Hot-spot guard (SGLang's
   `balance_abs_threshold` / `balance_rel_threshold`): if load(best) - min_load > abs_threshold AND
   load(best) > rel_threshold * min_load, a popular prefix would drag all traffic to one worker, so the
   request goes to the least-loaded worker instead, reason "hotspot_guard" (which also warms a second
   copy of the prefix there).
3. else best, reason "prefix_hit".
`least_loaded` and `round_robin` ignore the prefix (reasons "least_loaded" / "round_robin"); all policies
still record the blocks so that switching policy, and Stats, see the same state.

Load = max(the worker's reported running + waiting, the requests this router has in flight there):
reported load lags, and without the in-flight term a burst would all land on the same worker before its
next report (the "load never updated, everything on worker 0" failure). Ties on load go to the worker
with fewer remembered blocks (more room for a new prefix), then rotate, so idle workers share traffic.

Real locality: when every prefill candidate publishes a `PrefixDigest` (what its engine's prefix cache
can resume from, router/locality.py), nothing is estimated or recorded: `cache_aware` picks the worker
with the least prompt compute queued + needed (`choose_by_cache`: pending uncached tokens this router sent
there, plus this prompt's uncached tokens there, weighted by `uncached_weight`, the backlog and the
worker's recent work: router/locality.py has the rule), under the same hot-spot guard;
`Decision.cached_tokens` is the chosen worker's real cached prefix. A prompt's blocks this router sent to a
worker count as cached there until its digest holds them (`Decision.soon_cached_tokens`, router/pending_prefixes.py:
the engine looks a prefix up at admission, so a follow-up queued behind its first turn resumes after it; per
replica, bounded, best-effort). The router calls `prefill_done` when a prefill ends. Prompts are hashed through
`router.prompt_hashes.PromptHasher` (the engine's names, remembered per prefix: a session's next turn hashes only its
new blocks).

Decode rule: a `colocated` prefill worker decodes its own request (reason "colocated"). Otherwise among
healthy `decode` workers: those whose effective free KV (reported free tokens minus the tokens of
requests in flight there, which the report may not show yet) fits prompt + max_new_tokens; the most free
capacity first, then the least load (reason "kv_capacity"). If none fits, the same order over all of them
(reason "no_capacity": the request waits in that worker's queue).
Admission (decode slots and pages): a worker that reports what it admits when idle (`max_slots`,
`kv_capacity_tokens`, `kv_page_tokens`) has effective free slots = max_slots - this router's requests in
flight there, and effective free tokens = capacity - their reservations rounded up to whole pages (what the
worker itself reserves). These do not lag like load reports do. `can_admit` says whether some decode worker
fits a request now; the router queues the request until one does (router/server.py).

Health: a worker is a candidate only if the dispatcher reports it healthy, not `draining` (leaving an elastic
pool: its streams finish, nothing new goes there) AND the router has not marked it down (`set_health`). A worker
no longer listed at all left its pool: everything known of it, its digest included, is dropped. Going down forgets its blocks (its cache is gone, and a dead worker must not stay
in the tree); `set_health(worker, True)` adds it back, with an empty history. A changed
`WorkerInfo.incarnation` (restarted between two probes) forgets its blocks too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from math import exp, inf

from router import locality
from router.block_lru import BlockLRU
from router.dispatch import DECODE_ROLES, PREFILL_ROLES, NoWorkerAvailable, WorkerInfo
from router.pending_prefixes import PendingPrefixes
from router.prompt_hashes import HashScheme, PromptHasher, PromptHashes

POLICIES = ("round_robin", "least_loaded", "cache_aware")
PREFILL_REASONS = ("prefix_hit", "least_loaded", "round_robin", "hotspot_guard", "no_match", "local_prefill")
DECODE_REASONS = ("colocated", "kv_capacity", "no_capacity")


# cache_aware's balance term at half gain once this many requests were placed recently, in all (router/locality.py)
BALANCE_MIN_REQUESTS = 8.0

# The estimate's blocks are named by the engine's hasher (one encoding in the tree); the seed only has to be
# the same for every router replica, since these hashes never meet a worker's digest.
ESTIMATE_SEED = b"\0" * 8


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "cache_aware"
    block_size: int = 16  # tokens per hashed block
    lru_blocks: int = 1 << 16  # blocks remembered per prefill worker (1M tokens at 16 a block)
    cache_threshold: float = 0.3  # min fraction of the prompt's blocks matched to follow the prefix
    balance_abs_threshold: int = 64  # hot-spot guard: load(best) - min_load must exceed this ...
    balance_rel_threshold: float = 1.5  # ... and load(best) must exceed this x min_load
    # cache_aware on real digests (router/locality.py has the rule and the measurements behind these):
    # a prompt token a worker must compute counts this many times a token already queued there (a prefix
    # recomputed elsewhere delays every later request there too, and its copy evicts other prefixes) ...
    uncached_weight: float = 2.0
    # ... times (1 + backlog_gain x the shortest queue of prompt tokens among the candidates / this prompt's
    # tokens): when every worker has a queue, recomputing a prefix only adds to the total backlog, so sessions
    # stick harder (the shortest queue, not the mean: a long queue on the holder alone must not make it stickier)
    backlog_gain: float = 0.5
    # ... times exp(balance_gain x r), r = the worker's prompt tokens computed recently / the candidates' mean - 1,
    # at most 1: a busy worker's misses cost more, a cold one's less, while a session's next turn (few tokens to
    # compute where its prefix is) stays put. The gain ramps in with the requests placed in the last
    # balance_half_life_s (a few requests are no load signal).
    balance_gain: float = 2.5
    balance_half_life_s: float = 30.0
    # "Recently" decays per placement, not per second: a half-life of this many requests per candidate, so the
    # balance term sees as many requests a worker at any pool size and arrival rate (a 30 s half-life held 8x fewer
    # a worker at 64 workers than at 8, and forgot a large prefill before the pool had evened it out).
    balance_window_requests: float = 128.0
    # Bounded load (consistent hashing with bounded loads, in prompt tokens): a worker whose recent work exceeds
    # load_cap x the candidates' mean pays the excess tokens as if they were queued there, so a hot prefix's
    # holder overflows to a second worker (which then holds it too) instead of drifting ever further above the mean.
    load_cap: float = 1.1
    # Conditional disaggregation (cache_aware on real digests): a request whose part not cached on its
    # decode worker is at most this many tokens is prefilled there, skipping the transfer. 0 = off (the
    # crossover of transfer cost vs prefill on the decode batch has not been measured on GPUs yet).
    local_prefill_tokens: int = 0
    # "Soon cached" (router/pending_prefixes.py): the prompt blocks this router sent to a prefill worker count as
    # cached there until its digest holds them, for at most this long (a failed prefill, a block never snapshotted) ...
    pending_prefix_ttl_s: float = 60.0
    # ... and at most this many blocks a worker (oldest out first)
    pending_prefix_blocks: int = 1 << 14
    # Admission also counts what each decode worker reports it holds (running + waiting requests, KV tokens in
    # use), not only this router's in-flight requests: for routers that place but never see a stream end
    # (router/server.py `Place`), where several routers share the workers.
    reported_load: bool = False

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"unknown routing policy {self.name!r}; choose one of {POLICIES}")
        if self.block_size < 1 or self.lru_blocks < 1:
            raise ValueError(f"block_size and lru_blocks must be >= 1, got {self.block_size}, {self.lru_blocks}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.pending_prefix_ttl_s < 0 or self.pending_prefix_blocks < 0:
            raise ValueError(
                "pending_prefix_ttl_s and pending_prefix_blocks must be >= 0, got "
                f"{self.pending_prefix_ttl_s}, {self.pending_prefix_blocks}"
            )
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")
        if self.uncached_weight < 1.0:
            raise ValueError(f"uncached_weight must be >= 1, got {self.uncached_weight}")
        if self.balance_half_life_s <= 0 or self.balance_window_requests <= 0:
            raise ValueError(
                "balance_half_life_s and balance_window_requests must be > 0, got "
                f"{self.balance_half_life_s}, {self.balance_window_requests}"
            )
        if self.load_cap < 1.0:
            raise ValueError(f"load_cap must be >= 1, got {self.load_cap}")
        if self.balance_gain < 0.0 or self.backlog_gain < 0.0:
            raise ValueError(
                f"balance_gain and backlog_gain must be >= 0, got {self.balance_gain}, {self.backlog_gain}"
            )
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(
                "balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1, got "
                f"{self.balance_abs_threshold}, {self.balance_rel_threshold}"
            )


@dataclass(frozen=True)
class Decision:
    """One routing choice; `reason` feeds the router's decision counters."""

    stage: str  # "prefill" | "decode"
    worker_id: str
    reason: str
    matched_blocks: int = 0  # prefill: leading prompt blocks the chosen worker was sent before
    prompt_blocks: int = 0
    cached_tokens: int = 0  # prefill, from workers' digests: prompt tokens the chosen worker's cache holds
    # prefill, beyond cached_tokens: prompt tokens of an earlier prefill this router sent there, not yet in its digest
    # (router/pending_prefixes.py): cached by the time this one is admitted, if that one is ahead of it
    soon_cached_tokens: int = 0
    uncached_tokens: int = 0  # prefill: prompt tokens it computes (pending there until `prefill_done`)


@dataclass(frozen=True)
class Placement:
    prefill: Decision
    decode: Decision


class RoutingPolicy:
    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self._lru: dict[str, BlockLRU] = {}
        self._down: set[str] = set()
        self._incarnation: dict[str, str] = {}
        self._inflight: Counter[str] = Counter()
        self._reserved: Counter[str] = Counter()  # KV tokens of in-flight requests, per decode worker
        self._page_tokens: dict[str, int] = {}  # per worker: a reservation is rounded up to these many tokens
        self._rr = 0  # round-robin cursor
        self._tie = 0  # rotates among equally good workers
        self._pending: Counter[str] = Counter()  # uncached prompt tokens sent, prefill not finished (per worker)
        # uncached prompt tokens sent, decayed per placement: its clock counts placements per candidate
        self._recent = locality.RecentWork(self.config.balance_window_requests)
        self._placements = 0.0
        self._window_requests = locality.RecentWork(self.config.balance_window_requests)  # on the same clock
        self._recent_requests = locality.RecentWork(self.config.balance_half_life_s)  # requests placed, all workers
        # blocks this router sent to a prefill worker, not yet in its digest; they give way to it when it adds them
        self._soon = PendingPrefixes(self.config.pending_prefix_ttl_s, self.config.pending_prefix_blocks)
        self._index = locality.CacheIndex(self._soon.published)  # the workers' published digests, inverted
        self._estimate_hasher = PromptHasher(self.config.block_size, ESTIMATE_SEED)
        self.hash_scheme: HashScheme | None = None  # how the last placement named prompt blocks (callers send these)

    # ---- state the server feeds in ---------------------------------------------------------
    def set_health(self, worker_id: str, healthy: bool) -> bool:
        """Record a health verdict; returns True when it changed the worker's state."""
        if healthy:
            if worker_id in self._down:
                self._down.discard(worker_id)
                return True
            return False
        self.forget(worker_id)
        if worker_id not in self._down:
            self._down.add(worker_id)
            return True
        return False

    def observe(self, workers: Iterable[WorkerInfo]) -> None:
        """Index the prefix digests of fresh worker reports (the router calls this when its probes land), so a
        placement finds them indexed and only matches and scores (`place` still indexes any newer one it sees)."""
        self._index.sync([w for w in workers if w.prefix is not None and self.is_up(w)])

    def forget(self, worker_id: str) -> None:
        """Drop what the router believes is cached on the worker (it died or restarted)."""
        lru = self._lru.get(worker_id)
        if lru is not None:
            lru.clear()
        self._index.drop(worker_id)
        self._soon.drop(worker_id)

    def _retire_absent(self, workers: list[WorkerInfo]) -> None:
        """Workers no longer listed left their pool (service/pools.py): drop everything known of them, their
        prefix digest first (a removed worker must not stay in the cache index)."""
        listed = {w.worker_id for w in workers}
        for wid in self._incarnation.keys() - listed:
            self.forget(wid)
            del self._incarnation[wid]
            self._lru.pop(wid, None)
            self._page_tokens.pop(wid, None)
        if self._down:  # a stream that outlived its worker's drain marks it down after it left
            self._down &= listed

    def is_up(self, worker: WorkerInfo) -> bool:
        return worker.healthy and worker.worker_id not in self._down

    def acquire(self, worker_id: str, kv_tokens: int = 0) -> None:
        """A request of this router now occupies the worker (until `release`)."""
        self._inflight[worker_id] += 1
        self._reserved[worker_id] += self._round(worker_id, kv_tokens)

    def release(self, worker_id: str, kv_tokens: int = 0) -> None:
        self._inflight[worker_id] -= 1
        self._reserved[worker_id] -= self._round(worker_id, kv_tokens)
        if self._inflight[worker_id] <= 0:  # keep the counters small and never negative
            del self._inflight[worker_id]
            self._reserved.pop(worker_id, None)

    # ---- views -------------------------------------------------------------------------------
    def load(self, worker: WorkerInfo) -> int:
        return max(worker.load, self._inflight[worker.worker_id])

    def inflight(self, worker_id: str) -> int:
        return self._inflight[worker_id]

    def cached_blocks(self, worker_id: str) -> int:
        lru = self._lru.get(worker_id)
        return len(lru) if lru is not None else 0

    def effective_free_tokens(self, worker: WorkerInfo) -> int:
        if worker.kv_capacity_tokens:
            used = worker.kv_capacity_tokens - worker.kv_free_tokens if self.config.reported_load else 0
            return max(0, worker.kv_capacity_tokens - max(0, used) - self._reserved[worker.worker_id])
        return max(0, worker.kv_free_tokens - self._reserved[worker.worker_id])

    def effective_free_slots(self, worker: WorkerInfo) -> int | None:
        """Batch slots the worker can still admit from this router; None = not reported (not limiting)."""
        if not worker.max_slots:
            return None
        held = worker.load if self.config.reported_load else 0
        return max(0, worker.max_slots - held - self._inflight[worker.worker_id])

    def fits(self, worker: WorkerInfo, max_total_tokens: int) -> bool:
        """Would the decode worker accept a request of this many cache positions right now?"""
        slots = self.effective_free_slots(worker)
        return (slots is None or slots > 0) and self.effective_free_tokens(worker) >= self._round(
            worker.worker_id, max_total_tokens, worker
        )

    def can_admit(self, max_total_tokens: int, workers: Iterable[WorkerInfo], exclude: Iterable[str] = ()) -> bool:
        """True when a healthy decode worker fits the request now (or none ever could: the engine then
        rejects it with a clear error instead of it waiting for nothing), or there are no decode workers."""
        excluded = set(exclude)
        cands = [
            w
            for w in workers
            if w.role == "decode" and self.is_up(w) and not w.draining and w.worker_id not in excluded
        ]
        if not cands:
            return True
        if any(self.fits(w, max_total_tokens) for w in cands):
            return True
        return all(
            w.kv_capacity_tokens and self._round(w.worker_id, max_total_tokens, w) > w.kv_capacity_tokens for w in cands
        )

    def _round(self, worker_id: str, tokens: int, worker: WorkerInfo | None = None) -> int:
        page = max(1, worker.kv_page_tokens if worker is not None else self._page_tokens.get(worker_id, 1))
        if worker is not None:
            self._page_tokens[worker_id] = page
        return -(-tokens // page) * page

    # ---- decisions ---------------------------------------------------------------------------
    def place(
        self,
        prompt_ids: Sequence[int],
        max_total_tokens: int,
        workers: Iterable[WorkerInfo],
        exclude: Iterable[str] = (),
        now: float | None = None,
        hashes: PromptHashes | None = None,
    ) -> Placement:
        """Choose the prefill and the decode worker, and remember the prompt's blocks on the prefill one.
        hashes: the prompt's block hashes as the caller computed them (in `hash_scheme`; otherwise, or None, the
        prompt is hashed here). Raises NoWorkerAvailable when no healthy worker can take a phase."""
        workers = list(workers)
        if self._introduce(workers):  # the pools changed (a cheap test: runs per request)
            self._retire_absent(workers)
        excluded = set(exclude)
        down = self._down
        up = [
            w
            for w in workers
            if w.healthy and not w.draining and w.worker_id not in down and w.worker_id not in excluded
        ]
        prefill_cands = [w for w in up if w.role in PREFILL_ROLES]
        if not prefill_cands:
            raise NoWorkerAvailable(
                f"no healthy prefill worker (excluded: {sorted(excluded)}; down: {sorted(self._down)})"
            )
        # Every candidate publishes its real cache (router.locality): no estimate is needed or recorded.
        real = all(w.prefix is not None for w in prefill_cands)
        estimate = [] if real else self._estimate_hashes(prompt_ids, hashes)
        local = self._local_prefill(prompt_ids, max_total_tokens, up, prefill_cands, hashes) if real else None
        if local is not None:
            self.hash_scheme = self._index.scheme()
            self._pending[local.prefill.worker_id] += local.prefill.uncached_tokens
            return local
        if real and self.config.name == "cache_aware":
            now = time.monotonic() if now is None else now
            prefill = self.choose_by_cache(prompt_ids, prefill_cands, now, hashes)
            self.hash_scheme = self._index.scheme()
        else:
            prefill = self.choose_prefill(estimate, prefill_cands)
            prefill = replace(prefill, uncached_tokens=len(prompt_ids))
        chosen = next(w for w in prefill_cands if w.worker_id == prefill.worker_id)
        decode_cands = [] if chosen.role == "colocated" else [w for w in up if w.role in DECODE_ROLES]
        decode = self.choose_decode(max_total_tokens, decode_cands, chosen)
        if not real:
            self._lru_of(prefill.worker_id).insert(estimate)
        self._pending[prefill.worker_id] += prefill.uncached_tokens
        return Placement(prefill, decode)

    def _introduce(self, workers: list[WorkerInfo]) -> bool:
        """Note each worker's incarnation, forgetting the cache of one that restarted or is unhealthy; -> whether
        the listed workers differ from those known (one joined, or one left)."""
        known_of, joined = self._incarnation, False
        for w in workers:
            known = known_of.get(w.worker_id)
            if known == w.incarnation and w.healthy:  # the usual case: nothing to do
                continue
            joined = joined or known is None
            if not w.healthy or known is not None:
                self.forget(w.worker_id)
            known_of[w.worker_id] = w.incarnation
        return joined or len(known_of) != len(workers)

    def _estimate_hashes(self, prompt_ids: Sequence[int], given: PromptHashes | None) -> Sequence[int]:
        """The prompt's blocks named for the router's own estimate: the caller's names when they are in its scheme."""
        b = self.config.block_size
        self.hash_scheme = HashScheme(b, ESTIMATE_SEED)
        chain = given.covering(b, ESTIMATE_SEED, len(prompt_ids) // b) if given is not None else None
        return chain if chain is not None else self._estimate_hasher.hashes(prompt_ids)

    def _local_prefill(
        self,
        prompt_ids: Sequence[int],
        max_total_tokens: int,
        up: list[WorkerInfo],
        prefill_cands: list[WorkerInfo],
        hashes: PromptHashes | None,
    ) -> Placement | None:
        """Conditional disaggregation: the decode worker (placed by free KV, as always) prefills the request
        itself when the part of the prompt its own cache lacks is short; None otherwise."""
        limit = self.config.local_prefill_tokens
        decode_cands = [w for w in up if w.role == "decode"]
        if (
            limit <= 0
            or self.config.name != "cache_aware"
            or not decode_cands
            or any(w.role == "colocated" for w in prefill_cands)
        ):
            return None
        decode = self.choose_decode(max_total_tokens, decode_cands, prefill_cands[0])
        worker = next(w for w in decode_cands if w.worker_id == decode.worker_id)
        if worker.prefix is None:
            return None
        self._index.sync([worker])
        n = len(prompt_ids)
        c = self._index.cached(prompt_ids, hashes).get(worker.worker_id, 0)
        if n - c > limit:
            return None
        return Placement(
            Decision("prefill", worker.worker_id, "local_prefill", cached_tokens=c, uncached_tokens=n - c), decode
        )

    def prefill_done(self, worker_id: str, uncached_tokens: int) -> None:
        """The prefill `place` sent there is over (first token, or the request ended): no longer pending."""
        self._pending[worker_id] -= uncached_tokens
        if self._pending[worker_id] <= 0:
            del self._pending[worker_id]

    def pending_tokens(self, worker_id: str) -> int:
        return self._pending[worker_id]

    def choose_by_cache(
        self,
        prompt_ids: Sequence[int],
        candidates: Sequence[WorkerInfo],
        now: float,
        hashes: PromptHashes | None = None,
    ) -> Decision:
        """cache_aware over real digests (router.locality): the least pending + weight x uncached x balance,
        under the hot-spot guard. One pass over the candidates with a few dict reads each (runs per request: at 64
        workers this pass, not the matching, is most of the decision; bound methods and a cap test instead of
        min() make it cheaper than a plain loop; list comprehensions column by column cost more)."""
        n = len(prompt_ids)
        self._placements += 1.0 / len(candidates)
        self._index.sync(candidates)
        chains: dict[int, Sequence[int]] = {}  # block size -> the prompt's chain in the digests' scheme
        real = self._index.cached(prompt_ids, hashes, chains)
        soon = self._soon_cached(chains, real, now)
        cached = {**real, **{wid: real.get(wid, 0) + extra for wid, extra in soon.items()}} if soon else real
        cfg, pending, inflight = self.config, self._pending, self._inflight
        stored_of, pending_of, cached_of, inflight_of = self._recent.stored.get, pending.get, cached.get, inflight.get
        # The shortest queue is 0 unless every candidate has prompt tokens pending (`_pending` drops zeros).
        shortest = min([pending_of(w.worker_id, 0) for w in candidates]) if len(pending) >= len(candidates) else 0
        weight = cfg.uncached_weight * (1.0 + cfg.backlog_gain * shortest / max(n, 1))
        total = sum([stored_of(w.worker_id, 0.0) for w in candidates]) if self._recent.stored else 0.0
        # r = recent / mean - 1 (the decay scale cancels out of the ratio); no recent work anywhere: r = 0
        per_mean = len(candidates) / total if total > 0 else 0.0
        # A few requests are no load signal: the gain grows with the requests placed recently, all workers together
        # (c / (c + 8)), so two idle workers do not trade a cached prefix for "balance" after one request. Counted
        # over the pool, not per worker: per worker, a pool 8x larger would see 8x fewer and barely balance at all
        # (at 64 workers that left max/mean load 1.39 on the mooncake trace, 1.30 on chat; pooled, 1.28 and 1.18).
        recent = self._recent_requests.stored.get("", 0.0) / self._recent_requests.scale(now)
        gain = cfg.balance_gain * recent / (recent + BALANCE_MIN_REQUESTS)
        cap = exp(gain)  # the factor at r >= 1
        # Loads are lumpy at the size of the requests placed. While few requests were placed recently (the gain's
        # ramp: a few requests are no load signal) one long prompt is much of a worker's recent work: after a dozen
        # short requests a 302-token prompt put its worker at 1.7x the mean of a 2-worker pool and the other at
        # 0.3x, and the balance factor (x8.8 between them) and the cap moved the same session's next turn off its
        # 256 cached tokens (test_one_long_prompt_does_not_push_its_sessions_next_turn_off_its_holder). So a
        # difference from the mean within half the request at hand (its whole prompt, in units of the mean recent
        # work, faded as the gain ramps in) is no imbalance: `band` is taken off |r|, and the cap's slack (half a
        # request, Mirrokni's rounding of a cap in requests) is half the larger of the mean request and that.
        # Unfaded, the prompt term unbalanced 64 workers (whole prompts against recent work counted in uncached
        # tokens: long_sessions and agentic max/mean 1.25 -> 1.40 and 1.26 -> 1.48, scripts/bench_route.py).
        mean_work = total / len(candidates) / self._recent.scale(self._placements)
        over = mean_work * gain / cfg.balance_gain if gain else 0.0
        placed = self._window_requests.stored.get("", 0.0) / self._window_requests.scale(self._placements)
        few = BALANCE_MIN_REQUESTS / (recent + BALANCE_MIN_REQUESTS)
        at_hand = n / mean_work * few if mean_work > 0 else 0.0
        band = 0.5 * at_hand
        # Bounded load: the tokens of recent work above the cap (load_cap x the mean + the slack above) count as
        # queued (ramped in like the gain), so a worker that took one of a pool's first few requests is not over it.
        bound = cfg.load_cap + 0.5 * max(len(candidates) / placed, at_hand) if placed else inf
        best_cost, best_load, min_load = inf, 0, inf
        ties: list[WorkerInfo] = []
        for w in candidates:
            wid = w.worker_id
            x = stored_of(wid, 0.0) * per_mean if per_mean else 1.0  # r + 1
            r = x - 1.0
            r = r - band if r > band else (r + band if r < -band else 0.0)
            cost = pending_of(wid, 0) + weight * (n - cached_of(wid, 0)) * (exp(gain * r) if r < 1.0 else cap)
            if x > bound:
                cost += (x - bound) * over
            load = w.running + w.waiting
            if inflight:
                mine = inflight_of(wid, 0)
                if mine > load:
                    load = mine
            if cost < best_cost or (cost == best_cost and load < best_load):
                best_cost, best_load, ties = cost, load, [w]
            elif cost == best_cost and load == best_load:
                ties.append(w)
            if load < min_load:
                min_load = load
        best, reason = self._rotate(ties), None
        if self._hot(best_load, int(min_load)):
            least = [w for w in candidates if max(w.running + w.waiting, inflight_of(w.worker_id, 0)) == min_load]
            best, reason = self._rotate(least), "hotspot_guard"
        c, sc = real.get(best.worker_id, 0), soon.get(best.worker_id, 0)
        reason = reason or ("prefix_hit" if c + sc else "no_match")
        self._recent.add(best.worker_id, n - c - sc, self._placements)
        self._window_requests.add("", 1.0, self._placements)
        self._recent_requests.add("", 1.0, now)
        for block, chain in chains.items():  # "soon cached" there for the next placements (router/pending_prefixes.py)
            self._soon.add(best.worker_id, chain, now, c // block)
        return Decision(
            "prefill", best.worker_id, reason, cached_tokens=c, soon_cached_tokens=sc, uncached_tokens=n - c - sc
        )

    def _soon_cached(self, chains: dict[int, Sequence[int]], cached: dict[str, int], now: float) -> dict[str, int]:
        """worker -> prompt tokens of the prompt's deepest block this router sent there, beyond its digest's."""
        out: dict[str, int] = {}
        if not self._soon.where:
            return out
        for block, chain in chains.items():
            for wid, tokens in self._soon.cached(chain, block, now).items():
                extra = tokens - cached.get(wid, 0)
                if extra > out.get(wid, 0):
                    out[wid] = extra
        return out

    def _rotate(self, tied: list):
        if len(tied) == 1:
            return tied[0]
        self._tie += 1
        return tied[(self._tie - 1) % len(tied)]

    def choose_prefill(self, hashes: Sequence[int], candidates: Sequence[WorkerInfo]) -> Decision:
        name, total = self.config.name, len(hashes)
        if name == "round_robin":
            w = candidates[self._rr % len(candidates)]
            self._rr += 1
            return Decision("prefill", w.worker_id, "round_robin", self._match(w, hashes), total)
        if name == "least_loaded":
            w = self._least_loaded(candidates)
            return Decision("prefill", w.worker_id, "least_loaded", self._match(w, hashes), total)
        matches = {w.worker_id: self._match(w, hashes) for w in candidates}
        best_len = max(matches.values())
        if total == 0 or best_len == 0 or best_len < self.config.cache_threshold * total:
            w = self._least_loaded(candidates)
            return Decision("prefill", w.worker_id, "no_match", matches[w.worker_id], total)
        best = self._least_loaded([w for w in candidates if matches[w.worker_id] == best_len])
        least = self._least_loaded(candidates)
        if self._hot(self.load(best), self.load(least)):
            return Decision("prefill", least.worker_id, "hotspot_guard", matches[least.worker_id], total)
        return Decision("prefill", best.worker_id, "prefix_hit", best_len, total)

    def choose_decode(self, max_total_tokens: int, candidates: Sequence[WorkerInfo], prefill: WorkerInfo) -> Decision:
        if prefill.role == "colocated":
            return Decision("decode", prefill.worker_id, "colocated")
        # A colocated worker has no KV import path: only dedicated decode workers take hand-offs.
        cands = [w for w in candidates if w.role == "decode"]
        if not cands:
            raise NoWorkerAvailable("no healthy decode worker")
        fits = [w for w in cands if self.fits(w, max_total_tokens)]
        pool, reason = (fits, "kv_capacity") if fits else (cands, "no_capacity")
        most_free = max(self.effective_free_tokens(w) for w in pool)
        top = [w for w in pool if self.effective_free_tokens(w) == most_free]
        return Decision("decode", self._least_loaded(top, by_cache=False).worker_id, reason)

    # ---- helpers ----------------------------------------------------------------------------
    def _hot(self, best_load: int, min_load: int) -> bool:
        c = self.config
        return best_load - min_load > c.balance_abs_threshold and best_load > c.balance_rel_threshold * min_load

    def _least_loaded(self, candidates: Sequence[WorkerInfo], by_cache: bool = True) -> WorkerInfo:
        def key(w):
            return (self.load(w), self.cached_blocks(w.worker_id) if by_cache else 0)

        best = min(key(w) for w in candidates)
        tied = [w for w in candidates if key(w) == best]
        if len(tied) == 1:
            return tied[0]
        self._tie += 1
        return tied[(self._tie - 1) % len(tied)]

    def _match(self, worker: WorkerInfo, hashes: Sequence[int]) -> int:
        lru = self._lru.get(worker.worker_id)
        return lru.match(hashes) if lru is not None else 0

    def _lru_of(self, worker_id: str) -> BlockLRU:
        if worker_id not in self._lru:
            self._lru[worker_id] = BlockLRU(self.config.lru_blocks)
        return self._lru[worker_id]
