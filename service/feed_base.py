"""An ingress replica's token feed, whatever carries it (service.token_feed: a Ray streaming call; service.tcp_feed: a
TCP connection the decode worker opens to this replica): the requests' bounded queues and what a feed does
the same over both (service.token_feed's docstring has the why, the failures and the lifetime).

`TokenFeed` is the part both transports share: the feed's id, its requests' `FeedQueue`s, `opened` (set once the
worker's end is up), the keeper task (renews the lease every third of `lease_s`, closes the feed once it has carried
no request for `idle_s`), `deliver` (a burst's events to their queues; a plain token of a request whose task waits
for it is written to its client right there, by the request's service.token_lane.TokenLane; service.tcp_feed hands
a frame's plain tokens to `FeedQueue.take_plain` as their values first) and `end` (every request on the feed fails
with the same error, after the events it already got). A transport supplies `renew` and `_stop` and starts its own
reading.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
import uuid

from decode_worker.token_feed import RequestFailed
from router.dispatch import WorkerDied
from router.migration import Code, RouterFailure

log = logging.getLogger(__name__)
QUEUE_LIMIT = 65_536  # undelivered events a request (service.token_feed's docstring: backpressure)
# A worker drops a feed not renewed for this long (service.token_feed's docstring: lifetime). Long against a replica
# loop's stall (a feed lost to one fails its requests as WorkerDied), short against pages held by a dead replica's
# requests.
LEASE_S = 30.0


def actor_key(handle) -> object:
    """Which actor a handle reaches (a group restart gives a worker id a new actor: a feed to the old one is stale)."""
    return getattr(handle, "_actor_id", None) or id(handle)


class FeedQueue:
    """One request's events from its worker's feed, read by the request's consumer (one task) with `get`."""

    def __init__(self, request_id: str, feed: TokenFeed, limit: int = QUEUE_LIMIT):
        self.request_id = request_id
        self.feed = feed
        self.limit = limit
        self._events: collections.deque = collections.deque()
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        # service.token_lane.TokenLane: set once the request's first token has passed every layer; a plain token is
        # then written to the client from here while the request's task waits for it (no wake-up, no layers)
        self.lane = None

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
        plain = event.token_id is not None and not event.finished and not event.prompt_logprobs
        if plain and self.take_plain(event.token_id, event.logprob):  # (a Ray feed's event; the TCP feed's rows go
            return  # to take_plain as their values)
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

    def take_plain(self, token_id: int, logprob: float | None) -> bool:
        """A plain decode token given as its values (service.tcp_feed reads them off the frame) written to the client
        by the request's lane if its task waits for it, so nothing is queued before it (-> True: taken, or the request
        failed with the lane's error); else False and nothing changed: the caller `put`s it as its event."""
        lane, waiter = self.lane, self._waiter
        if lane is None or waiter is None or waiter.done() or self._error is not None:
            return False
        try:
            return lane.take(token_id, logprob)
        except Exception as e:  # noqa: BLE001 - the request's error (a render bug, a client gone): raised in its task
            self.fail(e)
            return True

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
    """One worker's feed to this replica, the parts every transport shares; create inside the loop that reads it."""

    transport = ""

    def __init__(self, worker_id: str, actor_key: object, lease_s: float = LEASE_S, idle_s: float = 300.0):
        self.worker_id = worker_id
        self.actor_key = actor_key
        self.lease_s = lease_s
        self.feed_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.queues: dict[str, FeedQueue] = {}
        self.last_used = time.monotonic()  # when its last request left (lifetime)
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future = loop.create_future()
        self.ended = False
        self.keeper = loop.create_task(self._keep(lease_s, idle_s))

    def deliver(self, events) -> None:
        """A burst's events to their requests' queues (one that left meanwhile: dropped)."""
        queues = self.queues
        for event in events:
            queue = queues.get(event.request_id)
            if queue is not None:
                queue.put(event)

    def can_open(self) -> bool:
        """May a request's decode be opened over this feed (`open_decode`) now? Only a TCP feed whose connection is
        up can (service.tcp_feed); else the request opens with the `decode` Ray call."""
        return False

    async def open_decode(self, result, prompt: list[int], params):
        """Open the request's decode on the worker over this feed -> its Transferred (service.tcp_feed)."""
        raise NotImplementedError

    async def renew(self) -> None:
        """Tell the worker this replica still reads the feed (its lease starts again)."""
        raise NotImplementedError

    def _stop(self) -> None:
        """Stop reading and end the worker's side (it drops the requests still on the feed)."""
        raise NotImplementedError

    def tasks(self) -> list[asyncio.Task]:
        """The feed's tasks, to await after `close`."""
        return [self.keeper]

    async def _keep(self, lease_s: float, idle_s: float) -> None:
        """Renew the feed's lease on the worker until it ends; close it once idle for `idle_s`."""
        with contextlib.suppress(Exception):  # its failure is the subscribers' to see; shielded: cancelling the
            await asyncio.shield(self.opened)  # keeper (close) must not cancel what they wait on
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
                await self.renew()
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
        """Stop reading and renewing and end the worker's side: the worker drops the requests still on it."""
        if self.keeper is not asyncio.current_task():
            self.keeper.cancel()
        self._stop()
