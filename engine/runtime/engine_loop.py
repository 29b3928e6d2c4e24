"""EngineLoop: one EngineCore owned by one thread, driven through an inbox.

An EngineCore is not thread-safe and a step can take a while, so the worker actors never touch it from
their event loop. Everything goes through `call(fn)` (run fn(engine) between two steps, get a
concurrent Future) and per-request event sinks. The thread steps while there is work and blocks on the
inbox when idle, so an idle worker costs no CPU.

Users: the prefill and decode worker actors, and the in-process `router.local_dispatch.LocalWorker`.
An engine of a data-parallel attention group (EngineCore.data_parallel) steps in lockstep with its peers, as
engine.execution.dp_attention.run_lockstep does for a batch: each tick the ranks all-gather whether they have work, and while
any has, every rank runs exactly one forward (its own step, or an idle forward whose experts serve the others).
Such a loop never blocks on its inbox (its peers wait in the tick's collective); an idle group ticks every
IDLE_TICK_S.
When the loop ends (stop, an exception from a step or `on_step`, or a call whose collective failed: the ranks of
a multi-rank engine are then out of step for good), every subscriber and every queued
or later call gets `LoopStopped` (a failed step: `StepFailed`, naming the step's exception); `error` keeps the
exception that ended the loop (None after a plain stop). Callers across a process boundary treat LoopStopped as
the worker's death (retryable), never as the request's fault.

Health (`problem`): the loop is unhealthy when its thread has ended, or when the engine thread has been inside one
piece of work (a step, a `call`, a lockstep tick's collective) for longer than a stall bound. The clock only runs
while the thread is busy: an idle loop, and the warm-up (which runs before the loop exists), never trip it. A
step that compiles a kernel is still "in a step", so the bound must sit well above the slowest legitimate step
(a first-use compile); a hung collective or a wedged kernel stays in its step forever and crosses it.
`inject_fault` is a test hook (the worker only exposes it when built with test hooks on).
`LoopStopped` / `StepFailed` live in engine.runtime.loop_errors and `AsyncSink` in engine.runtime.async_sink, so that
processes which run no engine (the HTTP ingress replica) use them without importing this module and torch with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable

from engine.execution.request import TokenEvent
from engine.execution.runner import EngineCore
from engine.model.parallel import is_collective_failure
from engine.runtime.async_sink import AsyncSink
from engine.runtime.loop_errors import LoopStopped, StepFailed

_STOP = object()
IDLE_TICK_S = 0.002  # data-parallel attention: how often an idle group's ranks meet to look for work
FAULTS = ("raise", "hang")  # inject_fault's kinds


class EngineLoop:
    def __init__(
        self,
        engine: EngineCore,
        name: str = "engine",
        on_step: Callable[[EngineCore, list], None] | None = None,
        on_change: Callable[[EngineCore], None] | None = None,
    ):
        """on_step(engine, events): after every step; on_change(engine): after a batch of `call`s ran
        (adds, aborts, releases change the load between steps: gauges must see those too)."""
        self.engine = engine
        self.on_step = on_step
        self.on_change = on_change
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, AsyncSink] = {}
        self._stopped = False
        self._lock = threading.Lock()  # orders call()'s check-and-put against the thread's final drain
        self.last_step_time = time.monotonic()
        self.step_started: float | None = None  # monotonic start of the step in progress (stall checks)
        self.busy_since: float | None = None  # start of the step / call / tick the thread is inside (health)
        self._fault: str | None = None  # inject_fault's pending fault (tests only)
        self._unhang = threading.Event()  # `stop` ends an injected hang (in-process tests must not leak it)
        self.last_step_seconds = 0.0  # how long the last step took (on_step reads it)
        self.error: BaseException | None = None  # what ended the loop, if an exception did
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def problem(self, stall_timeout_s: float) -> str | None:
        """None while healthy; else why not (the loop ended, or one piece of work outlasted stall_timeout_s)."""
        if self._stopped or not self._thread.is_alive():
            err = self.error
            return f"engine loop ended: {type(err).__name__}: {err}" if err is not None else "engine loop stopped"
        since = self.busy_since
        if since is not None and time.monotonic() - since > stall_timeout_s:
            return (
                f"engine thread stuck for {time.monotonic() - since:.0f} s in one step or call "
                f"(stall bound {stall_timeout_s:g} s)"
            )
        return None

    def inject_fault(self, kind: str) -> None:
        """Test hook: the next step raises ("raise") or never returns ("hang")."""
        if kind not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {kind!r}")
        self._fault = kind

    def call(self, fn: Callable[[EngineCore], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._stopped:
                self._inbox.put((fn, fut))
                return fut
        fut.set_exception(LoopStopped("engine loop is stopped"))
        return fut

    async def acall(self, fn: Callable[[EngineCore], object]):
        return await asyncio.wrap_future(self.call(fn))

    def subscribe(self, request_id: str, sink: AsyncSink) -> None:
        """Route request_id's events to sink; call through `call` so it happens before the request steps."""
        self._sinks[request_id] = sink

    def unsubscribe(self, request_id: str) -> None:
        """Forget a request's sink (aborted requests produce no final event). Engine thread only."""
        self._sinks.pop(request_id, None)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; wait up to `timeout` s for the thread (0: do not wait)."""
        self._stopped = True
        self._unhang.set()
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------------
    def _drain(self, block: bool) -> bool:
        ran = False
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if ran and self.on_change is not None:
                    self.on_change(self.engine)
                return True
            block = False
            ran = True
            if item is _STOP:
                return False
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                self.busy_since = time.monotonic()
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    if not is_collective_failure(e):
                        fut.set_exception(e)
                        continue
                    # A call's collective (e.g. pages replicated to the other ranks) failed: the group is broken,
                    # so this worker is dead, as after a failed step (the caller retries elsewhere; Ray restarts it).
                    fut.set_exception(StepFailed(f"engine call failed: {type(e).__name__}: {e}"))
                    raise
                finally:
                    self.busy_since = None

    def _run(self) -> None:
        try:
            if self.engine.data_parallel is not None:
                self._run_lockstep()
            else:
                self._run_alone()
        except BaseException as e:
            self.error = e
            raise
        finally:
            with self._lock:
                self._stopped = True
            for sink in self._sinks.values():
                sink.put(LoopStopped("engine loop stopped"))
            self._sinks.clear()
            self._fail_pending()

    def _run_alone(self) -> None:
        while self._drain(block=not self.engine.has_work):
            if not self.engine.has_work:
                continue
            if not self._step():
                time.sleep(0.001)  # nothing admissible (cache full): do not spin

    def _run_lockstep(self) -> None:
        """One rank of a data-parallel attention group (module docstring)."""
        engine, ctx = self.engine, self.engine.data_parallel
        assert ctx is not None  # run() takes this path only with data-parallel attention
        while self._drain(block=False):
            self.busy_since = time.monotonic()  # a peer that never meets us hangs here
            counts = ctx.gather_counts(int(engine.has_work))
            self.busy_since = None
            if not any(counts):
                time.sleep(IDLE_TICK_S)
                continue
            self._step()  # every rank, with or without requests (EngineCore._step_lockstep agrees the tick)

    def _step(self) -> list[TokenEvent]:
        """One engine step; its events go to their sinks. A failed step fails every subscriber."""
        started = self.step_started = self.busy_since = time.monotonic()
        try:
            if self._fault is not None:
                self._take_fault()
            events = self.engine.step()
        except BaseException as e:
            failed = StepFailed(f"engine step failed: {type(e).__name__}: {e}")
            for sink in self._sinks.values():
                sink.put(failed)
            self._sinks.clear()
            raise
        finally:
            self.step_started = self.busy_since = None
        self.last_step_time = time.monotonic()
        self.last_step_seconds = self.last_step_time - started
        self._deliver(events)
        if self.on_step is not None:
            self.on_step(self.engine, events)
        return events

    def _take_fault(self) -> None:
        kind, self._fault = self._fault, None
        if kind == "hang":  # a wedged kernel / collective: in a worker only the process's end releases it
            self._unhang.wait()
            raise RuntimeError("injected hang ended by stop (test hook)")
        raise RuntimeError("injected step failure (test hook)")

    def _fail_pending(self) -> None:
        """Calls queued after the stop signal must not wait forever."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP and item[1].set_running_or_notify_cancel():
                item[1].set_exception(LoopStopped("engine loop is stopped"))

    def _deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            sink = self._sinks.get(ev.request_id)
            if sink is None:
                continue
            sink.put(ev)
            if ev.finished or ev.request_id in self.engine.held:
                del self._sinks[ev.request_id]
