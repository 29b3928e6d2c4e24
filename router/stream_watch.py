"""Which streams wait on which worker, so that a worker found down releases them (used by the stream's owner: the
router on its Generate RPC, the ingress replica on the service's path, which learns of it from the router's Health).

Why: a worker that is alive to Ray but makes no progress (a stopped process, a hung engine step) never ends its
streams; they would wait until it recovers. When the router marks a worker down, every stream waiting on it
fails with `WorkerDied` at once, and the router's usual recovery takes over (a retry before the first token, a
migration after it).

How: a stream awaits its worker's next event through `StreamWatch.next`. Marking the worker down cancels the
stream's task only while it is inside that await (so a cancellation never lands in the middle of a gRPC write);
the CancelledError is taken back (`Task.uncancel`) and raised as WorkerDied. A stream busy elsewhere at that
moment gets the WorkerDied at its next `next`. No task is created per event: the hot path is one await.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from router.dispatch import WorkerDied

_END = object()


class StreamWatch:
    """One stream's link to the workers it currently depends on (`workers`: drop one once it is done)."""

    def __init__(self, registry: StreamWatches, workers: set[str], incarnations: dict[str, str] | None = None):
        self._registry = registry
        self.workers = set(workers)
        self.incarnations = dict(incarnations or {})  # worker -> the process the stream runs on ("" / absent: any)
        self.task = asyncio.current_task()
        self.down: str | None = None  # the worker marked down under this stream
        self._waiting = False

    def release(self, worker_id: str) -> None:
        """The stream no longer depends on worker_id (e.g. its prefill is over)."""
        self.workers.discard(worker_id)

    def close(self) -> None:
        self._registry._watches.discard(self)

    async def next(self, events: AsyncIterator):
        """The next event of `events`, or _END when it is exhausted; WorkerDied once a worker is marked down."""
        self._raise_if_down()
        # The task reading now: a stream may be read by more than one task over its life (the ingress awaits its
        # first event in a task of its own, then the response's task reads the rest).
        self.task = asyncio.current_task()
        self._waiting = True
        try:
            return await anext(events)
        except StopAsyncIteration:
            return _END
        except asyncio.CancelledError:
            assert self.task is not None  # CancelledError: we run in a task
            if self.down is None or self.task.uncancel() > 0:  # a real cancellation (or one more): let it through
                raise
            self._raise_if_down()
            raise
        finally:
            self._waiting = False

    def _raise_if_down(self) -> None:
        if self.down is not None:
            raise WorkerDied(self.down, "marked down by the router's health check (no answer or no progress)")

    def depends_on(self, worker_id: str, incarnation: str = "") -> bool:
        """Does the stream wait on worker_id, in that incarnation ("" on either side: whichever)?"""
        if worker_id not in self.workers:
            return False
        mine = self.incarnations.get(worker_id, "")
        return not incarnation or not mine or mine == incarnation

    def _worker_down(self, worker_id: str) -> None:
        if self.down is None and worker_id in self.workers:
            self.down = worker_id
            if self._waiting and self.task is not None:
                self.task.cancel()


class StreamWatches:
    """The router's registry of StreamWatch; `worker_down` releases every stream waiting on a worker."""

    END = _END

    def __init__(self):
        self._watches: set[StreamWatch] = set()

    def __len__(self) -> int:
        return len(self._watches)

    def watch(self, *workers: str, incarnations: dict[str, str] | None = None) -> StreamWatch:
        """A stream waiting on `workers`; incarnations: the process of each it runs on (a verdict about another
        process of the same worker does not release it)."""
        w = StreamWatch(self, set(workers), incarnations)
        self._watches.add(w)
        return w

    def worker_down(self, worker_id: str, incarnation: str = "") -> int:
        """The worker is down (incarnation: that process of it; "": whichever) -> how many streams were released.
        A verdict from a router that has not seen the worker's restart names the old process: streams placed on
        the new one by another router go on."""
        hit = [w for w in self._watches if w.down is None and w.depends_on(worker_id, incarnation)]
        for w in hit:
            w._worker_down(worker_id)
        return len(hit)
