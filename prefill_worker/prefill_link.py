"""A prefill worker's link to one ingress replica: the replica's `prefill` (and `prefill_streamed`) calls as frames on a TCP connection this
worker opens back to the replica's listener (service.prefill_link has the replica's side), in place of Ray calls.

Why: a `prefill` Ray actor call cost the ingress replica's event loop ~0.70 ms a request (a task submission, an
object-store reply and a hop from Ray's thread to the loop: BENCHMARKS.md, section frontdoor's reading), the largest
single share of its per-request work. The decode worker's token feed already showed the way (decode_worker.tcp_feed:
the replica listens, asks the worker through Ray to call back, the worker connects and says HELLO with the cluster
token and the key the replica gave it); a prefill link is the same call-home connection, opened once a (prefill
worker, replica) pair, carrying one PREFILL frame a request and its one reply (prefill_worker.prefill_wire).

What the worker does with a PREFILL is exactly its `prefill` method (the callable given here: same validation, same
queueing, same export, same errors) run as a task of the actor's loop: its PrefillResult or its error is the reply.
A STREAM is its `prefill_streamed` the same way: each chunk ticket goes out as a CHUNK frame as the generator yields
it, then the PrefillResult.

Who frees what: a CANCEL (the replica's client left while it waited) cancels the call's task, whose own cleanup drops
the request (PrefillWorker._prefill_items), then aborts the request once the task is over (an engine-thread call that
ran although its wait was cancelled is undone by that abort, queued behind it); a CANCEL for a call already answered
aborts its request (its export withdrawn). The connection's end (the replica died or closed the link) does the same to
every call still running: nobody will take their results. Answered calls' exports stay under their transfer lease,
as with Ray, and the replica's own fire-and-forget Ray `abort` is unchanged.
The peer is the one the replica named through Ray (as trusted as that call); anything it sends that is not a
PREFILL or CANCEL frame of this format resets the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from engine.handoff import TransferTicket
from engine.runtime import frames
from prefill_worker import prefill_wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prefiller:
    """What a worker gives its links: `prefill(request_id, prompt, params, seed)` -> its PrefillResult (sync or
    async: the worker's `prefill` method); `abort(request_id)` (sync or async) drops one; `prefill_streamed(...)`
    (the same arguments) -> its async generator of chunk tickets then the PrefillResult, None where the worker
    streams no hand-off (its link then names no STREAM)."""

    prefill: Callable[..., object]
    abort: Callable[[str], object]
    prefill_streamed: Callable[..., AsyncGenerator] | None = None


class _Link(frames.PeerLink):
    """The worker's end of one link: PREFILL / CANCEL frames in, a task a call, its reply out."""

    name = "prefill link"

    def __init__(self, link_id: str, prefiller: Prefiller):
        super().__init__(link_id, frames.Frames())  # a PREFILL carries a prompt: up to FRAME_MAX
        self.prefiller = prefiller
        self._running: dict[int, tuple[asyncio.Task, str]] = {}  # seq -> its call's task and request id
        self._held: set[asyncio.Future] = set()  # aborts in flight (held: a bare task may be collected)

    def take(self, f: list) -> None:
        kind = f[0]
        if kind == prefill_wire.PREFILL or (
            kind == prefill_wire.STREAM and self.prefiller.prefill_streamed is not None
        ):
            self._start(f)
        elif kind == prefill_wire.CANCEL:
            self._cancel(f)
        else:
            raise frames.FrameError(f"a {kind!r} frame from the replica")

    def _start(self, payload: list) -> None:
        if len(payload) < 2 or not isinstance(payload[1], int):
            raise frames.FrameError("a prefill frame without its seq")
        seq = payload[1]
        try:
            call = prefill_wire.prefill_call(payload)
        except ValueError as e:  # the call's values, not the stream: refuse it alone, as Ray would fail its call
            self._write(prefill_wire.refused(seq, e))
            return
        task = asyncio.get_running_loop().create_task(self._run(call))
        self._running[seq] = (task, call.request_id)

    async def _run(self, call: prefill_wire.PrefillCall) -> None:
        try:
            if call.streamed:
                result = await self._stream(call)
            else:
                result = self.prefiller.prefill(call.request_id, call.prompt, call.params, call.seed)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            return  # CANCEL or the connection's end: nobody waits; the prefill's own cleanup dropped the request
        except Exception as e:  # noqa: BLE001 - the worker's error is the reply (prefill_wire.REFUSALS)
            self._write(prefill_wire.refused(call.seq, e))
            return
        finally:
            self._running.pop(call.seq, None)
        self._write(prefill_wire.prefilled(call.seq, result))

    async def _stream(self, call: prefill_wire.PrefillCall) -> Any:
        """A STREAM call: each chunk ticket out as a CHUNK frame as it comes -> the PrefillResult (the generator's
        last item). Cancelled, the generator is closed where it waits: it drops the request and its chunks."""
        stream = self.prefiller.prefill_streamed
        assert stream is not None
        result = None
        async with contextlib.aclosing(stream(call.request_id, call.prompt, call.params, call.seed)) as items:
            async for item in items:
                if isinstance(item, TransferTicket):
                    self._write(prefill_wire.chunk(call.seq, item))
                else:
                    result = item
        if result is None:
            raise RuntimeError("its streamed prefill ended without a result")
        return result

    def _abort(self, rid: str) -> None:
        done = self.prefiller.abort(rid)
        if inspect.isawaitable(done):
            fut = asyncio.ensure_future(done)
            self._held.add(fut)
            fut.add_done_callback(self._held.discard)

    def _cancel(self, payload: list) -> None:
        """A CANCEL frame: cancel the call still running (then abort its request), else abort its request."""
        if len(payload) != 3 or not isinstance(payload[2], str):
            raise frames.FrameError("a cancel frame that is not [x, seq, request_id]")
        running = self._running.pop(payload[1], None)
        if running is not None:
            self._stop(*running)
        else:
            self._abort(payload[2])

    def _stop(self, task: asyncio.Task, rid: str) -> None:
        task.cancel()
        task.add_done_callback(lambda _: self._abort(rid))

    def connection_lost(self, exc: Exception | None) -> None:
        running, self._running = self._running, {}
        if running:
            log.info("prefill link %s lost (%r): %d calls cancelled", self.link_id, exc, len(running))
        for task, rid in running.values():
            self._stop(task, rid)


async def connect(link_id: str, host: str, port: int, token: str, key: str, prefiller: Prefiller) -> None:
    """Open link `link_id` to its replica at host:port (HELLO first); returns once connected. The connection then
    lives on this loop until either end closes it."""
    await frames.call_back(host, port, lambda: _Link(link_id, prefiller), frames.hello(link_id, token, key))
