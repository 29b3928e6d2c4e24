"""What a prefill and a decode worker share: the engine and its loop thread, the transfer backend's lifetime,
identity across restarts, stats and gauges, liveness and shutdown. Each worker adds its own phase on top.

The backend is made by the subclass (this layer knows nothing of kv_transfer) and handed in through
`attach_backend`; `shutdown` closes it after the loop has stopped.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from engine.execution.tp_executor import release_followers
from engine.handoff import PrefixDigest, WorkerSignals, WorkerStats
from engine.loading.load import load_engine
from engine.runtime import gc_pauses
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.health import HealthOptions, LoopWatchdog
from engine.runtime.rank_worker import split_engine_options
from engine.runtime.recent_samples import RecentSamples
from engine.telemetry import metrics
from engine.telemetry.compile_watch import CompileWatch, install_variant_log, note_slow_step

SIGNAL_WINDOW_S = 30.0  # the pool planner's latency signals cover this much recent time


class ClosingBackend(Protocol):
    """All this layer needs of a transfer backend: that `shutdown` can close it."""

    def close(self) -> None: ...


class WorkerBase:
    """Not typing.Generic over the backend type: a Ray actor class of a Generic subclass does not pickle (the router
    actor ships the workers' classes to restart groups). The workers narrow `backend` with their own accessor."""

    role = "?"

    def __init__(
        self,
        worker_id: str,
        model_dir: str | None,
        engine_options: dict | None = None,
        health: HealthOptions | None = None,
    ):
        self.worker_id = worker_id
        self.health = health or HealthOptions()
        # Changes when the actor restarts (new process, empty cache): peers and the router key on it.
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        # A multi-rank worker (engine.runtime.rank_worker): under tensor parallelism this actor is rank 0 and its followers
        # are other actors; under data-parallel attention every rank is a worker like this one.
        opts, tp, rank = split_engine_options(engine_options)
        self.parallel = tp.join(rank, opts.get("device", "cpu")) if tp is not None else None
        self.data_parallel = tp is not None and tp.data_parallel_attention
        # Compile before serving (engine.execution.warmup); a prefill worker's requests never decode.
        self.engine = load_engine(
            model_dir, **opts, parallel=self.parallel, warmup=True, warmup_decodes=self.role != "prefill"
        )
        self.backend: ClosingBackend | None = None  # attach_backend, right after this constructor
        # The pool planner's latency signals (`signals`): arrival -> first token of a prefill, and the gap between
        # consecutive steps that both carried decode streams (what each of those streams waited for its token).
        self.first_token_times = RecentSamples(SIGNAL_WINDOW_S)
        self.stream_gaps = RecentSamples(SIGNAL_WINDOW_S)
        self._last_stream_step: float | None = None
        # After the warm-up: what compiles from here on stalls a serving step (looked for after slow steps only)
        self.compile_watch = CompileWatch(variants=install_variant_log()) if self.engine.device.type == "cuda" else None
        self._prefix_counters = metrics.PrefixCounters(self.role, worker_id)
        spec = getattr(self.engine, "speculator", None)  # speculative decoding's counters, on speculative engines only
        self._spec_counters = metrics.SpecCounters(self.role, worker_id) if spec is not None else None
        self._digest: PrefixDigest | None = (
            None  # the engine's PrefixDigest, refreshed on the engine thread when it changes
        )
        # What the idle engine admits, read before any request holds a page (the router admits against it).
        pool = self.engine.pool
        self.max_slots = self.engine.scheduler_config.max_num_seqs
        self.kv_capacity_tokens = pool.free_tokens()
        self.kv_page_tokens = max(
            (g.spec.page_rows * g.spec.tokens_per_row for g in pool.groups.values() if not g.spec.fixed), default=1
        )
        self.loop = EngineLoop(
            self.engine,
            name=f"{self.role}-{worker_id}",
            on_step=self._on_step,
            on_change=lambda engine: self.publish_load(),
        )
        self.publish_load()  # the gauges exist (at idle) before the first request
        states = self.engine.model.fast_path_states
        self.fast_paths_active = tuple(p.name for p in states if p.active)
        self.fast_path_fallbacks = tuple(f"{p.name}: {p.why}" for p in states if not p.active)
        metrics.observe_fast_paths(self.role, worker_id, states)
        # Created after the warm-up: the stall clock never runs during it (engine.runtime.health).
        self.watchdog = (
            LoopWatchdog(self.loop, self.health.stall_timeout_s, f"{self.role} worker {worker_id}")
            if self.health.exit_on_failure
            else None
        )
        # Warm now: what the process holds (torch, Ray, the engine) never becomes garbage; a full collection walking it
        # would stall the engine thread's step ~100 ms (engine.runtime.gc_pauses). Only in a process of its own.
        if gc_pauses.in_own_process():
            gc_pauses.freeze_startup_heap(self.role)
        gc_pauses.watch_pauses(self.role)

    def attach_backend(self, backend: ClosingBackend) -> None:
        self.backend = backend

    def drop_request(self, engine, request_id: str) -> None:
        """Engine thread: abort the request (a no-op once the engine no longer holds it) and end its event stream."""
        engine.abort(request_id)
        self.loop.unsubscribe(request_id)

    # ---- engine thread ---------------------------------------------------------------------------
    def _on_step(self, engine, events) -> None:
        self.publish_load()
        self._note_stream_step(engine)
        note_slow_step(self.compile_watch, self.role, self.worker_id, self.loop.last_step_seconds)

    def _note_stream_step(self, engine) -> None:
        """Engine thread, after a step: the gap since the previous step, when both carried streams."""
        if not engine.scheduler.running:
            self._last_stream_step = None
            return
        now = self.loop.last_step_time
        if self._last_stream_step is not None:
            self.stream_gaps.add(now - self._last_stream_step, now)
        self._last_stream_step = now

    def publish_load(self) -> None:
        """Set the load gauges from the engine's one load figure (engine thread, after every change)."""
        metrics.observe_engine_load(self.role, self.worker_id, self.engine.load())
        prefix = self.engine.prefix
        self._prefix_counters.observe(prefix.stats if prefix is not None else None)
        if self._spec_counters is not None:
            assert self.engine.speculator is not None  # the counters exist on speculative engines only
            self._spec_counters.observe(self.engine.speculator.stats)
        if prefix is not None and (self._digest is None or self._digest.version != prefix.version):
            self._digest = prefix.digest()  # immutable: stats() reads it from the actor's thread

    # ---- actor API -------------------------------------------------------------------------------
    def stats(self) -> WorkerStats:
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            incarnation=self.incarnation,
            load=self.engine.load(),
            max_slots=self.max_slots,
            kv_capacity_tokens=self.kv_capacity_tokens,
            kv_page_tokens=self.kv_page_tokens,
            prefix=self._digest,
            problem=self.loop.problem(self.health.stall_timeout_s),
            fast_paths_active=self.fast_paths_active,
            fast_path_fallbacks=self.fast_path_fallbacks,
        )

    async def signals(self) -> WorkerSignals:
        """The pool planner's view of this worker (service/pools.py): load, uncomputed prompt tokens (read on the
        engine thread), the p90 of the latency this role is scaled on."""

        def queue_tokens(engine) -> int:
            reqs = [*engine.scheduler.waiting, *engine.scheduler.running]
            return sum(len(r.prompt) - r.num_computed for r in reqs if r.in_prefill)

        queued = await self.loop.acall(queue_tokens)
        window = self.first_token_times if self.role == "prefill" else self.stream_gaps
        p90, n = window.quantile(0.9)
        return WorkerSignals(
            worker_id=self.worker_id,
            role=self.role,
            incarnation=self.incarnation,
            load=self.engine.load(),
            queue_tokens=queued,
            ttft_p90_s=p90 if self.role == "prefill" else None,
            itl_p90_s=p90 if self.role != "prefill" else None,
            samples=n,
        )

    def ping(self) -> str:
        problem = self.loop.problem(self.health.stall_timeout_s)
        if problem is not None:
            raise RuntimeError(f"{self.role} worker {self.worker_id}: {problem}")
        return self.incarnation

    def inject_fault(self, kind: str) -> None:
        """Test hook (only with HealthOptions.test_hooks): the engine's next step raises or hangs."""
        if not self.health.test_hooks:
            raise PermissionError(f"{self.role} worker {self.worker_id}: test hooks are off")
        self.loop.inject_fault(kind)

    def shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.loop.stop()
        if self.parallel is not None and not self.data_parallel:
            release_followers(self.engine)  # the loop has stopped: no step broadcast can interleave
        if self.backend is not None:
            self.backend.close()
