"""The ingress replica's side of a TCP token feed ("call-home": the decode worker connects to this replica and writes
the feed's bursts as frames; decode_worker.tcp_feed has the worker's side and the why: the Ray item hop was most of
the token path's tail).

`FeedListener`: one asyncio TCP listener a replica (`TokenFeeds` with DSV4_TOKEN_FEED_TRANSPORT=tcp), bound on the
service's internal host (service.ray_cluster.internal_host: loopback on one node, else this node's cluster address)
on an ephemeral port, started on the first feed. `TcpTokenFeed`: a feed whose worker was asked over Ray
(`open_tcp_feed(feed_id, host, port, key, lease_s)`) to call back; its frames are read by the listener's protocol
on this replica's event loop itself (no task, no thread hop) and handed to the requests' queues (`deliver`).

Who may feed: the first frame a connection sends must be a HELLO (decode_worker.feed_wire) within HELLO_TIMEOUT_S,
at most HELLO_MAX bytes, naming a feed this replica is waiting for with the cluster token (router.auth: what the
routers' callers carry; the workers have it as `cluster_token`) and the key this replica made for that feed and gave
the worker through Ray (random a feed: without a configured cluster token, still no one but that worker can claim
it). Anything else closes the connection unanswered, and nothing from it is decoded but that one bounded msgpack
frame of plain values: no pickle anywhere on this wire. A feed is claimed once.

Failures: the connection's end (EOF or reset: the worker's process died, it overflowed or its lease ran out) or an
END frame (its engine failed) fails every request on the feed as WorkerDied, as the Ray feed's end does; a worker
that does not call back within CALLBACK_TIMEOUT_S after its `open_tcp_feed` returned fails the feed's open the same
way. Closing the feed here closes the connection, and the worker drops the feed's requests at once.

The listener carries the prefill workers' links too (service.prefill_link: a prefill call over a connection the
prefill worker opens the same way): whatever a HELLO claims is a `Link`, which takes the connection's later frames.

Requests opened over the connection (`open_decode`, DSV4_TOKEN_FEED_OPEN; decode_worker.feed_opens has the why): an
OPEN frame in place of the `decode` Ray call, only once the worker's HELLO claimed the feed. Its reply maps to what
the Ray call gives: OPENED -> its `Transferred`; REFUSED -> the worker's error rebuilt as itself (decode_worker.
feed_wire.REFUSALS; a stopped engine loop -> the worker's WorkerDied, as service.ray_items.failure maps it); the
connection's end or an END frame before the reply -> the feed's WorkerDied (what a dead actor's call gives); the
caller cancelled -> a CANCEL frame behind the OPEN (the worker cancels the open, or aborts the request if it was
over), so a client that leaves while its open is in flight leaves nothing on the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
from typing import Protocol

from decode_worker import feed_wire
from engine.handoff import Transferred
from kv_transfer.node_address import node_address
from router.dispatch import WorkerDied
from service.feed_base import LEASE_S, TokenFeed
from service.ray_items import DEAD, failure

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 5.0  # a connection that has not proved itself by then is closed
CALLBACK_TIMEOUT_S = 10.0  # after the worker's open_tcp_feed returned (its HELLO already sent), for it to arrive


class Link(Protocol):
    """What a HELLO may claim on the listener: a TcpTokenFeed, or a prefill worker's link (service.prefill_link)."""

    feed_id: str  # the id its HELLO names
    key: str  # the key its HELLO must carry (made by this replica, given to the worker through Ray)
    worker_id: str

    def attach(self, conn: asyncio.Transport) -> None:
        """Its HELLO claimed it on `conn`."""

    def take(self, f: list) -> None:
        """One later frame of the connection (FrameError: the connection is closed)."""

    def end(self, error: BaseException) -> None:
        """The connection closed or reset: what its calls in flight get."""


def resolve(reply: asyncio.Future, outcome) -> None:
    """A call's answer from its peer into the caller's future: an exception is raised there, anything else returned;
    nothing when the caller left meanwhile (the future is done)."""
    if reply.done():
        return
    if isinstance(outcome, BaseException):
        reply.set_exception(outcome)
    else:
        reply.set_result(outcome)


class CalledBack:
    """A Link's wait for its worker's call: `attach` keeps the connection its HELLO claimed and sets `_attached`
    (created by the subclass with its loop); a link that ended meanwhile closes it at once."""

    ended: bool
    _conn: asyncio.Transport | None
    _attached: asyncio.Future

    def attach(self, conn: asyncio.Transport) -> None:
        self._conn = conn
        if not self._attached.done():
            self._attached.set_result(None)
        if self.ended:  # closed while the worker was calling back
            conn.close()


