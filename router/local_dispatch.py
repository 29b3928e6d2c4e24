"""A real in-process Dispatcher: N colocated `EngineCore`s, each stepped by its own thread.

Used by the router tests and as the "colocated single engine" deployment (`LocalDispatcher(1)`); the Ray
dispatcher implements the same `router.dispatch.Dispatcher` protocol with remote actors.

Threading model (why it looks like an actor): an `EngineCore` is not thread-safe and one `step()` can take
a while, so each engine is owned by one thread and everything else talks to it through an inbox
(add / abort / stop). The event loop never waits for a step, and no lock is held across one. Events go
back to the requesting coroutine's asyncio queue with `call_soon_threadsafe`. The thread publishes a
frozen `WorkerInfo` load snapshot after every step, so `workers()` is a plain read.

Liveness is learned the way a remote caller learns it: `workers()` reports the verdict of the last
`health_check()`, and a request sent to a worker that has died fails with `WorkerDied`. `kill()` and
`restart()` simulate an actor crash and the supervisor (Ray) bringing up a fresh one with an empty cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from engine.request import TokenEvent
from engine.runner import EngineCore
from router.dispatch import DispatchRequest, WorkerDied, WorkerInfo


@dataclass(frozen=True)
class _Sub:
    """Where a request's events go: a queue owned by the event loop that submitted it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


_STOP = ("stop",)


class LocalWorker:
    """One engine and the thread that steps it."""

    def __init__(self, worker_id: str, engine_factory: Callable[[], EngineCore], stall_timeout_s: float = 60.0):
        self.worker_id = worker_id
        self.stall_timeout_s = stall_timeout_s
        self._factory = engine_factory
        self._lock = threading.Lock()  # guards _dead + inbox puts against the thread's final drain
        self._incarnation = 0
        self._start()

    def _start(self) -> None:
        self._incarnation += 1
        self.engine = self._factory()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[str, _Sub] = {}  # owned by the engine thread
        self._dead = False
        self._kill = threading.Event()
        self._beat = time.monotonic()
        self._busy = False
        self._snapshot = self._info()
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.worker_id}", daemon=True)
        self._thread.start()

    # ---- called from the event loop --------------------------------------------------------------
    def info(self) -> WorkerInfo:
        return self._snapshot

    def alive(self) -> bool:
        """Thread running, and not stuck in one step for longer than the stall timeout."""
        if self._dead or not self._thread.is_alive():
            return False
        return not (self._busy and time.monotonic() - self._beat > self.stall_timeout_s)

    async def generate(self, request: DispatchRequest) -> AsyncIterator[TokenEvent]:
        sub = _Sub(asyncio.get_running_loop(), asyncio.Queue())
        self._post(("add", request, sub))
        done = False
        try:
            while True:
                item = await sub.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    done = True
                yield item
                if done:
                    return
        finally:
            if not done:  # client went away or we failed: free the engine's pages
                with contextlib.suppress(WorkerDied):
                    self._post(("abort", request.request_id))

    def kill(self) -> None:
        """Simulate a crash: the thread stops after its current step; in-flight requests get WorkerDied."""
        self._kill.set()
        self._inbox.put(_STOP)

    def restart(self) -> None:
        """Bring up a fresh engine (empty cache) after a crash, as a supervisor would."""
        self.stop()
        self._start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    def _post(self, msg) -> None:
        with self._lock:
            if self._dead:
                raise WorkerDied(self.worker_id, "engine thread is not running")
            self._inbox.put(msg)

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            while self._drain(block=not self.engine.has_work):
                if self._kill.is_set():
                    error = WorkerDied(self.worker_id, "killed")
                    break
                if self.engine.has_work:
                    self._busy, self._beat = True, time.monotonic()
                    events = self.engine.step()
                    self._busy, self._beat = False, time.monotonic()
                    self._deliver(events)
                    if not events:  # nothing admissible yet (cache full): do not spin a core
                        time.sleep(0.001)
                self._snapshot = self._info()
        except BaseException as e:  # an engine crash is a worker death for everyone on it
            error = WorkerDied(self.worker_id, f"{type(e).__name__}: {e}")
        finally:
            self._shut_down(error or WorkerDied(self.worker_id, "killed" if self._kill.is_set() else "stopped"))

    def _drain(self, block: bool) -> bool:
        """Apply queued messages (waiting for one when idle); False when told to stop."""
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg is _STOP:
                return False
            if msg[0] == "add":
                _, req, sub = msg
                try:
                    self.engine.add_request(list(req.prompt_ids), req.params, req.request_id)
                except Exception as e:  # this request's problem (ValueError: rejected), not the worker's
                    sub.put(e)
                    continue
                self._subs[req.request_id] = sub
            elif msg[0] == "abort":
                self.engine.abort(msg[1])
                self._subs.pop(msg[1], None)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            sub = self._subs.get(ev.request_id)
            if ev.finished:
                self.engine.pop_finished(ev.request_id)  # the engine keeps finished requests until popped
                self._subs.pop(ev.request_id, None)
            if sub is not None:
                sub.put(ev)

    def _shut_down(self, error: WorkerDied) -> None:
        with self._lock:
            self._dead = True
            pending = []
            while True:  # requests posted after the loop ended must not wait forever
                try:
                    pending.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        for msg in pending:
            if msg is not _STOP and msg[0] == "add":
                msg[2].put(error)
        for sub in self._subs.values():
            sub.put(error)
        self._subs.clear()

    def _info(self) -> WorkerInfo:
        sched, pool = self.engine.scheduler, self.engine.pool
        usage = pool.usage()
        return WorkerInfo(self.worker_id, "colocated", True, len(sched.running), len(sched.waiting),
                          self.engine.pool.free_tokens(), max(usage.values()) if usage else 0.0,
                          f"{self.worker_id}#{self._incarnation}")


class LocalDispatcher:
    """`num_workers` colocated engines in this process (`worker_ids` default "engine-0", "engine-1", ...)."""

    def __init__(self, num_workers: int = 1, engine_factory: Callable[[], EngineCore] | None = None,
                 worker_ids: list[str] | None = None, stall_timeout_s: float = 60.0):
        if engine_factory is None:
            from engine.llm import load_engine

            engine_factory = load_engine  # the built-in tiny model
        ids = worker_ids or [f"engine-{i}" for i in range(num_workers)]
        if len(ids) != num_workers or len(set(ids)) != num_workers:
            raise ValueError(f"need {num_workers} distinct worker ids, got {ids}")
        self._workers = {wid: LocalWorker(wid, engine_factory, stall_timeout_s) for wid in ids}
        self._healthy = {wid: True for wid in ids}

    def workers(self) -> list[WorkerInfo]:
        return [dataclasses.replace(w.info(), healthy=self._healthy[wid]) for wid, w in self._workers.items()]

    async def generate(self, request: DispatchRequest, prefill_id: str, decode_id: str) -> AsyncIterator[TokenEvent]:
        if prefill_id != decode_id:
            raise RuntimeError(f"colocated dispatcher cannot hand {request.request_id} off from "
                               f"{prefill_id} to {decode_id}")
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

    def restart(self, worker_id: str) -> None:
        self._workers[worker_id].restart()

    def engine(self, worker_id: str) -> EngineCore:
        return self._workers[worker_id].engine

    def close(self) -> None:
        for w in self._workers.values():
            w.stop()
