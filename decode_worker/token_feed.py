"""The decode worker's side of a token feed: one Ray stream per ingress replica carrying every request's tokens.

Why: a Ray streaming item costs its reader ~0.57 ms and its producer ~0.5 ms of CPU (BENCHMARKS.md, section
frontdoor's reading), and with one `decode` stream a request every engine step sends one item per running request.
A feed is one long-lived Ray streaming call (`DecodeWorker.token_feed`) that an ingress replica opens to this worker;
each request it then opens with `decode(..., feed=feed_id)` has its events routed to that feed's sink, and the feed
sends every event ready at once (all of that replica's requests of one engine step) as one item: a tuple of
`TokenEvent`s (each names its request) and `RequestFailed`s. The reader demultiplexes them by request id
(service.token_feed). The same feed can travel over TCP instead (decode_worker.tcp_feed: the worker calls its replica
back and writes each burst as one frame; DSV4_TOKEN_FEED_TRANSPORT): everything here is shared by both.

Who frees what: a request joined to a feed is popped from the engine by the feed when its finished event has been
sent, dropped by `abort` (the ingress's fire-and-forget abort: client gone, deadline, stop string), and dropped with
the feed when the feed's call ends (cancelled by its replica, or its generator closed): a feed never leaves a request
behind it.

A reader that dies (its replica's process killed) is not noticed by Ray here: the call's generator goes on (tested with
Ray 2.60: a killed caller's feed and its requests stayed on the worker). So a feed opened with a lease (`lease_s`) is
ended by the worker once its replica has not renewed it (`renew`) for that long: the feed's call raises FeedExpired and
its end drops its requests as any other end. A replica whose loop stalls past the lease loses its feed the same way;
its requests then fail as WorkerDied and are retried (service.token_feed).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from engine.runtime.async_sink import AsyncSink
from engine.runtime.loop_errors import LoopStopped


class FeedUnknown(Exception):
    """`decode(feed=...)` named a feed this worker process does not have (it restarted since the feed opened)."""

    def __init__(self, feed_id: str, worker_id: str):
        super().__init__(f"decode worker {worker_id} has no token feed {feed_id!r} (restarted since it opened?)")
        self.feed_id = feed_id
        self.worker_id = worker_id

    def __reduce__(self):  # travels through Ray: rebuild from the constructor's arguments
        return type(self), (self.feed_id, self.worker_id)


class FeedExpired(Exception):
    """A feed's replica did not renew it within its lease (the replica is gone): the feed ends, its requests dropped."""

    def __init__(self, feed_id: str, lease_s: float):
        super().__init__(f"token feed {feed_id!r} was not renewed for {lease_s} s (its reader is gone?)")
        self.feed_id = feed_id
        self.lease_s = lease_s

    def __reduce__(self):
        return type(self), (self.feed_id, self.lease_s)


@dataclass(frozen=True)
class RequestFailed:
    """A feed's item for one request that failed after its `Transferred` (its join). Text, not the exception: an item
    that fails to pickle or unpickle would end the feed for every request on it."""

    request_id: str
    message: str
    engine_stopped: bool  # the engine loop ended (the worker's death, to its reader), else the request's own failure

    @classmethod
    def of(cls, request_id: str, error: BaseException) -> RequestFailed:
        return cls(request_id, f"{type(error).__name__}: {error}", isinstance(error, LoopStopped))


class FeedSink(AsyncSink):
    """Events of many requests, put by the engine thread (one `put` per event) and taken by the feed in bursts: one
    wake-up of the actor's event loop per burst (an engine step's events), not one per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(loop)
        self._lock = threading.Lock()
        self._pending: list = []
        self._woken = False  # a wake-up is scheduled and the burst not taken yet
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        with self._lock:
            self._pending.append(item)
            if self._woken:
                return
            self._woken = True
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # loop closed: nobody listens any more
            pass

    async def take(self) -> list:
        """Every item put since the last take (at least one), in order."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            with self._lock:
                items, self._pending, self._woken = self._pending, [], False
            if items:
                return items