class FeedListener:
    """A replica's listener for its TCP token feeds; create inside the loop that reads them, `start` before use."""

    def __init__(self, token: str, host: str | None = None):
        """token: the cluster token a worker's HELLO must carry. host: where to bind (None: the service's internal
        host; "node": this node's cluster address)."""
        self._token = token.encode()
        self._bind = host
        self.host = ""
        self.port = 0
        self._expected: dict[str, Link] = {}  # feed id -> the feed (or link) waiting for its worker's call
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Future | None = None

    async def start(self) -> None:
        """Bind (the first call; concurrent callers share it, later ones return at once)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        try:
            await asyncio.shield(self._starting)
        except BaseException:
            if self._starting.done() and self._starting.exception() is not None:
                self._starting = None  # the next feed tries again
            raise

    async def _start(self) -> None:
        host = self._bind
        if host is None:
            from service.ray_cluster import internal_host

            host = await asyncio.to_thread(internal_host)  # asks Ray's GCS: not on the loop
        if host == "node":
            host = node_address()
        server = await asyncio.get_running_loop().create_server(lambda: _Peer(self), host, 0)
        self._server = server
        self.host, self.port = host, server.sockets[0].getsockname()[1]
        log.info("token feed listener on %s:%d", self.host, self.port)

    def expect(self, feed: Link) -> None:
        self._expected[feed.feed_id] = feed

    def forget(self, feed: Link) -> None:
        if self._expected.get(feed.feed_id) is feed:
            del self._expected[feed.feed_id]

    def claim(self, feed_id: str, token: str, key: str) -> Link | None:
        """The feed a HELLO names, if it is expected and the HELLO carries the cluster token and the feed's key."""
        feed = self._expected.get(feed_id)
        token_ok = hmac.compare_digest(token.encode(), self._token)
        key_ok = feed is not None and hmac.compare_digest(key.encode(), feed.key.encode())
        if feed is None or not (token_ok and key_ok):
            return None
        del self._expected[feed_id]
        return feed

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._starting = None


class _Peer(asyncio.Protocol):
    """One connection to the listener: a HELLO first (or it is closed), then the claimed feed's frames."""

    def __init__(self, listener: FeedListener):
        self.listener = listener
        self.frames = feed_wire.Frames(limit=feed_wire.HELLO_MAX)
        self.feed: Link | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        self._deadline = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._refuse, "sent no HELLO in time")

    def _refuse(self, why: str) -> None:
        log.warning("token feed listener: closed a connection from %s that %s", self.peer, why)
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        try:
            if self.feed is None:
                got = self.frames.feed(data, most=1)
                if not got:
                    return
                if not self._hello(got[0]):
                    return
                data = b""
            feed = self.feed
            assert feed is not None
            for f in self.frames.feed(data):
                feed.take(f)
        except feed_wire.FrameError as e:
            if self.feed is None:
                self._refuse(f"sent no valid HELLO ({e})")
            else:
                log.warning("token feed %s of %s: %s; closing it", self.feed.feed_id, self.feed.worker_id, e)
                assert self.transport is not None
                self.transport.abort()

    def _hello(self, f: list) -> bool:
        """-> whether the HELLO claimed a feed (else the connection is closed)."""
        if len(f) != 4 or f[0] != feed_wire.HELLO or not all(isinstance(x, str) for x in f[1:]):
            self._refuse("sent no valid HELLO")
            return False
        feed = self.listener.claim(f[1], f[2], f[3])
        if feed is None:
            self._refuse(f"named feed {f[1][:64]!r} without its token and key, or one not expected")
            return False
        if self._deadline is not None:
            self._deadline.cancel()
        self.frames.limit = feed_wire.FRAME_MAX
        self.feed = feed
        assert self.transport is not None
        feed.attach(self.transport)
        return True

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self.feed is not None:
            how = f"reset ({exc})" if exc else "closed"
            self.feed.end(WorkerDied(self.feed.worker_id, f"its token feed's connection was {how}"))


