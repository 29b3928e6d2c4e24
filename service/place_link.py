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
DSV4_PLACE_LINK=0, and for REOPEN_S (service.callback_link) after a link ended (the router died, or it could not call back).

`PlaceLink.place` answers as `AsyncRouterClient.place` does: the router's refusal as RouterError with its code and
message; the connection's end before the answer as RouterError UNAVAILABLE (what a gRPC call to a dead router gives:
service.direct_path's RouterSet then places on another router replica, exactly as after a failed gRPC call); no
answer within the timeout as DEADLINE_EXCEEDED; the caller cancelled (its client left) -> a CANCEL frame behind the
PLACE, so the router stops waiting for a slot for it.
"""

from __future__ import annotations

import asyncio

import grpc

from engine.runtime.frames import FrameError
from router import place_link as wire
from router.client import PlacedRequest, RouterError, placed_from
from router.protos import pb2
from service.callback_link import CallbackLink, LinkSet
from service.tcp_feed import FeedListener, resolve

LOST = "the router's place link closed"  # not one of a router's own UNAVAILABLE verdicts: the call fails over
_STATUS = {sc.value[0]: sc for sc in grpc.StatusCode}


class PlaceLink(CallbackLink):
    """One connection to one router replica (a service.tcp_feed.Link of the listener)."""

    NAME = "place link"
    ID_PREFIX = "r"
    SENDS = wire.PLACE

    def __init__(self, index: int, actor, listener: FeedListener):
        super().__init__(f"router-{index}", actor, listener)

    def _method(self, actor):
        return actor.open_place_link

    def _older(self) -> BaseException:
        return RouterError(grpc.StatusCode.UNAVAILABLE, LOST)

    def _closed(self) -> BaseException:
        return RuntimeError("this replica closed it")

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
        if answer is not None:  # (None: its caller left meanwhile)
            resolve(answer, outcome)

    def end(self, error: BaseException) -> None:
        """The connection is gone (or never came): every call in flight fails over as from a dead router."""
        lost = RouterError(grpc.StatusCode.UNAVAILABLE, f"{LOST} ({error})")
        for answer in self._ended().values():
            if not answer.done():
                answer.set_exception(lost)


class PlaceLinks(LinkSet[PlaceLink]):
    """This replica's place links, one a router replica (by its index); create inside the loop that reads them."""

    def ready(self, index: int, actor) -> PlaceLink | None:
        """The link to use for a Place on router `index` now, or None (the gRPC call): one is opened if there is
        none, or the one there ended REOPEN_S ago; a router that took none is not asked again."""
        link = self._current(index)
        if link is None:
            self._links[index] = PlaceLink(index, actor, self.listener)
            return None
        return link if link.usable() else None

    def up(self, index: int) -> PlaceLink | None:
        """The link to router `index` if it is up now (none is opened: a settle goes by gRPC meanwhile)."""
        link = self._links.get(index)
        return link if link is not None and link.usable() else None