@dataclass(frozen=True)
class Batch:
    """One burst of a feed, split: what to send, the requests it finishes, and an error that ends the feed."""

    items: tuple  # TokenEvent / RequestFailed, in the order they were put
    finished: tuple[str, ...]
    tokens: int
    error: BaseException | None  # an engine failure (LoopStopped, StepFailed): every request on the feed fails


class Feed:
    """One open feed on this worker: its sink and the requests routed to it (request id -> monotonic join time);
    with a lease, the task that ends it when its replica stops renewing it."""

    def __init__(self, feed_id: str, loop: asyncio.AbstractEventLoop, lease_s: float | None = None):
        self.feed_id = feed_id
        self.sink = FeedSink(loop)
        self.requests: dict[str, float] = {}
        self.closed = False  # its call or connection ended: a request must not join it any more
        self.renewed = time.monotonic()
        self.watch = loop.create_task(self._watch_lease(lease_s)) if lease_s is not None else None

    async def _watch_lease(self, lease_s: float) -> None:
        while (late := time.monotonic() - self.renewed) < lease_s:
            await asyncio.sleep(lease_s - late)
        self.sink.put(FeedExpired(self.feed_id, lease_s))  # ends the feed's call through its next batch

    async def next_batch(self) -> Batch:
        items: list = []
        finished: list[str] = []
        tokens = 0
        error = None
        for item in await self.sink.take():
            if isinstance(item, BaseException):
                error = item
                break
            if isinstance(item, RequestFailed):
                self.requests.pop(item.request_id, None)
            elif item.finished:
                finished.append(item.request_id)
            tokens += getattr(item, "token_id", None) is not None
            items.append(item)
        return Batch(tuple(items), tuple(finished), tokens, error)

    def fail(self, request_id: str, error: BaseException) -> None:
        """A request routed here failed before it joined the batch: its reader gets the error."""
        if self.requests.pop(request_id, None) is not None:
            self.sink.put(RequestFailed.of(request_id, error))

    def finish(self, request_ids: tuple[str, ...]) -> list[float]:
        """The requests are over (finished and sent): -> how long each was on the feed, in seconds."""
        now = time.monotonic()
        return [now - self.requests.pop(rid) for rid in request_ids if rid in self.requests]


class Feeds:
    """A worker's open feeds, by id (the ingress replica names each one it opens)."""

    def __init__(self):
        self._open: dict[str, Feed] = {}

    def open(self, feed_id: str, loop: asyncio.AbstractEventLoop, lease_s: float | None = None) -> Feed:
        """A new feed (`lease_s`: it ends unless renewed at least that often; None: it lasts as long as its call)."""
        feed = self._open[feed_id] = Feed(feed_id, loop, lease_s)
        return feed

    def renew(self, feed_id: str) -> bool:
        """Its replica still reads the feed -> whether this process has it."""
        feed = self._open.get(feed_id)
        if feed is not None:
            feed.renewed = time.monotonic()
        return feed is not None

    def __len__(self) -> int:
        return len(self._open)

    def get(self, feed_id: str, worker_id: str) -> Feed:
        feed = self._open.get(feed_id)
        if feed is None or feed.closed:
            raise FeedUnknown(feed_id, worker_id)
        return feed

    def close(self, feed: Feed) -> list[str]:
        """The feed's call ended: -> the requests still routed to it (the caller drops them)."""
        if self._open.get(feed.feed_id) is feed:
            del self._open[feed.feed_id]
        feed.closed = True
        if feed.watch is not None:
            feed.watch.cancel()
        left, feed.requests = list(feed.requests), {}
        return left

    def forget(self, request_id: str) -> None:
        """The request was aborted: no feed holds it any more (its events, if any still come, are ignored)."""
        for feed in self._open.values():
            feed.requests.pop(request_id, None)
