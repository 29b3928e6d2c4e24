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
    raises OSError under spec >= 2.4: ClientDisconnect, as Starlette."""

    async def __call__(self, scope, receive, send):
        body = self.body_iterator
        task = asyncio.current_task()
        assert task is not None, "an ASGI app runs in a task"
        cancelling = task.cancelling()
        left = asyncio.ensure_future(_disconnected(receive, task))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in body:
                if isinstance(chunk, str):
                    chunk = chunk.encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # ours (the client left), not another canceller's: the response just ends
            if not (left.done() and not left.cancelled() and task.uncancel() <= cancelling):
                raise
        except OSError:
            raise ClientDisconnect() from None
        finally:
            left.cancel()
            if isinstance(body, AsyncGenerator):  # ours always is (an async generator function)
                await body.aclose()
        if self.background is not None:
            await self.background()


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
