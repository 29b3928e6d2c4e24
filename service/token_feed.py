"""The ingress replica's side of the token feeds: one Ray stream per decode worker carrying the tokens of every request
this replica runs there (decode_worker.token_feed has the worker's side and the why: one Ray item an engine step for
all of them, instead of one a request).

`TokenFeeds.subscribe(worker_id, handle, request_id)` opens that worker's feed on first need (and again after one
ended) and registers the request before its `decode` call names the feed, so none of its events can be missed; the
`FeedQueue` it returns is what the request's consumer (service.ray_stream.RayStreamer.run_placement) reads in place of
a stream of its own. One reader task a feed takes each item off Ray (service.ray_items.next_item) and hands its events
to the requests' queues: one wake-up of a request's consumer an item, however many of its events the item holds.

Failures: the feed's call ending (the worker died -> `WorkerDied`; its engine failed -> `WorkerDied`; any other end,
even a clean one -> `WorkerDied`) fails every request on it, each after the events it already got, and the feed is
forgotten (the next request opens a new one); the request's owner then retries or migrates it (router.migration).
A request whose join failed on the worker (`RequestFailed`) fails alone, with the worker's error.
Lifetime: a feed's keeper task renews the feed's lease on the worker every third of `lease_s` (the worker ends a feed
not renewed for `lease_s`: how a dead replica's feed leaves the worker, decode_worker.token_feed), and closes the feed
once it has carried no request for `idle_s` (DSV4_TOKEN_FEED_IDLE_S); the next request opens a new one.
Backpressure: the reader never waits on a request, so a slow one never holds back another's tokens. A queue holds at
most `limit` undelivered events (more than any request produces unless its consumer stopped reading: a client that
does not read its response while Serve's buffers are full); one that overflows drops them and fails its request alone
with RESOURCE_EXHAUSTED (the consumer's `finally` aborts it on the worker, freeing its pages), the feed goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import uuid

import ray

from decode_worker.token_feed import RequestFailed
from dsv4_kernels.settings import settings
from router.dispatch import WorkerDied
from router.migration import Code, RouterFailure
from service.ray_items import DEAD, END, failure, next_item

log = logging.getLogger(__name__)
QUEUE_LIMIT = 65_536  # undelivered events a request (module docstring: backpressure)
# A worker drops a feed not renewed for this long (module docstring: lifetime). Long against a replica loop's stall
# (a feed lost to one fails its requests as WorkerDied), short against pages held by a dead replica's requests.
LEASE_S = 30.0


class FeedQueue:
    """One request's events from its worker's feed, read by the request's consumer (one task) with `get`."""

    def __init__(self, request_id: str, feed: TokenFeed, limit: int = QUEUE_LIMIT):
        self.request_id = request_id
        self.feed = feed
        self.limit = limit
        self._events: collections.deque = collections.deque()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    @property
    def feed_id(self) -> str:
        return self.feed.feed_id

    def put(self, event) -> None:
        if self._error is not None:
            return
        if isinstance(event, RequestFailed):
            worker = self.feed.worker_id
            died = event.engine_stopped
            self.fail(
                WorkerDied(worker, f"its engine failed: {event.message}") if died else RuntimeError(event.message)
            )
            return
        if len(self._events) >= self.limit:
            self._events.clear()  # nobody reads them: fail now, not after a backlog the client will never take
            self.fail(
                RouterFailure(
                    Code.RESOURCE_EXHAUSTED,
                    f"request {self.request_id}: its client fell {self.limit} events behind; the request was stopped",
                )
            )
            return
        self._events.append(event)
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the queue with `error`, raised once the events before it are taken."""
        if self._error is None:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> list:
        """Every event that came since the last get (at least one), in order; the queue's error once they are out."""
        while not self._events:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events = list(self._events)
        self._events.clear()
        return events

    def close(self) -> None:
        """The request is over here (finished, failed, cancelled): its events, if any still come, are dropped."""
        if self.feed.queues.get(self.request_id) is self:  # not a later attempt's queue under the same id
            del self.feed.queues[self.request_id]
            self.feed.last_used = time.monotonic()


