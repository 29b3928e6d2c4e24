"""A discrete-event model of prefill workers with prefix caches, driven by the router's real policy code.

What is real: `router.policy.RoutingPolicy.place` decides every request, from `WorkerInfo`s carrying each
worker's load (requests queued or running) and its `PrefixDigest` (for `cache_aware`), exactly as the
router sees them from live workers; each request carries its prompt's block hashes as the ingress computes them
(`router.prompt_hashes.IngressHasher`, in the scheme the policy's last placement named; none on the first request),
and the router's `prefill_done` bookkeeping is called when a modelled prefill ends. What is modelled:
- a worker's cache: `capacity_blocks` blocks of `block_tokens` tokens, LRU, every cached block resumable
  (the engine resumes at snapshots; a model with a snapshot on every block is the upper end of that);
- a hit: the longest cached prefix of the request's block chain, leaving >= 1 token to compute (as the
  engine does), looked up and touched when the request's prefill starts (the engine looks it up at admission,
  `Scheduler._admit`); the request's blocks are inserted when its prefill ends. So a session's next turn queued
  behind its last turn on the same worker resumes after it, while on another worker it recomputes it. The
  engine admits up to `max_num_seqs` requests at once when pages allow, so there a queued request can be admitted
  (and look up) while an earlier prefill still runs, and finds only that prefill's blocks snapshotted so far:
  this model, one prefill at a time, is the upper end of that (`SimConfig.lookup_at_start=False`: the lower end);
- prefill: FIFO, one at a time per worker, `overhead_s + uncached_tokens / tokens_per_s`; TTFT = queueing +
  prefill (decode is not modelled: the decode pool is placed by free KV, not by prefix);
- the pooled reference: one LRU cache with every worker's capacity seeing every request in arrival order, each
  request's prefill ended before the next arrives (what perfect placement could at most reuse at this capacity,
  ignoring timing: with no queue, a prefill starts at its arrival, so a lookup at the start and at the arrival agree).
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
ESTIMATE = "cache_aware_estimate"  # cache_aware without digests: the router's own guess (router.block_lru.BlockLRU)


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
    # Look a request's cached prefix up when its prefill starts, as the engine does at admission (False: at its
    # arrival, the earlier model: a follow-up queued behind its parent on the same worker could not use it)
    lookup_at_start: bool = True


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


@dataclass
class Queued:
    """A placed request waiting for (or running) its worker's prefill."""

    seq: int
    arrival: float
    chain: list[int]
    tokens: int  # prompt tokens
    estimate: int  # the router's uncached tokens for it (pending in its count until `prefill_done`)
    matched: int = -1  # blocks served from cache (-1: not looked up yet)


