"""The decode worker's side of a TCP token feed ("call-home", as Dynamo's decode worker streams to its frontend over a
TCP connection the frontend registered): the ingress replica listens, asks this worker over Ray to open a feed
(`DecodeWorker.open_tcp_feed`), and the worker connects to it and writes the feed's bursts as frames
(decode_worker.feed_wire) where the Ray feed yields them as items.

Why: a feed's Ray item costs its producer ~0.5 ms and its reader ~0.57 ms of CPU, and the hop from the worker's yield to
the replica's reader took p50 1.2 ms, p99 4-6 ms on the 2-core bench machine (BENCHMARKS.md, section frontdoor's
reading): most of the goal of < 5 ms added a token. A frame written to a socket the replica's event loop reads itself
(no Ray thread, no object store, no second hop to the loop) costs tens of microseconds at each end.

Everything above the wire is the Ray feed's (decode_worker.token_feed): the sink, one frame an engine step with all of
that replica's requests' events, who frees what. What differs is how the feed learns that it must end:
- the connection closes or resets (the replica's process died, or it closed the feed): the feed ends at once and its
  requests are dropped (pages freed), no lease to wait out (Ray never tells a streaming call's producer that its
  caller died);
- the replica stops reading while connected (a stalled loop): writes are never awaited, so neither the actor's loop
  nor the engine thread ever waits on one replica, and other feeds go on; once more than `buffer_bytes` wait unsent
  (DSV4_TOKEN_FEED_BUFFER_BYTES, past the kernel's SEND_BUFFER_BYTES), the feed ends (overflow): the connection is
  reset, its requests are dropped and fail on the replica as WorkerDied (retried or migrated), as after any end;
- the replica stops renewing (RENEW frames on the same connection, every third of the lease): the lease ends the
  feed, as with Ray (a replica whose loop stalls with its socket open);
- the engine fails, or the lease runs out: an END frame naming why, then the close.
The peer this worker connects to is the one the replica named through Ray (as trusted as the call itself); what it
sends back is RENEW frames and, with an `Opener`, the requests it opens over this connection (OPEN, CANCEL:
decode_worker.feed_opens); anything else resets the connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from decode_worker import feed_wire
from decode_worker.feed_opens import FeedOpens, Opener
from decode_worker.token_feed import Batch, Feed, Feeds
from engine.runtime import frames

log = logging.getLogger(__name__)
SEND_BUFFER_BYTES = 256 << 10  # the kernel's send buffer (doubled by Linux): a token stream needs little
_RENEW_MAX = 64  # bytes of a frame from a replica that opens no request here (RENEW is 6)


class ReplicaGone(Exception):
    """The feed's connection closed or reset: its replica is gone or closed the feed."""

    def __init__(self, feed_id: str, why: str):
        super().__init__(f"token feed {feed_id!r}: {why}")


class _Link(frames.PeerLink):
    """The worker's end of a feed's connection: RENEW frames in, and OPEN / CANCEL with an opener; a close, a reset
    or anything else ends the feed (through its sink, so the writer task sees it in order with the events)."""

    name = "token feed"

    def __init__(self, feed: Feed, opener: Opener | None = None):
        # an OPEN carries a prompt: as large as a batch frame may be (the peer is the one Ray named, module docstring)
        super().__init__(feed.feed_id, feed_wire.Frames(limit=_RENEW_MAX if opener is None else feed_wire.FRAME_MAX))
        self.feed = feed
        self.opens = FeedOpens(feed.feed_id, opener, self._write) if opener is not None else None

    def take(self, f: list) -> None:
        kind = f[0]
        if kind == feed_wire.RENEW:
            self.feed.renewed = time.monotonic()
        elif kind == feed_wire.OPEN and self.opens is not None:
            self.opens.open(f)
        elif kind == feed_wire.CANCEL and self.opens is not None:
            self.opens.cancel(f)
        else:
            raise feed_wire.FrameError(f"a {kind!r} frame from the replica")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.opens is not None:
            self.opens.close()
        why = f"its connection was lost ({exc})" if exc else "its replica closed the connection"
        self.feed.sink.put(ReplicaGone(self.feed.feed_id, why))


class TcpFeed:
    """One open TCP feed: the worker's Feed and its connection."""

    def __init__(self, feed: Feed, transport: asyncio.Transport, buffer_bytes: int):
        self.feed = feed
        self.transport = transport
        self.buffer_bytes = buffer_bytes

    async def run(self, sent: Callable[[Batch], None]) -> BaseException | None:
        """Write the feed's bursts until it ends (`sent(batch)` after each burst went out: the caller counts tokens
        and pops the finished requests) -> why it ended. The caller then closes the feed on the worker (`Feeds.close`)
        and drops the requests left on it."""
        transport, why = self.transport, None
        try:
            while why is None:
                batch = await self.feed.next_batch()
                if batch.items and not transport.is_closing():
                    transport.write(feed_wire.batch(batch.items))
                sent(batch)
                why = batch.error
                if why is None and transport.get_write_buffer_size() > self.buffer_bytes:
                    why = OverflowError(
                        f"token feed {self.feed.feed_id!r}: its replica fell {self.buffer_bytes} bytes behind"
                    )
        except BaseException as e:  # cancelled (the actor is going away) or a bug: the feed ends either way
            why = e
            raise
        finally:
            if isinstance(why, OverflowError):
                log.warning("%s: the feed ends, its requests are dropped", why)
            else:
                log.info("token feed %s ended: %r", self.feed.feed_id, why)
            if isinstance(why, ReplicaGone) or transport.is_closing():
                pass
            elif isinstance(why, OverflowError) or not isinstance(why, Exception):
                transport.abort()  # nothing more can reach a replica that does not read
            else:  # the engine failed or the lease ran out: the replica gets why, after the events before it
                transport.write(feed_wire.end(f"{type(why).__name__}: {why}"))
                transport.close()  # sends what is buffered, then closes
        return why


async def connect(
    feeds: Feeds,
    feed_id: str,
    host: str,
    port: int,
    token: str,
    key: str,
    lease_s: float | None,
    buffer_bytes: int,
    opener: Opener | None = None,
) -> TcpFeed:
    """Open feed `feed_id` and call its replica back at host:port (HELLO first); -> the feed, to `run`. The feed is
    open (requests may join it) before the connection is: nothing is lost, its events wait in the sink. opener: how
    the replica's OPEN frames reach the worker's `decode` (None: the replica may only renew)."""
    loop = asyncio.get_running_loop()
    feed = feeds.open(feed_id, loop, lease_s)
    try:
        transport = await frames.call_back(
            host, port, lambda: _Link(feed, opener), feed_wire.hello(feed_id, token, key), SEND_BUFFER_BYTES
        )
    except BaseException:
        feeds.close(feed)
        raise
    return TcpFeed(feed, transport, buffer_bytes)


def start(
    feeds: Feeds,
    link: TcpFeed,
    sent: Callable[[Batch], None],
    drop: Callable[[list[str]], None],
    tasks: set[asyncio.Task],
) -> None:
    """Write the connected feed's bursts in a task of its own (held in `tasks` while it runs: a bare task may be
    collected); once the feed ends, however it ends, it is closed on the worker and `drop(request_ids)` gets the
    requests still routed to it."""

    async def write() -> None:
        try:
            await link.run(sent)
        finally:
            left = feeds.close(link.feed)
            if left:
                drop(left)

    task = asyncio.get_running_loop().create_task(write())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
