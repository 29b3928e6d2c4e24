"""The ingress replica's side of the prefill links: each request's `prefill` call as a frame on a TCP connection the
prefill worker opened to this replica's token feed listener, instead of a Ray actor call (prefill_worker.prefill_link
has the worker's side and the why; prefill_worker.prefill_wire the frames).

`PrefillLinks.ready(worker_id, handle)`: the link to that worker if it is up, else None (the caller makes the Ray
call) after starting to open one: the worker is asked through Ray (`open_prefill_link(link_id, host, port, key)`)
to call back, and its HELLO (the cluster token and the key made here, as a token feed's: service.tcp_feed) claims
the link on the listener, whose protocol then hands the link its frames on this replica's loop. A request never
waits for a link: the first ones to a worker go through Ray while it opens.

The Ray call stays the fallback: no link up yet, a worker of an older release (no `open_prefill_link`, or a reply
that does not name PREFILL: remembered for that actor, never asked again), no listener (DSV4_TOKEN_FEED=0 or
DSV4_TOKEN_FEED_TRANSPORT=ray), DSV4_PREFILL_FEED=0, and for REOPEN_S (service.callback_link) after a link ended
(the worker died, or it could not call back).

`PrefillLink.prefill` raises what the Ray call's caller sees, unwrapped (service.ray_stream._prefill): REFUSED ->
the worker's error rebuilt as itself (prefill_wire.REFUSALS; a stopped engine loop -> the worker's WorkerDied, as
service.ray_items.failure maps it); the connection's end before the reply -> the worker's WorkerDied at once (what
a dead actor's call gives); the caller cancelled (its client left) -> a CANCEL frame behind the PREFILL, so the
worker drops the request even if the PREFILL is still on its way. A link ends with its connection (the worker died
or reset it); the next request to that worker opens a new one (and goes through Ray meanwhile).
A streamed hand-off's `prefill_streamed` goes the same way (`PrefillLink.stream`, a STREAM frame, to a worker whose
reply named it): its chunk tickets come back as CHUNK frames, read by service.prefill_feed as the Ray stream's items
are, and leaving sends the same CANCEL.
"""

from __future__ import annotations

import asyncio

from engine.handoff import PrefillResult, TransferTicket
from prefill_worker import prefill_wire
from router.dispatch import WorkerDied
from service.callback_link import CallbackLink, LinkSet
from service.feed_base import actor_key
from service.ray_items import failure
from service.tcp_feed import FeedListener, resolve


