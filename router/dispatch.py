"""The boundary between the router and whatever runs the engines (in-process, or Ray actors).

The router (router/server.py) decides WHERE a request runs; a `Dispatcher` makes it run there and
streams the engine's `TokenEvent`s back. Everything that crosses this boundary is a frozen dataclass.

Contract of a Dispatcher (the router is its only caller; all calls come from the router's event loop):
- `workers()` is synchronous and cheap (called once per request): it returns the latest known state,
  not a fresh probe. Liveness may be stale; the router learns about deaths from `health_check()` and
  from `WorkerDied`.
- `generate(request, prefill_id, decode_id)` is an async generator. It yields the engine's
  `TokenEvent`s for the request (including events with `token_id=None` that only carry prompt
  logprobs) and returns after the event with `finished=True`. It raises
  - `ValueError` when the engine rejects the request (bad token id, too long, ...): nothing ran;
  - `WorkerDied(worker_id)` when a worker serving the request is gone (actor death, engine crash);
  - `Overloaded` when the worker refuses new work for now.
  Closing the generator early (client went away) must abort the request on the workers and free its
  cache pages.
- `health_check()` probes every worker and returns {worker_id: alive}; it must not hang: the router
  also wraps it in a timeout.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from engine.execution.request import TokenEvent
from engine.execution.sampling_params import SamplingParams
from engine.handoff import PrefixDigest

Role = Literal["prefill", "decode", "colocated"]
ROLES = ("prefill", "decode", "colocated")
PREFILL_ROLES = frozenset({"prefill", "colocated"})  # may run a prompt
DECODE_ROLES = frozenset({"decode", "colocated"})  # may generate tokens


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as the dispatcher last saw it.

    `colocated` workers run both phases of a request (one engine, no KV hand-off): they are prefill
    and decode candidates at once, and a request prefilled on one decodes on the same one.
    """

    worker_id: str
    role: Role
    healthy: bool = True
    running: int = 0  # requests holding cache pages
    waiting: int = 0  # requests queued for admission
    kv_free_tokens: int = 0  # tokens more the cache can reserve right now
    kv_usage: float = 0.0  # fraction of KV pages in use, 0..1
    # Changes when the worker restarts (new process, empty cache): a restart between two health probes
    # is never seen as "down", so this is how the router knows to forget what it sent there before.
    incarnation: str = ""
    # Admission (decode workers): what the idle engine admits; 0 = unknown, not limiting. The router admits
    # against these minus what it has in flight there, so a stale report never over- or under-admits.
    max_slots: int = 0
    kv_capacity_tokens: int = 0
    kv_page_tokens: int = 1
    # What the worker's prefix cache can resume from (published by the worker; None = no real cache view,
    # the policy falls back to its own estimate). See router/locality.py.
    prefix: PrefixDigest | None = None
    # GPU fast paths the worker's engine takes (names) and those that fell back ("name: why"), for /health
    fast_paths_active: tuple[str, ...] = ()
    fast_path_fallbacks: tuple[str, ...] = ()
    # Leaving its pool (service/pools.py): no new placements; its streams finish; still healthy.
    draining: bool = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"worker {self.worker_id!r}: role must be one of {ROLES}, got {self.role!r}")
        if min(self.running, self.waiting, self.kv_free_tokens) < 0:
            raise ValueError(f"worker {self.worker_id!r}: negative load {self}")

    @property
    def load(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class DispatchRequest:
    """A validated request as the router hands it to a dispatcher."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams

    @property
    def max_total_tokens(self) -> int:
        """Cache positions the request can ever need (what a decode worker must reserve)."""
        return len(self.prompt_ids) + self.params.max_new_tokens


class WorkerDied(RuntimeError):
    """A worker serving the request is gone; the router marks it unhealthy and may retry elsewhere."""

    def __init__(self, worker_id: str, detail: str = ""):
        super().__init__(f"worker {worker_id} died" + (f": {detail}" if detail else ""))
        self.worker_id = worker_id


class Overloaded(RuntimeError):
    """The worker refuses new work for now (maps to RESOURCE_EXHAUSTED)."""


class NoWorkerAvailable(RuntimeError):
    """No healthy worker can take the request (maps to UNAVAILABLE)."""


@runtime_checkable
class Dispatcher(Protocol):
    def workers(self) -> list[WorkerInfo]:
        """Latest known state of every worker, healthy or not."""
        ...

    def generate(self, request: DispatchRequest, prefill_id: str, decode_id: str) -> AsyncGenerator[TokenEvent, None]:
        """Run `request` (prefill on `prefill_id`, decode on `decode_id`); an async generator of events."""
        ...

    async def health_check(self) -> dict[str, bool]:
        """Probe every worker: {worker_id: alive}."""
        ...
