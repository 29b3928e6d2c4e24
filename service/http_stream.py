"""The HTTP side of one streamed or awaited request: an SSE response that writes its chunks from its own task (a plain
asyncio task watching for the client's disconnect beside it) and always closes its body generator (so the router
call under it is cancelled however the response ends), SSE framing, and waiting on work while watching for the
client to disconnect (`unless_disconnected` cancels the work and raises `ClientGone`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from service.body_writer import BodyWriter, body_writer


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class SSEResponse(StreamingResponse):
    """A streamed response written with one `send` a chunk from the response's own task, that always closes its body
    generator (so the router stream under it is cancelled however the response ends).

    Why not StreamingResponse's own `__call__`: under ASGI spec < 2.4 (uvicorn, so every replica) it runs the body in
    an anyio task group beside a disconnect listener, whose cancel scopes cost the replica's loop more per request than
    the request's HTTP intake (py-spy of `dsv4 bench frontdoor`, 64 streams). Here one plain asyncio task waits for the
    client's disconnect and cancels the streaming task; that cancellation ends the response quietly (the body's
    generator is closed, as Starlette's cancelled scope does), any other propagates. A write to a client already gone
    raises OSError under spec >= 2.4: ClientDisconnect, as Starlette.

    lane: the request's service.token_lane.TokenLane; once the head is out, its plain tokens are written by
    `write_now` from the token feed's receive path, between the body's own chunks (the lane takes one only while the
    body waits, so the order holds). Any body chunk, the lane's or the body's own, goes straight to the connection
    when the server offers a service.body_writer.BodyWriter and it can write it now, else through the ASGI send."""

    def __init__(self, *args, lane=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._lane = lane
        self._send = None
        self._direct: BodyWriter | None = None  # the server's body writer, once the head is out
        self._pending: asyncio.Task | None = None  # a write_now that waits on the client (flow control)

    def busy(self) -> bool:
        """Does a write_now still wait on the client (the next write must come after it)?"""
        return self._pending is not None and not self._pending.done()

    def write_now(self, chunk: bytes) -> None:
        """Send `chunk` from outside the response's task: the send's coroutine is run here up to its first wait;
        uvicorn's send has none unless the client reads slower than the replica writes (its flow control), then
        a task of its own finishes it and the response's next write waits for that."""
        if self._direct is not None and self._direct(chunk):  # (the lane checked busy(): a write a token)
            return
        assert self._send is not None and not self.busy()
        coro = self._send({"type": "http.response.body", "body": chunk, "more_body": True})
        try:
            waiting = coro.send(None)
        except StopIteration:
            return
        except OSError:
            raise ClientDisconnect() from None
        self._pending = asyncio.ensure_future(_resume(coro, waiting))

    async def __call__(self, scope, receive, send):
        body = self.body_iterator
        task = asyncio.current_task()
        assert task is not None, "an ASGI app runs in a task"
        cancelling = task.cancelling()
        left = asyncio.ensure_future(_disconnected(receive, task))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self._direct = body_writer(scope)
            if self._lane is not None:
                self._send = send
                self._lane.response = self
            async for chunk in body:
                data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)  # bytes: itself, not a copy
                if self._pending is not None:  # a lane's write waiting on the client goes first
                    await self._pending
                    self._pending = None
                if self._direct is None or not self._direct(data):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            if self._pending is not None:
                await self._pending
                self._pending = None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # ours (the client left), not another canceller's: the response just ends
            if not (left.done() and not left.cancelled() and task.uncancel() <= cancelling):
                raise
        except OSError:
            raise ClientDisconnect() from None
        finally:
            left.cancel()
            if self._lane is not None:
                self._lane.response = None
            if self._pending is not None:
                self._pending.cancel()
                self._pending.add_done_callback(_retrieved)
            if isinstance(body, AsyncGenerator):  # ours always is (an async generator function)
                await body.aclose()
        if self.background is not None:
            await self.background()


async def _resume(coro, waiting) -> None:
    """Run `coro` (a send started outside any task, suspended on `waiting`) to its end in this task: each future it
    waits on is awaited here, then it is resumed (or the exception thrown into it)."""
    while True:
        try:
            if waiting is None:  # a bare yield (asyncio.sleep(0))
                await asyncio.sleep(0)
            else:
                waiting._asyncio_future_blocking = False  # as a task takes a yielded future (else: "await wasn't used")
                await waiting
        except BaseException as e:  # noqa: BLE001 - thrown into the send (cancellation included), which decides
            try:
                waiting = coro.throw(e)
            except StopIteration:
                return
            continue
        try:
            waiting = coro.send(None)
        except StopIteration:
            return


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a write that failed after the response ended: nothing to tell (no "never retrieved")


async def _disconnected(receive, task: asyncio.Task) -> None:
    """Wait for the client's disconnect, then cancel `task` (the response's). A receive that fails (the server
    dropped the request) counts as the disconnect: the stream under the response must not outlive its client."""
    try:
        while (await receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.5)  # a server replaying other messages must not make this spin
    except Exception:  # noqa: BLE001 - see the docstring
        pass
    task.cancel()


def sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


async def wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (uvicorn blocks until then).
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.5)  # a server replaying other messages must not make this spin


async def unless_disconnected(request: Request, coro):
    """Await `coro`, cancelling it (and so the router call) if the client disconnects first."""
    task, watch = asyncio.ensure_future(coro), asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        if watch.done() and not watch.cancelled():
            raise ClientGone()
        # Cancelled from inside while the client still waits: an internal fault, never to pass for a disconnect
        raise RuntimeError("the request's work was cancelled while its client was still connected")
    return task.result()
