"""The ingress replica's side of the place links: each request's `Place` on a router replica as a frame on a TCP
connection that router opened to this replica's token feed listener, instead of a gRPC call (router.place_link has
the router's side, the frames and the why).

`PlaceLinks.ready(i, actor)`: the link to router replica i if it is up, else None (the caller makes the gRPC call)
after starting to open one: the router's actor is asked through Ray (`open_place_link(link_id, host, port, key)`)
to call back, and its HELLO (the cluster token and the key made here, as a worker's: service.tcp_feed) claims the
link on the listener, whose protocol then hands the link its frames on this replica's loop. A request never waits
for a link: the first ones to a router go over gRPC while it opens.

gRPC stays the fallback: no link up yet, a router of an older release (no `open_place_link`, or a reply that does
not name PLACE: remembered, never asked again), no listener (DSV4_TOKEN_FEED=0 or DSV4_TOKEN_FEED_TRANSPORT=ray),
DSV4_PLACE_LINK=0, and for REOPEN_S after a link ended (the router died, or it could not call back).

`PlaceLink.place` answers as `AsyncRouterClient.place` does: the router's refusal as RouterError with its code and
message; the connection's end before the answer as RouterError UNAVAILABLE (what a gRPC call to a dead router gives:
service.direct_path's RouterSet then places on another router replica, exactly as after a failed gRPC call); no
answer within the timeout as DEADLINE_EXCEEDED; the caller cancelled (its client left) -> a CANCEL frame behind the
PLACE, so the router stops waiting for a slot for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
import uuid

import grpc

from engine.runtime.frames import FrameError
from router import place_link as wire
from router.client import PlacedRequest, RouterError, placed_from
from router.protos import pb2
from service.tcp_feed import CALLBACK_TIMEOUT_S, CalledBack, FeedListener

log = logging.getLogger(__name__)
REOPEN_S = 5.0  # after a link ended, the next try waits this long (each try is a Ray call to the router's actor)
LOST = "the router's place link closed"  # not one of a router's own UNAVAILABLE verdicts: the call fails over
_STATUS = {sc.value[0]: sc for sc in grpc.StatusCode}


class PlaceLink(CalledBack):
    """One connection to one router replica (a service.tcp_feed.Link of the listener)."""

    def __init__(self, index: int, actor, listener: FeedListener):
        self.worker_id = f"router-{index}"  # what the listener's logs name
        self.feed_id = f"r{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the id its HELLO names
        self.key = secrets.token_urlsafe(24)
        self.ended = False
        self.ended_at = 0.0  # monotonic
        self.older = False  # the router takes no PLACE frame (an older release): never ask it again
        self.calls_sent = 0  # PLACE frames written (tests, benchmarks: how many placements took this path)
        self._listener = listener
        self._conn: asyncio.Transport | None = None
        self._seq = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}  # seq -> the answer awaited
        loop = asyncio.get_running_loop()
        self._attached: asyncio.Future = loop.create_future()
        self.opener = loop.create_task(self._open(actor))

    async def _open(self, actor) -> None:
        """Ask the router to call back, then wait for its HELLO; any failure ends the link (requests keep gRPC)."""
        listener = self._listener
        try:
            try:
                method = actor.open_place_link
            except AttributeError:  # a router of a release before links
                self.older = True
                return self.end(RouterError(grpc.StatusCode.UNAVAILABLE, LOST))
            await listener.start()  # the first time only (later calls return at once)
            listener.expect(self)
            takes = await method.remote(self.feed_id, listener.host, listener.port, self.key)
            if not (isinstance(takes, (tuple, list)) and wire.PLACE in takes):
                self.older = True
                return self.close()
            await asyncio.wait_for(asyncio.shield(self._attached), CALLBACK_TIMEOUT_S)
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception as e:  # noqa: BLE001 - any (a dead actor, no call back in time): gRPC stays the path
            log.info("place link to %s did not open: %r", self.worker_id, e)
            self.close()

    def usable(self) -> bool:
        conn = self._conn
        return not self.ended and conn is not None and not conn.is_closing()

    async def place(self, request: pb2.PlaceRequest, timeout_s: float) -> PlacedRequest:
        """`Place` on this link's router (`usable` first) -> where it placed the request; raises what
        AsyncRouterClient.place would (module docstring)."""
        conn = self._conn
        assert conn is not None
        seq = next(self._seq)
        loop = asyncio.get_running_loop()
        answer = self._calls[seq] = loop.create_future()
        expiry = loop.call_later(timeout_s, self._expire, seq)
        try:
            conn.write(wire.place(seq, request.SerializeToString()))
            self.calls_sent += 1
            return placed_from(pb2.PlaceResponse.FromString(await answer))
        except BaseException:
            if self._calls.get(seq) is answer:  # the caller left (an expired or answered call was popped)
                self._cancel(seq)
            raise
        finally:
            expiry.cancel()
            self._calls.pop(seq, None)

    def _expire(self, seq: int) -> None:
        answer = self._calls.pop(seq, None)
        if answer is not None and not answer.done():
            answer.set_exception(RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._cancel(seq)

    def _cancel(self, seq: int) -> None:
        conn = self._conn
        if conn is not None and not conn.is_closing():
            conn.write(wire.cancel(seq))

    def settle(self, request_ids: list[str]) -> None:
        """`Settle` for these placements (`usable` first): one frame, no answer."""
        assert self._conn is not None
        self._conn.write(wire.settle(request_ids))

    def take(self, f: list) -> None:
        """One frame from the router after its HELLO (FrameError for any other kind: the listener resets it)."""
        kind = f[0]
        if kind == wire.PLACED and len(f) == 3 and isinstance(f[2], bytes):
            outcome: bytes | RouterError = f[2]
        elif kind == wire.REFUSED and len(f) == 4 and isinstance(f[2], int) and isinstance(f[3], str):
            outcome = RouterError(_STATUS.get(f[2], grpc.StatusCode.UNKNOWN), f[3])
        else:
            raise FrameError(f"a {kind!r} frame from router link {self.feed_id} that it does not take")
        if not isinstance(f[1], int):
            raise FrameError("an answer without its seq")
        answer = self._calls.pop(f[1], None)
        if answer is None or answer.done():  # its caller left meanwhile
            return
        if isinstance(outcome, RouterError):
            answer.set_exception(outcome)
        else:
            answer.set_result(outcome)

    def end(self, error: BaseException) -> None:
        """The connection is gone (or never came): every call in flight fails over as from a dead router."""
        if not self.ended:
            self.ended, self.ended_at = True, time.monotonic()
        calls, self._calls = self._calls, {}
        lost = RouterError(grpc.StatusCode.UNAVAILABLE, f"{LOST} ({error})")
        for answer in calls.values():
            if not answer.done():
                answer.set_exception(lost)

    def close(self) -> None:
        self._listener.forget(self)
        if self.opener is not asyncio.current_task():
            self.opener.cancel()
        if self._conn is not None:
            self._conn.close()  # the router sees the close and cancels the placements still running
        self.end(RuntimeError("this replica closed it"))


class PlaceLinks:
    """This replica's place links, one a router replica (by its index); create inside the loop that reads them."""

    def __init__(self, listener: FeedListener):
        self.listener = listener
        self._links: dict[int, PlaceLink] = {}

    def ready(self, index: int, actor) -> PlaceLink | None:
        """The link to use for a Place on router `index` now, or None (the gRPC call): one is opened if there is
        none, or the one there ended REOPEN_S ago; a router that took none is not asked again."""
        link = self._links.get(index)
        if link is not None and link.ended and not link.older and time.monotonic() - link.ended_at >= REOPEN_S:
            link = None
        if link is None:
            self._links[index] = PlaceLink(index, actor, self.listener)
            return None
        return link if link.usable() else None

    def up(self, index: int) -> PlaceLink | None:
        """The link to router `index` if it is up now (none is opened: a settle goes by gRPC meanwhile)."""
        link = self._links.get(index)
        return link if link is not None and link.usable() else None

    def calls_sent(self) -> int:
        """PLACE frames written on the links open now (tests, benchmarks)."""
        return sum(link.calls_sent for link in self._links.values())

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        await asyncio.gather(*(link.opener for link in links), return_exceptions=True)