class SimWorker:
    """FIFO prefill, one at a time. The cache is looked up when a prefill starts (the engine looks a request up at
    admission, engine.execution.scheduler.Scheduler._admit) and filled when it ends; the digest shows ended ones."""

    def __init__(self, worker_id: str, capacity: int):
        self.worker_id = worker_id
        self.cache = LRUBlocks(capacity)
        self.queue: deque[Queued] = deque()  # queue[0] is running while `busy`
        self.busy = False
        self.computed = 0
        self._digest: PrefixDigest | None = None

    def info(self, block: int, with_digest: bool) -> WorkerInfo:
        n = len(self.queue)
        prefix = None
        if with_digest:
            if self._digest is None or self._digest.version != self.cache.version:
                self._digest = PrefixDigest(
                    block_tokens=block, seed=SEED, hashes=frozenset(self.cache.blocks), version=self.cache.version
                )
            prefix = self._digest
        return WorkerInfo(self.worker_id, "colocated", True, min(n, 1), max(n - 1, 0), 1 << 40, prefix=prefix)

    def look_up(self, q: Queued, block: int) -> None:
        q.matched = min(self.cache.match(q.chain), (q.tokens - 1) // block)
        self.cache.touch(q.chain[: q.matched])


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

    load_floor: max over requests of (the tokens computed per worker before its prefill started + its own uncached
    tokens) / the final mean: where the worker that took it would end had it been exactly at the mean then and taken
    nothing after. A placement that keeps the workers level (each at the mean when a request arrives) ends at or above
    it: a huge prompt arriving late lands on a worker already at the mean; only one that foresaw it (a worker kept
    idle for it) could end lower.
    behind_prefill: of the requests sharing a prefix with an earlier one, the share that arrived before any prefill
    computing their deepest shared block had ended (a session's next turn queued behind its last turn, in a saturated
    pool): the digests cannot show that block yet; only a hit looked up when the prefill starts, on the worker
    computing it (`SimConfig.lookup_at_start`), can serve it from cache."""
    name = "cache_aware" if policy_name == ESTIMATE else policy_name
    run = _Run(cfg, RoutingPolicy(PolicyConfig(name)), with_digest=policy_name != ESTIMATE)
    for seq, req in enumerate(sorted(trace, key=lambda r: r.timestamp_ms)):
        run.arrive(seq, req)
    run.advance(inf)
    return run.result(trace)


class _Run:
    """One policy's replay: arrivals are placed by the real policy; prefill ends are events (a heap)."""

    def __init__(self, cfg: SimConfig, policy: RoutingPolicy, with_digest: bool):
        self.cfg, self.policy, self.with_digest = cfg, policy, with_digest
        self.ingress, self.own = IngressHasher(), HashScheme(cfg.block_tokens, SEED)
        self.workers = [SimWorker(f"w{i}", cfg.capacity_blocks) for i in range(cfg.workers)]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.ends: list[tuple[float, int, str]] = []  # (time, seq, worker) of running prefills
        self.ttfts: list[float] = []
        self.decisions: list[float] = []  # CPU time of `place`
        self.walls: list[float] = []  # its wall time
        self.indexing: list[float] = []  # CPU time of indexing the reports' digests before each decision
        self.hit_tokens = self.total_tokens = self.computed = self.shared = self.behind = 0
        self.ready: dict[int, float] = {}  # block hash -> when the first prefill computing it ends
        self.seen: set[int] = set()  # blocks of requests that arrived
        self.floor = 0.0

    def advance(self, until: float) -> None:
        """End every prefill due by `until`: its blocks enter the cache, the worker starts its next one."""
        while self.ends and self.ends[0][0] <= until:
            t, _, wid = heapq.heappop(self.ends)
            w = self.by_id[wid]
            q = w.queue.popleft()
            w.cache.insert(q.chain)
            w.busy = False
            self.policy.prefill_done(wid, q.tokens - q.matched * self.cfg.block_tokens)
            if w.queue:
                self.start(w, t)

    def start(self, w: SimWorker, now: float) -> None:
        cfg, q = self.cfg, w.queue[0]
        if q.matched < 0:
            w.look_up(q, cfg.block_tokens)
        uncached = q.tokens - q.matched * cfg.block_tokens
        if q.estimate != uncached:  # keep the router's pending count honest
            self.policy.prefill_done(w.worker_id, q.estimate - uncached)
        end = now + cfg.overhead_s + uncached / cfg.tokens_per_s
        w.busy = True
        heapq.heappush(self.ends, (end, q.seq, w.worker_id))
        # Its own prefill on a worker exactly at the mean so far: max/mean can end no lower (see `simulate`).
        self.floor = max(self.floor, self.computed / cfg.workers + uncached)
        self.computed += uncached
        w.computed += uncached
        self.hit_tokens += q.tokens - uncached
        self.ttfts.append(end - q.arrival)
        for h in q.chain:
            if self.ready.get(h, inf) > end:
                self.ready[h] = end

    def arrive(self, seq: int, req: TraceRequest) -> None:
        cfg, block = self.cfg, self.cfg.block_tokens
        now = req.timestamp_ms / 1000.0 / cfg.time_scale
        self.advance(now)
        tokens = prompt_tokens(req, block)
        given = self.ingress.hashes(tokens)  # what the ingress sends with the request
        chain = (
            list(given.hashes) if given is not None and given.scheme == self.own else block_hashes(tokens, block, SEED)
        )
        infos = [w.info(block, self.with_digest) for w in self.workers]
        c0 = time.thread_time_ns()
        self.policy.observe(
            infos
        )  # the workers' reports of the prefills that ended, as the router's probe applies them
        self.indexing.append((time.thread_time_ns() - c0) / 1000.0)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        placement = self.policy.place(tokens, len(tokens) + req.output_length, infos, now=now, hashes=given)
        self.decisions.append((time.thread_time_ns() - c0) / 1000.0)
        self.walls.append((time.perf_counter_ns() - t0) / 1000.0)
        self.ingress.learn(self.policy.hash_scheme)
        w = self.by_id[placement.prefill.worker_id]
        q = Queued(seq, now, chain, len(tokens), placement.prefill.uncached_tokens)
        if not cfg.lookup_at_start:
            w.look_up(q, block)
        w.queue.append(q)
        # The deepest block an earlier request had (the pooled reference's hit): had no prefill computing it ended
        # yet, no digest could show it (a session's next turn arriving before its last turn's prefill ended).
        for k in range(min(len(chain), (len(tokens) - 1) // block) - 1, -1, -1):
            if chain[k] in self.seen:
                self.shared += 1
                self.behind += self.ready.get(chain[k], inf) > now
                break
        self.seen.update(chain)
        self.total_tokens += len(tokens)
        if not w.busy:
            self.start(w, now)

    def result(self, trace: list[TraceRequest]) -> dict:
        loads = [w.computed for w in self.workers]
        mean = statistics.fmean(loads) if loads else 0.0
        pct = _pct
        return {
            "hit_rate": self.hit_tokens / self.total_tokens if self.total_tokens else 0.0,
            "pooled_hit_rate": pooled_hit_rate(trace, self.cfg),
            "load_imbalance": max(loads) / mean if mean else 1.0,
            "load_floor": self.floor / mean if mean else 1.0,
            "max_prefill_tokens": max(loads, default=0),
            "mean_prefill_tokens": mean,
            "ttft_p50_s": pct(self.ttfts, 0.5),
            "ttft_p99_s": pct(self.ttfts, 0.99),
            "decision_us_p50": pct(self.decisions, 0.5),
            "decision_us_p99": pct(self.decisions, 0.99),
            "decision_wall_us_p99": pct(self.walls, 0.99),
            "indexing_us_p99": pct(self.indexing, 0.99),
            "requests": len(trace),
            "behind_prefill": self.behind / self.shared if self.shared else 0.0,
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