class TcpTokenFeed(CalledBack, TokenFeed):
    """A feed over a connection its worker opens to this replica's listener (module docstring)."""

    transport = "tcp"

    def __init__(
        self,
        worker_id: str,
        handle,
        actor_key: object,
        listener: FeedListener,
        lease_s: float = LEASE_S,
        idle_s: float = 300.0,
        open_requests: bool = True,
    ):
        """open_requests: open requests over the connection once it is up (`open_decode`; DSV4_TOKEN_FEED_OPEN)."""
        super().__init__(worker_id, actor_key, lease_s, idle_s)
        self.key = secrets.token_urlsafe(24)
        self.open_requests = open_requests
        self.opens_sent = 0  # OPEN frames written (tests, benchmarks: how many requests took this path)
        self._seq = itertools.count()
        self._opens: dict[int, asyncio.Future] = {}  # seq -> the reply awaited
        self._listener = listener
        self._conn: asyncio.Transport | None = None
        self.worker_opens = False  # the worker named OPEN in its open_tcp_feed reply (`_open`)
        loop = asyncio.get_running_loop()
        self._attached: asyncio.Future = loop.create_future()
        listener.expect(self)
        self.opener = loop.create_task(self._open(handle))

    async def _open(self, handle) -> None:
        """Ask the worker to call back, then wait for its HELLO; a failure ends the feed (its requests: WorkerDied)."""
        listener = self._listener
        error: BaseException
        try:
            takes = await handle.open_tcp_feed.remote(
                self.feed_id, listener.host, listener.port, self.key, self.lease_s
            )
            # a worker of an older release replies None: it takes no OPEN (feed_wire's "Versions")
            self.worker_opens = isinstance(takes, (tuple, list)) and feed_wire.OPEN in takes
            await asyncio.wait_for(asyncio.shield(self._attached), CALLBACK_TIMEOUT_S)
        except DEAD as e:
            error = WorkerDied(self.worker_id, str(e))
        except TimeoutError:
            error = WorkerDied(self.worker_id, f"its token feed did not call back within {CALLBACK_TIMEOUT_S} s")
        except Exception as e:  # noqa: BLE001 - the worker's error (RayTaskError: it could not connect, ...)
            error = failure(e, self.worker_id)
            if not isinstance(error, WorkerDied):
                log.warning("token feed of %s did not open: %r", self.worker_id, error)
                error = WorkerDied(self.worker_id, f"its token feed did not open: {error}")
        else:
            if not self.opened.done():
                self.opened.set_result(None)
            return
        self.end(error)  # first: its error, not close's, is what the requests get
        self.close()

    def take(self, f: list) -> None:
        """One frame from the worker after its HELLO (FrameError for one a feed does not carry: the listener closes
        the connection)."""
        kind = f[0]
        if kind == feed_wire.BATCH:
            self.deliver_rows(f[1] if len(f) > 1 else None)
        elif kind == feed_wire.OPENED:
            self.answer(*feed_wire.transferred(f))
        elif kind == feed_wire.REFUSED:
            seq, error = feed_wire.refusal(f)
            self.answer(seq, failure(error, self.worker_id))
        elif kind == feed_wire.END:
            self.end(WorkerDied(self.worker_id, f"its token feed ended: {f[1] if len(f) > 1 else '?'}"))
        else:
            raise feed_wire.FrameError(f"a {kind!r} frame from the worker")

    def deliver_rows(self, rows) -> None:
        """A BATCH frame's events as the frame holds them (feed_wire.batch's arrays), in order: a plain token whose
        request's lane takes it now goes to the client from its array (FeedQueue.take_plain: no event rebuilt, the
        frame's bulk at steady state); any other event is rebuilt and delivered as `deliver` does. A malformed
        array raises FrameError (the connection is closed: the feed's requests fail) after the ones before it."""
        if not isinstance(rows, list):
            raise feed_wire.FrameError(f"a batch frame carries {type(rows).__name__}, not a list of events")
        queues = self.queues
        try:
            for row in rows:
                queue = queues.get(row[0])
                if queue is None:
                    continue
                # a plain decode token (feed_wire.batch's TokenEvent array: [request id, token id, logprob,
                # finished, finish reason, prompt logprobs, cached tokens]; a RequestFailed's has 3)
                if len(row) == 7 and row[1] is not None and not row[3] and not row[5]:
                    if queue.take_plain(row[1], row[2]):
                        continue
                queue.put(feed_wire.event(row))
        except (TypeError, IndexError) as e:  # row[0] missing or unhashable; one not an array
            raise feed_wire.FrameError(f"a batch frame's event is malformed: {e}") from None

    def can_open(self) -> bool:
        conn = self._conn
        return (
            self.open_requests and self.worker_opens and not self.ended and conn is not None and not conn.is_closing()
        )

    async def open_decode(self, result, prompt: list[int], params) -> Transferred:
        """Open the request's decode on this feed's worker over the connection (`can_open` first) -> its
        Transferred; raises what the `decode` Ray call's caller would see, unwrapped (module docstring)."""
        conn = self._conn
        assert conn is not None
        seq = next(self._seq)
        reply = self._opens[seq] = asyncio.get_running_loop().create_future()
        try:
            conn.write(feed_wire.open_request(seq, result, prompt, params))
            self.opens_sent += 1
            return await reply
        except asyncio.CancelledError:
            if not conn.is_closing():  # even after its reply: the request may have joined meanwhile
                conn.write(feed_wire.cancel(seq, result.request_id))
            raise
        finally:
            self._opens.pop(seq, None)

    def answer(self, seq: int, outcome: Transferred | BaseException) -> None:
        """The worker's reply to an open (one whose caller left meanwhile: dropped)."""
        reply = self._opens.pop(seq, None)
        if reply is not None:
            resolve(reply, outcome)

    def end(self, error: BaseException) -> None:
        super().end(error)
        opens, self._opens = self._opens, {}
        for reply in opens.values():  # the connection is gone before their replies: the worker's death to them
            if not reply.done():
                reply.set_exception(error)

    async def renew(self) -> None:
        conn = self._conn
        if conn is not None and not conn.is_closing():
            conn.write(feed_wire.RENEW_FRAME)

    def tasks(self) -> list[asyncio.Task]:
        return [self.keeper, self.opener]

    def _stop(self) -> None:
        self._listener.forget(self)
        if self.opener is not asyncio.current_task():
            self.opener.cancel()
        if self._conn is not None:
            self._conn.close()  # the worker sees the connection close and drops the feed's requests
        else:  # a HELLO still on its way is closed when it claims the feed (attach)
            self.end(WorkerDied(self.worker_id, "this replica closed its token feed"))