class TokenFeed:
    """One worker's feed to this replica: the Ray call, its reader task, the requests' queues."""

    def __init__(self, worker_id: str, handle, actor_key: object, lease_s: float = LEASE_S, idle_s: float = 300.0):
        self.worker_id = worker_id
        self.actor_key = actor_key
        self.feed_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.queues: dict[str, FeedQueue] = {}
        self.last_used = time.monotonic()  # when its last request left (module docstring: lifetime)
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future = loop.create_future()
        self.ended = False
        call: object = handle.token_feed
        self._stream = call.options(num_returns="streaming").remote(self.feed_id, lease_s)  # type: ignore[attr-defined]
        self.reader = loop.create_task(self._read())
        self.keeper = loop.create_task(self._keep(handle, lease_s, idle_s))

    async def _read(self) -> None:
        error: BaseException = WorkerDied(self.worker_id, "its token feed ended")
        try:
            first = await next_item(self._stream)
            if first is END:
                raise WorkerDied(self.worker_id, "its token feed ended before it opened")
            self.opened.set_result(None)
            while (item := await next_item(self._stream)) is not END:
                for event in item:
                    queue = self.queues.get(event.request_id)
                    if queue is not None:
                        queue.put(event)
        except DEAD as e:
            error = WorkerDied(self.worker_id, str(e))
        except asyncio.CancelledError:
            error = WorkerDied(self.worker_id, "this replica closed its token feed")
            raise
        except WorkerDied as e:
            error = e
        except Exception as e:  # noqa: BLE001 - the worker's error (RayTaskError): every request on it gets it
            error = failure(e, self.worker_id)
            if not isinstance(error, WorkerDied):
                log.warning("token feed of %s ended: %r", self.worker_id, error)
                error = WorkerDied(self.worker_id, f"its token feed failed: {error}")
        finally:
            self.end(error)

    async def _keep(self, handle, lease_s: float, idle_s: float) -> None:
        """Renew the feed's lease on the worker until it ends; close it once idle for `idle_s`."""
        with contextlib.suppress(Exception):
            await self.opened  # its failure is the subscribers' to see
        period = min(lease_s / 3, idle_s)
        while not self.ended:
            await asyncio.sleep(period)
            if self.ended:
                return
            if not self.queues and time.monotonic() - self.last_used >= idle_s:
                self.close()
                self.end(WorkerDied(self.worker_id, "its token feed was closed after idling"))
                return
            try:
                await handle.renew_feed.remote(self.feed_id)
            except Exception as e:  # noqa: BLE001 - a dead worker: the reader reports it
                log.debug("renewing the token feed of %s: %s", self.worker_id, e)

    def end(self, error: BaseException) -> None:
        self.ended = True
        if not self.opened.done():
            self.opened.set_exception(error)
            self.opened.exception()  # retrieved: a feed nobody waited on must not log "never retrieved"
        for queue in list(self.queues.values()):
            queue.fail(error)

    def close(self) -> None:
        """Stop reading and renewing and cancel the call: the worker drops the requests still on it."""
        self.reader.cancel()
        if self.keeper is not asyncio.current_task():
            self.keeper.cancel()
        try:
            ray.cancel(self._stream)
        except Exception as e:  # noqa: BLE001 - best effort (a dead worker, a call already over)
            log.debug("cancelling the token feed of %s: %s", self.worker_id, e)


def _actor_key(handle) -> object:
    """Which actor a handle reaches (a group restart gives a worker id a new actor: a feed to the old one is stale)."""
    return getattr(handle, "_actor_id", None) or id(handle)


class TokenFeeds:
    """This replica's feeds, one a decode worker; create inside the loop that reads them."""

    def __init__(self, queue_limit: int = QUEUE_LIMIT, lease_s: float = LEASE_S, idle_s: float | None = None):
        """idle_s: close a feed after this long without a request (None: DSV4_TOKEN_FEED_IDLE_S)."""
        self.queue_limit = queue_limit
        self.lease_s = lease_s
        self.idle_s = settings().token_feed_idle_s if idle_s is None else idle_s
        self._feeds: dict[str, TokenFeed] = {}

    async def subscribe(self, worker_id: str, handle, request_id: str) -> FeedQueue:
        """The request's queue on the worker's feed (opened now if there is none, or the one there ended or reaches
        another actor); WorkerDied when the feed cannot open (the worker is dead)."""
        feed = self._feeds.get(worker_id)
        key = _actor_key(handle)
        if feed is None or feed.ended or feed.actor_key != key:
            if feed is not None:
                feed.close()
            feed = self._feeds[worker_id] = TokenFeed(worker_id, handle, key, self.lease_s, self.idle_s)
        queue = feed.queues[request_id] = FeedQueue(request_id, feed, self.queue_limit)
        try:
            await asyncio.shield(feed.opened)
        except BaseException:
            queue.close()
            raise
        return queue

    def lost(self, worker_id: str, feed_id: str) -> None:
        """The worker has no such feed (its process restarted, or the feed's call ended there): close it and fail
        its requests now, so the next request opens a new one instead of waiting for Ray to report the old call."""
        feed = self._feeds.get(worker_id)
        if feed is not None and feed.feed_id == feed_id and not feed.ended:
            feed.close()
            feed.end(WorkerDied(worker_id, f"its token feed {feed_id} is gone (the worker restarted?)"))

    def feed_id(self, worker_id: str) -> str | None:
        """The id of the feed to that worker open now, if any."""
        feed = self._feeds.get(worker_id)
        return feed.feed_id if feed is not None and not feed.ended else None

    def __len__(self) -> int:
        """Feeds open now (one that ended or idled out is replaced on its worker's next request)."""
        return sum(not feed.ended for feed in self._feeds.values())

    async def close(self) -> None:
        for feed in self._feeds.values():
            feed.close()
        readers = [task for f in self._feeds.values() for task in (f.reader, f.keeper)]
        self._feeds.clear()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*readers, return_exceptions=True)
