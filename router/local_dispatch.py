"""A real in-process Dispatcher: N colocated `EngineCore`s, each stepped by its own `EngineLoop` thread.

Used by the router tests and as the "colocated single engine" deployment (`LocalDispatcher(1)`); the Ray
dispatcher implements the same `router.dispatch.Dispatcher` protocol with remote actors.

Threading model (why it looks like an actor): an `EngineCore` is not thread-safe and one `step()` can take
a while, so each engine is owned by an `engine.runtime.engine_loop.EngineLoop` (the same loop the prefill/decode
worker actors use) and everything else talks to it through `call` and per-request event sinks. The event
loop never waits for a step, and no lock is held across one. After every step (and every add/abort) the
engine thread publishes a frozen `WorkerInfo` load snapshot, so `workers()` is a plain read.

Liveness is learned the way a remote caller learns it: `workers()` reports the verdict of the last
`health_check()`, and a request sent to a worker that has died fails with `WorkerDied` (the loop's own
`LoopStopped`, or the exception that crashed a step, is translated at this boundary). `kill()` and
`restart()` simulate an actor crash and the supervisor (Ray) bringing up a fresh one with an empty cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable

from engine.execution.request import TokenEvent
from engine.execution.runner import EngineCore
from engine.handoff import PrefixDigest
from engine.runtime.async_sink import AsyncSink
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.loop_errors import LoopStopped
from engine.telemetry import metrics
from engine.telemetry.compile_watch import CompileWatch, install_variant_log, note_slow_step
from router.dispatch import DispatchRequest, WorkerDied, WorkerInfo


class LocalWorker:
    """One engine and the EngineLoop thread that steps it."""

    def __init__(self, worker_id: str, engine_factory: Callable[[], EngineCore], stall_timeout_s: float = 60.0):
        self.worker_id = worker_id
        self.stall_timeout_s = stall_timeout_s
        self._factory = engine_factory
        self._incarnation = 0
        self._start()

    def _start(self) -> None:
        self._incarnation += 1
        self.engine = self._factory()
        self._killed = False
        self._digest: PrefixDigest | None = None
        self._prefix_counters = metrics.PrefixCounters("colocated", self.worker_id)  # a new engine counts from 0
        # what compiles after load (and its warm-up) stalls a serving step: named as it happens
        cuda = self.engine.device.type == "cuda"
        self._compile_watch = CompileWatch(variants=install_variant_log()) if cuda else None
        self._snapshot = self._info()
        self.loop = EngineLoop(self.engine, name=f"engine-{self.worker_id}", on_step=self._on_step)

    # ---- called from the event loop --------------------------------------------------------------
    def info(self) -> WorkerInfo:
        return self._snapshot

    def alive(self) -> bool:
        """Loop running, and not stuck in one step or call for longer than the stall timeout (EngineLoop.problem)."""
        return self.loop.problem(self.stall_timeout_s) is None

    async def generate(self, request: DispatchRequest) -> AsyncGenerator[TokenEvent, None]:
        loop, rid = self.loop, request.request_id  # the incarnation this request runs on
        sink = AsyncSink(asyncio.get_running_loop())

        def add(engine: EngineCore) -> None:  # a ValueError here is the request's problem, not the worker's
            engine.add_request(list(request.prompt_ids), request.params, rid)
            loop.subscribe(rid, sink)
            self._publish()

        done = False
        try:
            try:
                await loop.acall(add)
            except LoopStopped:
                raise self._died(loop) from None
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise self._died(loop, item) from None
                if item.finished:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:  # client went away, rejected, or we failed: free the engine's pages (no-op if unknown)
                loop.call(lambda engine: self._abort(loop, engine, rid))

    def kill(self) -> None:
        """Simulate a crash: the loop stops after its current step; in-flight requests get WorkerDied."""
        self._killed = True
        self.loop.stop(timeout=0)

    def restart(self) -> None:
        """Bring up a fresh engine (empty cache) after a crash, as a supervisor would."""
        self.stop()
        self._start()

    def stop(self, timeout: float = 10.0) -> None:
        self.loop.stop(timeout)

    def _died(self, loop: EngineLoop, cause: BaseException | None = None) -> WorkerDied:
        """The WorkerDied a caller sees for a loop that ended (killed, crashed, or stopped)."""
        if cause is not None and not isinstance(cause, LoopStopped):  # the step's own exception
            return WorkerDied(self.worker_id, f"{type(cause).__name__}: {cause}")
        if loop is self.loop and self._killed:
            return WorkerDied(self.worker_id, "killed")
        if loop.error is not None:
            return WorkerDied(self.worker_id, f"{type(loop.error).__name__}: {loop.error}")
        return WorkerDied(self.worker_id, "stopped")

    # ---- the engine thread ---------------------------------------------------------------------
    def _abort(self, loop: EngineLoop, engine: EngineCore, rid: str) -> None:
        engine.abort(rid)
        loop.unsubscribe(rid)
        self._publish()

    def _on_step(self, engine: EngineCore, events: list[TokenEvent]) -> None:
        for ev in events:
            if ev.finished:  # the engine keeps finished requests until popped
                engine.pop_finished(ev.request_id)
        self._publish()
        note_slow_step(self._compile_watch, "colocated", self.worker_id, self.loop.last_step_seconds)

    def _publish(self) -> None:
        self._snapshot = self._info()

    def _info(self) -> WorkerInfo:
        load = self.engine.load()
        prefix = self.engine.prefix  # _info runs on the engine thread: the digest is a consistent copy
        if prefix is not None:
            self._prefix_counters.observe(prefix.stats)
            if self._digest is None or self._digest.version != prefix.version:
                self._digest = prefix.digest()
        states = self.engine.model.fast_path_states
        return WorkerInfo(
            self.worker_id,
            "colocated",
            True,
            load.running,
            load.waiting,
            load.kv_free_tokens,
            load.kv_usage,
            f"{self.worker_id}#{self._incarnation}",
            prefix=self._digest,
            fast_paths_active=tuple(p.name for p in states if p.active),
            fast_path_fallbacks=tuple(f"{p.name}: {p.why}" for p in states if not p.active),
        )


class LocalDispatcher:
    """`num_workers` colocated engines in this process (`worker_ids` default "engine-0", "engine-1", ...)."""

    def __init__(
        self,
        num_workers: int = 1,
        engine_factory: Callable[[], EngineCore] | None = None,
        worker_ids: list[str] | None = None,
        stall_timeout_s: float = 60.0,
    ):
        if engine_factory is None:
            from engine.loading.load import load_engine

            engine_factory = load_engine  # the built-in tiny model
        ids = worker_ids or [f"engine-{i}" for i in range(num_workers)]
        if len(ids) != num_workers or len(set(ids)) != num_workers:
            raise ValueError(f"need {num_workers} distinct worker ids, got {ids}")
        self._workers = {wid: LocalWorker(wid, engine_factory, stall_timeout_s) for wid in ids}
        self._healthy = {wid: True for wid in ids}

    def workers(self) -> list[WorkerInfo]:
        return [dataclasses.replace(w.info(), healthy=self._healthy[wid]) for wid, w in self._workers.items()]

    async def generate(
        self, request: DispatchRequest, prefill_id: str, decode_id: str
    ) -> AsyncGenerator[TokenEvent, None]:
        if prefill_id != decode_id:
            raise RuntimeError(
                f"colocated dispatcher cannot hand {request.request_id} off from {prefill_id} to {decode_id}"
            )
        worker = self._workers.get(prefill_id)
        if worker is None:
            raise WorkerDied(prefill_id, "unknown worker")
        async with contextlib.aclosing(worker.generate(request)) as events:
            async for ev in events:
                yield ev

    async def health_check(self) -> dict[str, bool]:
        self._healthy = {wid: w.alive() for wid, w in self._workers.items()}
        return dict(self._healthy)

    def kill(self, worker_id: str) -> None:
        self._workers[worker_id].kill()

    def inject_fault(self, worker_id: str, kind: str) -> None:
        """Test hook: that engine's next step raises ("raise") or never returns ("hang"; `close` ends it)."""
        self._workers[worker_id].loop.inject_fault(kind)

    def restart(self, worker_id: str) -> None:
        self._workers[worker_id].restart()

    def engine(self, worker_id: str) -> EngineCore:
        return self._workers[worker_id].engine

    def close(self) -> None:
        for w in self._workers.values():
            w.stop()