class PrefillLink(CallbackLink):
    """One connection to one prefill worker (a service.tcp_feed.Link of the listener)."""

    NAME = "prefill link"
    ID_PREFIX = "p"
    SENDS = prefill_wire.PREFILL

    def __init__(self, worker_id: str, handle, key: object, listener: FeedListener):
        self.actor_key = key
        self.streams = False  # the worker takes STREAM frames (its open_prefill_link reply named them)
        super().__init__(worker_id, handle, listener)

    def _method(self, handle):
        return handle.open_prefill_link

    def _older(self) -> BaseException:
        return WorkerDied(self.worker_id, "it takes no prefill link")

    def _closed(self) -> BaseException:
        return WorkerDied(self.worker_id, "this replica closed its prefill link")

    def _took(self, takes) -> None:
        self.streams = prefill_wire.STREAM in takes

    async def prefill(self, request_id: str, prompt: list[int], params, seed: int | None) -> PrefillResult:
        """The request's prefill on this link's worker (`usable` first) -> its PrefillResult; raises what the
        `prefill` Ray call's caller would see, unwrapped (module docstring)."""
        conn = self._conn
        assert conn is not None
        seq = next(self._seq)
        reply = self._calls[seq] = asyncio.get_running_loop().create_future()
        try:
            conn.write(prefill_wire.prefill(seq, request_id, prompt, params, seed))
            self.calls_sent += 1
            return await reply
        except asyncio.CancelledError:
            if not conn.is_closing():  # even after its reply: the worker then withdraws the export
                conn.write(prefill_wire.cancel(seq, request_id))
            raise
        finally:
            self._calls.pop(seq, None)

    def stream(self, request_id: str, prompt: list[int], params, seed: int | None) -> LinkStream:
        """The request's streamed prefill (`prefill_streamed`) on this link's worker (`usable` and `streams`
        first): its items as they come, what the Ray streaming call's reader sees (module docstring)."""
        conn = self._conn
        assert conn is not None
        seq = next(self._seq)
        items: asyncio.Queue = asyncio.Queue()
        self._calls[seq] = items
        conn.write(prefill_wire.prefill(seq, request_id, prompt, params, seed, streamed=True))
        self.calls_sent += 1
        return LinkStream(self, seq, request_id, items)

    def cancel(self, seq: int, request_id: str) -> None:
        """Stop waiting for call `seq`: a CANCEL behind it (the worker cancels it, or aborts its request)."""
        self._calls.pop(seq, None)
        conn = self._conn
        if conn is not None and not conn.is_closing():
            conn.write(prefill_wire.cancel(seq, request_id))

    def take(self, f: list) -> None:
        """One frame from the worker after its HELLO (FrameError for any other kind: the listener resets it)."""
        kind = f[0]
        outcome: PrefillResult | TransferTicket | BaseException
        if kind == prefill_wire.PREFILLED:
            seq, outcome = prefill_wire.result(f)
        elif kind == prefill_wire.CHUNK:
            seq, outcome = prefill_wire.chunk_ticket(f)
        elif kind == prefill_wire.REFUSED:
            seq, error = prefill_wire.refusal(f)
            outcome = failure(error, self.worker_id)
        else:
            raise prefill_wire.FrameError(f"a {kind!r} frame from prefill worker {self.worker_id}")
        reply = self._calls.get(seq)
        if reply is None:  # its caller left meanwhile (a cancelled stream's chunks still on their way too)
            return
        if isinstance(reply, asyncio.Queue):  # a STREAM call: every item in order, the last one ends it
            reply.put_nowait(outcome)
            if not isinstance(outcome, TransferTicket):
                del self._calls[seq]
            return
        if isinstance(outcome, TransferTicket):
            raise prefill_wire.FrameError(f"a chunk frame for call {seq}, which is not streamed")
        del self._calls[seq]
        resolve(reply, outcome)

    def end(self, error: BaseException) -> None:
        """The connection is gone (or never came): every call in flight gets `error` (the worker's death)."""
        for reply in self._ended().values():
            if isinstance(reply, asyncio.Queue):
                reply.put_nowait(error)
            elif not reply.done():
                reply.set_exception(error)


class LinkStream:
    """One STREAM call's items (chunk TransferTickets, then the PrefillResult) as `items()` yields them; `cancel`
    stops it (service.prefill_feed.PrefillFeed reads it as it reads a Ray streaming call)."""

    def __init__(self, link: PrefillLink, seq: int, request_id: str, queue: asyncio.Queue):
        self.link, self.seq, self.request_id = link, seq, request_id
        self._queue = queue
        self.done = False

    async def items(self):
        """The call's items in order; raises what ended it before its result (the worker's error, WorkerDied)."""
        while not self.done:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.done = True
                raise item
            self.done = isinstance(item, PrefillResult)
            yield item

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.link.cancel(self.seq, self.request_id)


class PrefillLinks(LinkSet[PrefillLink]):
    """This replica's prefill links, one a prefill worker; create inside the loop that reads them."""

    def ready(self, worker_id: str, handle) -> PrefillLink | None:
        """The link to use for a request to this worker now, or None (the Ray call): one is opened if there is
        none, or the one there reaches another actor, or ended REOPEN_S ago; a worker that took none is not asked
        again."""
        key = actor_key(handle)
        link = self._links.get(worker_id)
        if link is not None and link.actor_key != key:
            link.close()
            del self._links[worker_id]
        link = self._current(worker_id)
        if link is None:
            self._links[worker_id] = PrefillLink(worker_id, handle, key, self.listener)
            return None
        return link if link.usable() else None
