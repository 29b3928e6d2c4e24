"""The ingress replica's side of the token feeds: one feed per decode worker carrying the tokens of every request this
replica runs there (decode_worker.token_feed has the worker's side and the why: one item an engine step for all of
them, instead of one a request). What carries a feed (DSV4_TOKEN_FEED_TRANSPORT): a TCP connection the worker opens
back to this replica's listener (service.tcp_feed, the default: the Ray hop was most of the token path's tail), or one
Ray streaming call (`RayTokenFeed`, here); the queues and the rules below are the same for both (service.feed_base).

`TokenFeeds.subscribe(worker_id, handle, request_id)` opens that worker's feed on first need (and again after one
ended) and registers the request before its `decode` call names the feed, so none of its events can be missed; the
`FeedQueue` it returns is what the request's consumer (service.ray_stream.RayStreamer.run_placement) reads in place of
a stream of its own. One reader task a feed takes each item off Ray (service.ray_items.next_item) and hands its events
to the requests' queues: one wake-up of a request's consumer an item, however many of its events the item holds.

Failures: the feed's call or connection ending (the worker died -> `WorkerDied`; its engine failed -> `WorkerDied`; any other end,
even a clean one -> `WorkerDied`) fails every request on it, each after the events it already got, and the feed is
forgotten (the next request opens a new one); the request's owner then retries or migrates it (router.migration).
A request whose join failed on the worker (`RequestFailed`) fails alone, with the worker's error.
Lifetime: a feed's keeper task renews the feed's lease on the worker every third of `lease_s` (the worker ends a feed
not renewed for `lease_s`: how a dead replica's Ray feed leaves the worker, decode_worker.token_feed; a TCP feed's
worker also sees the connection close), and closes the feed
once it has carried no request for `idle_s` (DSV4_TOKEN_FEED_IDLE_S); the next request opens a new one.
Backpressure: the reader never waits on a request, so a slow one never holds back another's tokens. A queue holds at
most `limit` undelivered events (more than any request produces unless its consumer stopped reading: a client that
does not read its response while Serve's buffers are full); one that overflows drops them and fails its request alone
with RESOURCE_EXHAUSTED (the consumer's `finally` aborts it on the worker, freeing its pages), the feed goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import ray

from dsv4_kernels.settings import settings
from router.dispatch import WorkerDied
from service.feed_base import LEASE_S, QUEUE_LIMIT, FeedQueue, TokenFeed, actor_key
from service.ray_items import DEAD, END, failure, next_item
from service.tcp_feed import FeedListener, TcpTokenFeed

log = logging.getLogger(__name__)
__all__ = ["LEASE_S", "QUEUE_LIMIT", "FeedQueue", "RayTokenFeed", "TokenFeed", "TokenFeeds"]


class RayTokenFeed(TokenFeed):
    """A feed over one Ray streaming call (`DecodeWorker.token_feed`) and its reader task."""

    transport = "ray"

    def __init__(self, worker_id: str, handle, actor_key: object, lease_s: float = LEASE_S, idle_s: float = 300.0):
        super().__init__(worker_id, actor_key, lease_s, idle_s)
        self._handle = handle
        call: object = handle.token_feed
        self._stream = call.options(num_returns="streaming").remote(self.feed_id, lease_s)  # type: ignore[attr-defined]
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        error: BaseException = WorkerDied(self.worker_id, "its token feed ended")
        try:
            first = await next_item(self._stream)
            if first is END:
                raise WorkerDied(self.worker_id, "its token feed ended before it opened")
            self.opened.set_result(None)
            while (item := await next_item(self._stream)) is not END:
                self.deliver(item)
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

    async def renew(self) -> None:
        await self._handle.renew_feed.remote(self.feed_id)

    def tasks(self) -> list[asyncio.Task]:
        return [self.keeper, self.reader]

    def _stop(self) -> None:
        self.reader.cancel()
        try:
            ray.cancel(self._stream)
        except Exception as e:  # noqa: BLE001 - best effort (a dead worker, a call already over)
            log.debug("cancelling the token feed of %s: %s", self.worker_id, e)


class TokenFeeds:
    """This replica's feeds, one a decode worker; create inside the loop that reads them."""

    def __init__(
        self,
        queue_limit: int = QUEUE_LIMIT,
        lease_s: float = LEASE_S,
        idle_s: float | None = None,
        *,
        transport: str | None = None,
        token: str | None = None,
        host: str | None = None,
        open_requests: bool | None = None,
    ):
        """idle_s: close a feed after this long without a request (None: DSV4_TOKEN_FEED_IDLE_S). transport: "tcp"
        or "ray" (None: DSV4_TOKEN_FEED_TRANSPORT). token: the cluster token a TCP feed's worker must present (the
        workers' `cluster_token`). host: where this replica's feed listener binds (None: the service's internal host,
        service.ray_cluster.internal_host; "node": this node's cluster address). open_requests: a TCP feed opens
        its requests' decode over its connection (None: DSV4_TOKEN_FEED_OPEN)."""
        self.queue_limit = queue_limit
        self.lease_s = lease_s
        self.idle_s = settings().token_feed_idle_s if idle_s is None else idle_s
        self.transport = settings().token_feed_transport if transport is None else transport
        if self.transport not in ("tcp", "ray"):
            raise ValueError(f"token feed transport {self.transport!r}: tcp or ray")
        self.open_requests = settings().token_feed_open if open_requests is None else open_requests
        self.listener = FeedListener(token or "", host) if self.transport == "tcp" else None
        self._feeds: dict[str, TokenFeed] = {}

    def _new_feed(self, worker_id: str, handle, key: object) -> TokenFeed:
        if self.listener is None:
            return RayTokenFeed(worker_id, handle, key, self.lease_s, self.idle_s)
        return TcpTokenFeed(worker_id, handle, key, self.listener, self.lease_s, self.idle_s, self.open_requests)

    async def subscribe(self, worker_id: str, handle, request_id: str) -> FeedQueue:
        """The request's queue on the worker's feed (opened now if there is none, or the one there ended or reaches
        another actor); WorkerDied when the feed cannot open (the worker is dead)."""
        feed = self._feeds.get(worker_id)
        key = actor_key(handle)
        if feed is None or feed.ended or feed.actor_key != key:
            if feed is not None:
                feed.close()
            if self.listener is not None:
                await self.listener.start()  # the first time only (later calls return at once)
                feed = self._feeds.get(worker_id)  # another request may have opened one meanwhile
            if feed is None or feed.ended or feed.actor_key != key:
                feed = self._feeds[worker_id] = self._new_feed(worker_id, handle, key)
        queue = feed.queues[request_id] = FeedQueue(request_id, feed, self.queue_limit)
        try:
            await asyncio.shield(feed.opened)
        except BaseException:
            queue.close()
            raise
        return queue

    def lost(self, worker_id: str, feed_id: str) -> None:
        """The worker has no such feed (its process restarted, or the feed ended there): close it and fail its
        requests now, so the next request opens a new one instead of waiting for its end to be reported."""
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
        tasks = [task for f in self._feeds.values() for task in f.tasks()]
        self._feeds.clear()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.listener is not None:
            self.listener.close()
