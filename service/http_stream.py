"""The HTTP side of one streamed or awaited request: an SSE response that always closes its body generator (so the
router call under it is cancelled however the response ends), SSE framing, and waiting on work while watching
for the client to disconnect (`unless_disconnected` cancels the work and raises `ClientGone`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import StreamingResponse


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class SSEResponse(StreamingResponse):
    """Closes the body generator however the response ends, so the router stream is always cancelled
    (servers speaking ASGI spec >= 2.4 end a disconnected stream with an exception at the next write)."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if isinstance(self.body_iterator, AsyncGenerator):  # ours always is (an async generator function)
                await self.body_iterator.aclose()


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
