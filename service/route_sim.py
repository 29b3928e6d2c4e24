"""A discrete-event model of prefill workers with prefix caches, driven by the router's real policy code.

What is real: `router.policy.RoutingPolicy.place` decides every request, from `WorkerInfo`s carrying each
worker's load (requests queued or running) and its `PrefixDigest` (for `cache_aware`), exactly as the
router sees them from live workers; each request carries its prompt's block hashes as the ingress computes them
(`router.prompt_hashes.IngressHasher`, in the scheme the policy's last placement named; none on the first request),
and the router's `prefill_done` bookkeeping is called when a modelled prefill ends. What is modelled:
- a worker's cache: `capacity_blocks` blocks of `block_tokens` tokens, LRU, every cached block resumable
  (the engine resumes at snapshots; a model with a snapshot on every block is the upper end of that);
- a hit: the longest cached prefix of the request's block chain, leaving >= 1 token to compute (as the
  engine does); hit blocks are touched when the prefill starts, the request's blocks are inserted when
  its prefill ends (a request arriving meanwhile cannot use them yet);
- prefill: FIFO, one at a time per worker, `overhead_s + uncached_tokens / tokens_per_s`; TTFT = queueing +
  prefill (decode is not modelled: the decode pool is placed by free KV, not by prefix);
- the pooled reference: one LRU cache with every worker's capacity seeing every request in arrival order
  (what perfect placement could at most reuse at this capacity, ignoring timing).
Decision time is the CPU time of `place` alone (matching and scoring: the ingress hashed the prompt, and the
digests the workers reported since the last request were indexed when they arrived, `RoutingPolicy.observe`, as
the router's probe does; that time is `indexing_us_p99`), in microseconds: the thread's CPU clock, so a busy shared
machine's preemptions do not count (their wall time is reported as `decision_wall_us_p99`).
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from math import inf

from engine.execution.block_hash import block_hashes
from engine.handoff import PrefixDigest
from router.dispatch import WorkerInfo
from router.policy import PolicyConfig, RoutingPolicy
from router.prompt_hashes import HashScheme, IngressHasher

SEED = b"routesim"  # stands for the workers' model + cache format
ESTIMATE = "cache_aware_estimate"  # cache_aware without digests: the router's own guess (router.policy.BlockLRU)


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class SimConfig:
    workers: int = 8
    capacity_blocks: int = 4096  # per worker
    block_tokens: int = 512  # the trace's hash-id granularity
    tokens_per_s: float = 20000.0  # prefill speed of one worker
    overhead_s: float = 0.005  # per prefill
    time_scale: float = 1.0  # arrival times are divided by this (2 = twice the request rate)


class LRUBlocks:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.version = 0

    def match(self, chain: list[int]) -> int:
        n = 0
        for h in chain:
            if h not in self.blocks:
                break
            n += 1
        return n

    def touch(self, chain: list[int]) -> None:
        for h in reversed(chain):  # block 0 most recent, as in `insert`
            self.blocks.move_to_end(h)

    def insert(self, chain: list[int]) -> None:
        # Tail first so block 0 ends most recent: eviction trims chains from their end.
        for h in reversed(chain):
            if h not in self.blocks:
                self.version += 1
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
            self.version += 1


class SimWorker:
    def __init__(self, worker_id: str, capacity: int):
        self.worker_id = worker_id
        self.cache = LRUBlocks(capacity)
        self.free_at = 0.0
        self.ends: deque[float] = deque()  # completion times of queued / running prefills, ascending
        self.computed = 0
        self._digest: PrefixDigest | None = None

    def info(self, now: float, block: int, with_digest: bool) -> WorkerInfo:
        while self.ends and self.ends[0] <= now:
            self.ends.popleft()
        busy = len(self.ends)
        prefix = None
        if with_digest:
            if self._digest is None or self._digest.version != self.cache.version:
                self._digest = PrefixDigest(
                    block_tokens=block, seed=SEED, hashes=frozenset(self.cache.blocks), version=self.cache.version
                )
            prefix = self._digest
        return WorkerInfo(self.worker_id, "colocated", True, min(busy, 1), max(busy - 1, 0), 1 << 40, prefix=prefix)


def prompt_tokens(req: TraceRequest, block: int) -> tuple[int, ...]:
    """Token ids standing for the request's blocks: block id h is tokens h*block .. h*block+block-1, so equal
    ids are equal content and the policy's chained hashes see shared prefixes exactly where the trace has.
    A tuple, as the router gets them (`DispatchRequest.prompt_ids`)."""
    out: list[int] = []
    for h in req.hash_ids:
        out.extend(range(h * block, h * block + block))
        if len(out) >= req.input_length:
            break
    return tuple(out[: req.input_length])


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def simulate(trace: list[TraceRequest], policy_name: str, cfg: SimConfig) -> dict:
    """Replay `trace` through one policy; -> the per-policy result fields.

    load_floor: max over requests of (the tokens computed per worker before it + its own uncached tokens) / the final
    mean: where the worker that took it would end had it been exactly at the mean then and taken nothing after. A
    placement that keeps the workers level (each at the mean when a request arrives) ends at or above it: a huge prompt
    arriving late lands on a worker already at the mean; only one that foresaw it (a worker kept idle for it) could
    end lower.
    behind_prefill: of the requests sharing a prefix with an earlier one, the share that arrived before any prefill
    computing their deepest shared block had ended (a session's next turn queued behind its last turn, in a saturated
    pool): no placement could serve that block from cache, while the pooled reference, blind to timing, counts it."""
    name = "cache_aware" if policy_name == ESTIMATE else policy_name
    policy = RoutingPolicy(PolicyConfig(name))
    use_digest = policy_name != ESTIMATE
    block = cfg.block_tokens
    ingress, own = IngressHasher(), HashScheme(block, SEED)
    workers = [SimWorker(f"w{i}", cfg.capacity_blocks) for i in range(cfg.workers)]
    by_id = {w.worker_id: w for w in workers}
    done: list[tuple[float, int, str, list[int], int]] = []  # (time, seq, worker, chain, uncached)
    ttfts, decisions, walls = [], [], []  # decision time: CPU time of the call, and wall time
    indexing = []  # CPU time of indexing the reports' digests before each decision (not on the request's path)
    hit_tokens = total_tokens = computed = shared = behind = 0
    ready: dict[int, float] = {}  # block hash -> when the first prefill computing it ends
    floor = 0.0
    for seq, req in enumerate(sorted(trace, key=lambda r: r.timestamp_ms)):
        now = req.timestamp_ms / 1000.0 / cfg.time_scale
        while done and done[0][0] <= now:
            _, _, wid, chain, uncached = heapq.heappop(done)
            by_id[wid].cache.insert(chain)
            policy.prefill_done(wid, uncached)
        tokens = prompt_tokens(req, block)
        given = ingress.hashes(tokens)  # what the ingress sends with the request
        chain = list(given.hashes) if given is not None and given.scheme == own else block_hashes(tokens, block, SEED)
        infos = [w.info(now, block, use_digest) for w in workers]
        c0 = time.thread_time_ns()
        policy.observe(infos)  # the workers' reports of the prefills that ended, as the router's probe applies them
        indexing.append((time.thread_time_ns() - c0) / 1000.0)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        placement = policy.place(tokens, len(tokens) + req.output_length, infos, now=now, hashes=given)
        decisions.append((time.thread_time_ns() - c0) / 1000.0)
        walls.append((time.perf_counter_ns() - t0) / 1000.0)
        ingress.learn(policy.hash_scheme)
        w = by_id[placement.prefill.worker_id]
        matched = min(w.cache.match(chain), (len(tokens) - 1) // block)
        w.cache.touch(chain[:matched])
        hit, uncached = matched * block, len(tokens) - matched * block
        start = max(now, w.free_at)
        w.free_at = start + cfg.overhead_s + uncached / cfg.tokens_per_s
        w.ends.append(w.free_at)
        # A request's own prefill on a worker exactly at the mean so far: max/mean can end no lower (see `simulate`).
        floor = max(floor, computed / cfg.workers + uncached)
        computed += uncached
        w.computed += uncached
        if placement.prefill.uncached_tokens != uncached:  # keep the router's pending count honest
            policy.prefill_done(w.worker_id, placement.prefill.uncached_tokens - uncached)
        heapq.heappush(done, (w.free_at, seq, w.worker_id, chain, uncached))
        ttfts.append(w.free_at - now)
        # The deepest block an earlier request had (the pooled reference's hit): had no prefill computing it ended
        # yet, no placement could serve it from cache (a session's next turn arriving before its last turn's prefill).
        for k in range(min(len(chain), (len(tokens) - 1) // block) - 1, -1, -1):
            first = ready.get(chain[k])
            if first is not None:
                shared += 1
                behind += first > now
                break
        for h in chain:
            if ready.get(h, inf) > w.free_at:
                ready[h] = w.free_at
        hit_tokens += hit
        total_tokens += len(tokens)
    loads = [w.computed for w in workers]
    mean = statistics.fmean(loads) if loads else 0.0
    return {
        "hit_rate": hit_tokens / total_tokens if total_tokens else 0.0,
        "pooled_hit_rate": pooled_hit_rate(trace, cfg),
        "load_imbalance": max(loads) / mean if mean else 1.0,
        "load_floor": floor / mean if mean else 1.0,
        "max_prefill_tokens": max(loads, default=0),
        "mean_prefill_tokens": mean,
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "decision_us_p50": _pct(decisions, 0.5),
        "decision_us_p99": _pct(decisions, 0.99),
        "decision_wall_us_p99": _pct(walls, 0.99),
        "indexing_us_p99": _pct(indexing, 0.99),
        "requests": len(trace),
        "behind_prefill": behind / shared if shared else 0.0,
    }


# The last trace's pooled hit rate: (trace, capacity, block) -> rate. The trace itself is kept, not its id: a
# freed trace's id is reused by the next one a process reads (bench jobs read one trace after another).
_POOLED: dict[tuple[int, int], tuple[list[TraceRequest], float]] = {}


def pooled_hit_rate(trace: list[TraceRequest], cfg: SimConfig) -> float:
    """Hit rate of one LRU cache of workers x capacity_blocks seeing every request (memoised per trace)."""
    key = (cfg.workers * cfg.capacity_blocks, cfg.block_tokens)
    memo = _POOLED.get(key)
    if memo is None or memo[0] is not trace:
        cache = LRUBlocks(cfg.workers * cfg.capacity_blocks)
        hit = total = 0
        for req in sorted(trace, key=lambda r: r.timestamp_ms):
            tokens = prompt_tokens(req, cfg.block_tokens)
            chain = block_hashes(tokens, cfg.block_tokens, SEED)
            matched = min(cache.match(chain), (len(tokens) - 1) // cfg.block_tokens)
            hit += matched * cfg.block_tokens
            total += len(tokens)
            cache.insert(chain)
        _POOLED.clear()
        _POOLED[key] = memo = (trace, hit / total if total else 0.0)
    return memo[1]
