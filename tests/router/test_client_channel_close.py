"""AsyncRouterClient: a call in flight when its channel is closed (another request dropped the router replica) ends
in RouterError CANCELLED, never in a bare CancelledError, which the ingress would take for the client's own
disconnect (answering 499 to a client still waiting: CI stop 39); the caller's own cancellation still propagates."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from starlette.requests import Request

from router.client import AsyncRouterClient, RouterError
from router.protos import pb2_grpc
from service.http_stream import ClientGone, unless_disconnected


class SlowRouter(pb2_grpc.RouterServicer):
    async def Health(self, request, context):
        await asyncio.sleep(30)


async def _with_slow_router(body):
    server = grpc.aio.server()
    pb2_grpc.add_RouterServicer_to_server(SlowRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await body(f"127.0.0.1:{port}")
    finally:
        await server.stop(0)


def test_closed_channel_is_a_router_error_not_a_cancellation():
    async def body(addr):
        client = AsyncRouterClient(addr, timeout_s=20)
        call = asyncio.create_task(client.health())
        await asyncio.sleep(0.3)
        await client.close()
        with pytest.raises(RouterError) as e:
            await call
        assert e.value.code == grpc.StatusCode.CANCELLED and not call.cancelled()

    asyncio.run(_with_slow_router(body))


def test_callers_own_cancellation_still_propagates():
    async def body(addr):
        client = AsyncRouterClient(addr, timeout_s=20)
        call = asyncio.create_task(client.health())
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert call.cancelled()
        await client.close()

    asyncio.run(_with_slow_router(body))


def _request(messages: list[dict]) -> Request:
    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def test_unless_disconnected_tells_a_disconnect_from_an_inner_cancellation():
    async def cancelled_inside():
        await asyncio.sleep(0.05)
        raise asyncio.CancelledError()  # what a closed gRPC channel used to raise

    async def slow():
        await asyncio.sleep(30)

    async def main():
        with pytest.raises(RuntimeError, match="cancelled while its client was still connected"):
            await unless_disconnected(_request([]), cancelled_inside())
        with pytest.raises(ClientGone):
            await unless_disconnected(_request([{"type": "http.disconnect"}]), slow())
        assert await unless_disconnected(_request([]), asyncio.sleep(0.01, result=7)) == 7

    asyncio.run(main())
