"""The hand-off contract between the pools: what crosses from a prefill worker, through the dispatcher, to a
decode worker, and what every worker reports about its load. Frozen, picklable dataclasses only (they travel
through Ray); both workers, the KV-transfer backends and the dispatcher import them from here, never from
each other.

Flow of one disaggregated request:
  PrefillWorker.prefill -> PrefillResult (first token, seed, TransferTicket)
  DecodeWorker.decode(PrefillResult) -> Transferred (caches landed), then TokenEvents
  DecodeWorker raises DecodeOverloaded when it has no slot or pages (the router answers 429 / queues).
Streamed (a long prompt, service.ray_stream):
  DecodeWorker.reserve_streamed; PrefillWorker.prefill_streamed -> chunk TransferTickets (final=False), each into
  DecodeWorker.pull_chunk while later chunks are prefilled, then the PrefillResult (its ticket: the rest) -> decode
"""

from __future__ import annotations

from dataclasses import dataclass


class DecodeOverloaded(RuntimeError):
    """No cache capacity or batch slot for the request right now (the router maps it to 429)."""


class PeerUnknown(RuntimeError):
    """The decode worker has no transfer metadata of the ticket's source (it restarted, or the source did,
    since the dispatcher last introduced them): introduce them and retry the pull."""

    def __init__(self, source: str, worker: str):
        super().__init__(f"source worker {source!r} is unknown to {worker} (not introduced since a restart)")
        self.source, self.worker = source, worker

    def __reduce__(self):  # travels through Ray: rebuild from the constructor's arguments
        return type(self), (self.source, self.worker)


@dataclass(frozen=True)
class TransferTicket:
    """What the decode side needs to pull one request; small and picklable (travels through Ray).

    src_pages: ((group, (page, ...)), ...) exactly the source pages the ticket moves (for a streamed request: those
    not moved by its earlier chunk tickets, kv_transfer.plan.page_span).
    """

    source: str  # worker (agent) name of the prefill side
    request_id: str
    src_pages: tuple[tuple[str, tuple[int, ...]], ...]
    num_tokens: int
    fingerprint: str  # layout_fingerprint of the source pool
    staging: tuple[int, int] | None = None  # (offset, nbytes) of the pages packed in the source's staging buffer
    # wall-clock (time.time()) end of the source's lease on these pages (0: none): a pull must end before it
    lease_expires_at: float = 0.0
    # Streaming (kv_transfer.plan): the pages positions [0, start_tokens) filled completely were moved by earlier
    # chunk tickets; final=False: a chunk ticket (those complete pages of [start_tokens, num_tokens) only; its
    # request_id names the chunk, kv_transfer.base.chunk_id), True: the rest of the request's caches.
    start_tokens: int = 0
    final: bool = True
    # the exporting backend's instance (a restarted worker's backend is a new one): the decode side pulls only with
    # that instance's transfer metadata (kv_transfer.base.TransferBackend.knows); "" = not checked
    source_instance: str = ""

    def page_table(self) -> dict[str, list[int]]:
        return {g: list(p) for g, p in self.src_pages}


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    worker_id: str
    first_token: int
    first_logprob: float
    prompt_logprobs: tuple  # (None, lp1, ...) when asked for, else ()
    seed: int
    finished: bool  # the first token already ended the request (EOS, or max_new_tokens == 1)
    finish_reason: str | None
    ticket: TransferTicket | None  # None when finished
    queue_time_s: float
    prefill_time_s: float
    incarnation: str = ""  # of the worker that holds the caches (a restarted worker holds none)
    cached_tokens: int = 0  # prompt tokens served from the prefill worker's prefix cache


@dataclass(frozen=True)
class Transferred:
    """Yielded by a decode stream once the request's caches have landed (before its first decoded token)."""

    request_id: str
    num_bytes: int
    seconds: float


@dataclass(frozen=True)
class EngineLoad:
    """The one load figure of an engine: gauges, router placement and worker stats all read this.

    running: requests holding pages (scheduled, held for a hand-off, or importing); waiting: queued;
    kv_usage: the fullest cache group's used fraction, 0..1; kv_free_tokens: tokens of new reservation the
    pool can take; free_slots: requests more the engine's batch can admit.
    """

    running: int
    waiting: int
    kv_usage: float
    kv_free_tokens: int
    free_slots: int


@dataclass(frozen=True)
class WorkerSignals:
    """What the pool planner reads from a worker (service/pools.py -> service/planner.py): its load, the prompt
    tokens it has not computed yet (queued or mid-prefill), and the p90 of its recent latencies: arrival to first
    token (a prefill worker) or the time of a step with streams (a decode worker: each such step is one token of
    every stream, so its p90 is the inter-token latency there). None: no sample in the window."""

    worker_id: str
    role: str
    incarnation: str
    load: EngineLoad
    queue_tokens: int = 0
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    samples: int = 0  # latency samples behind the p90


@dataclass(frozen=True)
class PrefixDigest:
    """What a worker's prefix cache can resume from (engine.execution.prefix_cache): hashes of the blocks that end at
    a snapshot, with the block size and the hash seed needed to name a prompt's blocks the same way
    (`engine.execution.block_hash.block_hashes`). Bounded by the cache's snapshot slots; `version` changes with it."""

    block_tokens: int
    seed: bytes
    hashes: frozenset
    version: int = 0


@dataclass(frozen=True)
class WorkerStats:
    """max_slots / kv_capacity_tokens: what the idle engine admits (batch slots, tokens of reservation);
    the router admits against these minus what it has in flight there (0 = unknown: not limiting)."""

    worker_id: str
    role: str
    incarnation: str  # changes when the actor restarts (new transfer agent, empty cache)
    load: EngineLoad
    max_slots: int = 0
    kv_capacity_tokens: int = 0
    kv_page_tokens: int = 1  # a reservation is rounded up to whole pages of this many tokens
    prefix: PrefixDigest | None = None  # None: the worker has no prefix cache
    # GPU fast paths this worker's engine takes (names), and those it does not, as "name: why"
    # (engine.model.fast_paths.FastPath); /health shows both
    fast_paths_active: tuple[str, ...] = ()
    fast_path_fallbacks: tuple[str, ...] = ()
    problem: str | None = None  # None while the engine is healthy; else why not (loop ended, stalled step)

    @property
    def healthy(self) -> bool:
        return self.problem is None

    @property
    def running(self) -> int:
        return self.load.running

    @property
    def waiting(self) -> int:
        return self.load.waiting

    @property
    def kv_usage(self) -> float:
        return self.load.kv_usage

    @property
    def kv_free_tokens(self) -> int:
        return self.load.kv_free_tokens
