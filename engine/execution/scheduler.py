"""Continuous-batching scheduler: which requests run how many tokens in the next step.

Policy (one step = one forward):
- running decodes first, one token each (they are latency-bound and cheap);
- then prefill chunks, oldest first, each as large as the remaining token budget allows, so one long
  prompt is split across steps and never blocks decodes for more than one step's budget;
- a waiting request is admitted only when the cache can hold its whole reservation
  (prompt + max_new_tokens); pages are taken at admission, so a running request never runs out of
  cache mid-flight and nothing needs preempting;
- with a prefix cache (engine.execution.prefix_cache), admission first shares the longest cached prefix that ends
  at a snapshot (the request starts computing there), and a prefill chunk either keeps its next snapshot
  point in the step (ScheduledChunk.snapshot_at: the step also writes the state there into staging pages)
  or ends at it, so the state there can be saved after the step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sized
from dataclasses import dataclass

from engine.execution.prefix_cache import PrefixCache
from engine.execution.request import Request
from engine.model.cache import CachePool


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position run this step
    num_tokens: int
    snapshot_at: int = 0  # a prefix-cache snapshot point inside the chunk, kept in this step (0: none)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # requests running at once


class Scheduler:
    def __init__(self, pool: CachePool, config: SchedulerConfig, prefix: PrefixCache | None = None):
        if config.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {config.max_batch_tokens}")
        self.pool = pool
        self.config = config
        self.prefix = prefix
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Decode side: requests whose caches are arriving (EngineCore.imports); each has a batch slot reserved.
        self.arriving: Sized = ()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.arriving) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = None
            if self.prefix is not None:
                hit = self.prefix.lookup(req)
                self.prefix.attach(req, hit)
            if not self.pool.can_grow(req.pages, req.max_total_tokens):
                if hit is not None and self.prefix is not None:  # a hit implies a prefix cache
                    self.prefix.detach(req, hit)
                break  # FIFO: do not let small requests starve a large one
            self.pool.grow(req.pages, req.max_total_tokens)
            if hit is not None and self.prefix is not None:
                self.prefix.commit(req, hit)
            self.running.append(self.waiting.popleft())

    def schedule(self) -> list[ScheduledChunk]:
        self._admit()
        budget = self.config.max_batch_tokens
        chunks = []
        for req in self.running:
            if not req.in_prefill and budget > 0:
                chunks.append(ScheduledChunk(req, req.num_computed, 1))
                budget -= 1
        for req in self.running:
            if req.in_prefill and budget > 0:
                n, snap = min(len(req.prompt) - req.num_computed, budget), 0
                if self.prefix is not None:
                    n, snap = self.prefix.cut(req, req.num_computed, n)
                chunks.append(ScheduledChunk(req, req.num_computed, n, snap))
                budget -= n
        return chunks

    def admit_with_pages(self, request: Request) -> None:
        """Join a request whose pages are already allocated and filled (a decode-side hand-off)."""
        if len(self.running) >= self.config.max_num_seqs:
            raise RuntimeError(f"cannot admit {request.request_id}: {len(self.running)} requests already running")
        self.running.append(request)

    def hold(self, request: Request) -> None:
        """Stop scheduling a request but keep its pages (a prefill-side hand-off in flight)."""
        self.running.remove(request)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's pages (running or still waiting)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.pages)
        if self.prefix is not None:
            self.prefix.forget(request)
