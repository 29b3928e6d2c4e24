"""Requests opened over a TCP token feed's own connection (decode_worker.feed_wire's OPEN frame), the worker's side.

Why: with the token feed, a request still cost its ingress replica two Ray actor calls before its first token (the
prefill worker's `prefill`, then the decode worker's `decode` streaming call, which carries only `Transferred` once
the feed carries the tokens). A Ray call is a task submission, an object-store reply and a hop from Ray's thread to
the replica's loop; a py-spy of the replica under load put the run up to the first token at ~27% of its busy loop.
The decode call goes to the very worker whose feed connection the replica already reads on its loop, so the replica
sends the request as one frame there, and the worker answers on the same connection (OPENED or REFUSED).

What the worker does with an OPEN is exactly its `decode` method with `feed=` that feed (the `decode` callable given
here: same validation, same reservation and DecodeOverloaded, same pull, same join, same errors), driven from this
module instead of from Ray: its first item (`Transferred`) or its error is the reply, then the rest of the call (the
join; a failure there reaches the replica on the feed as a RequestFailed, as with Ray) runs to its end.

Who frees what: an open is one task a request. A CANCEL for it (the replica's client left while it waited)
cancels that task, which closes `decode` where it is, as Ray's cancellation of a `decode` call does (its own
`finally` frees the reservation, the pull's staging, the slot), then aborts the request once the task is over (a
reservation whose engine-thread call ran although its wait was cancelled is dropped by that abort, queued behind
it); a CANCEL for an open already over aborts the request (`abort`). The connection's end does the same to every
open still in flight, and the feed's own end drops the requests that joined it (decode_worker.tcp_feed). The replica's fire-and-forget Ray `abort` stays as it was: the CANCEL is what
reaches the worker in order behind the OPEN (a Ray abort may overtake it and find nothing yet).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from decode_worker import feed_wire
from engine.handoff import Transferred

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Opener:
    """What a worker gives its TCP feeds to open requests: `decode(result, prompt, params, feed_id)` -> the
    worker's `decode` call's generator (routed to that feed); `abort(request_id)` (sync or async) drops one."""

    decode: Callable[..., AsyncGenerator]
    abort: Callable[[str], object]


class FeedOpens:
    """The opens of one feed connection: a task each, answered with a frame written on `write`."""

    def __init__(self, feed_id: str, opener: Opener, write: Callable[[bytes], None]):
        self.feed_id = feed_id
        self.opener = opener
        self.write = write
        self._running: dict[int, tuple[asyncio.Task, str]] = {}  # seq -> its open's task and request id, until
        # its reply went out
        self._done: set[asyncio.Future] = set()  # after its reply: the join's end (held: a bare task may be collected)

    def open(self, payload: list) -> None:
        """An OPEN frame (FrameError if it is not one: the caller ends the connection)."""
        if len(payload) < 2 or not isinstance(payload[1], int):
            raise feed_wire.FrameError("an open frame without its seq")
        seq = payload[1]
        try:
            req = feed_wire.opened_request(payload)
        except ValueError as e:  # the request's values, not the stream: refuse it alone, as Ray would its call
            self.write(feed_wire.refused(seq, e))
            return
        gen = self.opener.decode(req.result, req.prompt, req.params, self.feed_id)
        task = asyncio.get_running_loop().create_task(self._run(seq, gen))
        self._running[seq] = (task, req.result.request_id)

    async def _run(self, seq: int, gen: AsyncGenerator) -> None:
        try:
            try:
                first = await anext(gen)
            except StopAsyncIteration:
                self.write(feed_wire.refused(seq, RuntimeError("its decode call ended before the transfer")))
                return
            except asyncio.CancelledError:
                return  # CANCEL: the replica waits for nothing; `decode`'s finally freed what it held
            except Exception as e:  # noqa: BLE001 - the worker's error is the reply (feed_wire.REFUSALS)
                self.write(feed_wire.refused(seq, e))
                return
            if not isinstance(first, Transferred):
                self.write(feed_wire.refused(seq, RuntimeError(f"its decode call gave {type(first).__name__} first")))
                await gen.aclose()
                return
            self.write(feed_wire.opened(seq, first))
            running = self._running.pop(seq, None)
            if running is not None:
                self._hold(running[0])
            try:  # the join: `decode` routes its failure to the feed (a RequestFailed) and ends
                async for _ in gen:
                    pass
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - already on the feed
                log.debug("token feed %s: request %s did not join: %r", self.feed_id, first.request_id, e)
        finally:
            self._running.pop(seq, None)

    def _hold(self, task: asyncio.Future) -> None:
        self._done.add(task)
        task.add_done_callback(self._done.discard)

    def _abort(self, rid: str) -> None:
        done = self.opener.abort(rid)
        if inspect.isawaitable(done):
            self._hold(asyncio.ensure_future(done))

    def _cancel(self, task: asyncio.Task, rid: str) -> None:
        """Cancel an open in flight, then abort its request once the task is over: a cancelled wait on the engine
        thread (the reservation's call) may still have run there, and the abort, queued behind it, undoes it."""
        task.cancel()
        task.add_done_callback(lambda _: self._abort(rid))

    def cancel(self, payload: list) -> None:
        """A CANCEL frame: cancel the open still in flight, else abort its request."""
        try:
            seq, rid = payload[1], payload[2]
        except IndexError:
            raise feed_wire.FrameError("a cancel frame that is not [x, seq, request_id]") from None
        running = self._running.pop(seq, None)
        if running is not None:
            self._cancel(*running)
        elif isinstance(rid, str):
            self._abort(rid)

    def close(self) -> None:
        """The connection ended: every open still in flight is cancelled and its request aborted (the feed drops
        those that joined)."""
        running, self._running = self._running, {}
        for task, rid in running.values():
            self._cancel(task, rid)
