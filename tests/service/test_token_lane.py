"""service.token_lane with service.feed_base's queue and service.http_stream's SSEResponse on a real asyncio loop: a
plain token is written from the feed's receive path only while the request's task waits, everything else goes
through the queue, and the order of what the client gets holds either way (a write that waits on the client too)."""

from __future__ import annotations

import asyncio
import time

from engine.execution.request import TokenEvent
from service.feed_base import FeedQueue
from service.http_stream import SSEResponse
from service.token_lane import TokenLane


class _Feed:
    worker_id, feed_id = "d0", "f0"

    def __init__(self):
        self.queues: dict = {}
        self.last_used = time.monotonic()


def _tok(t: int, finished: bool = False) -> TokenEvent:
    return TokenEvent("r", t, None, finished, "length" if finished else None, ())


class _Watch:
    down = None


def _lane(sent: list, *, body_ok=lambda: True) -> TokenLane:
    lane = TokenLane()
    lane.watch = _Watch()
    lane.streamed = []
    lane.body = body_ok
    lane.render = lambda token_id, logprob: f"{token_id};".encode()

    class _Response:
        waiting = False

        def busy(self):
            return self.waiting

        def write_now(self, chunk):
            sent.append(chunk)

    lane.response = _Response()
    return lane


async def _parked(queue: FeedQueue, lane: TokenLane) -> asyncio.Task:
    """The request's task, parked in the queue's get as the SSE body parks in its wait."""

    async def reader():
        lane.parked = True
        try:
            return await queue.get()
        finally:
            lane.parked = False

    task = asyncio.ensure_future(reader())
    await asyncio.sleep(0)
    return task


def test_plain_tokens_of_a_parked_request_go_straight_out_and_a_finish_wakes_its_task():
    async def run():
        sent: list = []
        queue = FeedQueue("r", _Feed())
        queue.lane = lane = _lane(sent)
        task = await _parked(queue, lane)
        for t in (1, 2, 3):
            queue.put(_tok(t))
        assert not task.done() and sent == [b"1;", b"2;", b"3;"]
        queue.put(_tok(4, finished=True))  # a finish: the task's
        queue.put(_tok(5))  # after an event queued for the task: queued too (order)
        return sent, [e.token_id for e in await task]

    assert asyncio.run(run()) == ([b"1;", b"2;", b"3;"], [4, 5])


def test_tokens_go_to_the_queue_unless_every_part_lets_them_through():
    async def run(case):
        sent: list = []
        queue = FeedQueue("r", _Feed())
        lane = queue.lane = _lane(sent, body_ok=(lambda: case != "body"))
        if case == "down":
            lane.watch.down = "d0"
        if case == "busy":
            lane.response.waiting = True
        if case == "unrendered":
            lane.render = None
        if case == "not parked":
            task = asyncio.ensure_future(queue.get())
            await asyncio.sleep(0)
        else:
            task = await _parked(queue, lane)
            if case == "prompt logprobs":
                queue.put(TokenEvent("r", 1, None, False, None, (-0.5,)))
                return sent, [e.token_id for e in await task]
        queue.put(_tok(1))
        return sent, [e.token_id for e in await task]

    for case in ("down", "busy", "body", "unrendered", "not parked", "prompt logprobs"):
        assert asyncio.run(run(case)) == ([], [1]), case


def test_an_error_in_the_lane_fails_the_request_in_its_task():
    async def run():
        queue = FeedQueue("r", _Feed())
        lane = queue.lane = _lane([])

        def broken(token_id, logprob):
            raise ValueError("render bug")

        lane.render = broken
        task = await _parked(queue, lane)
        queue.put(_tok(1))
        try:
            await task
        except ValueError as e:
            return str(e)

    assert asyncio.run(run()) == "render bug"


def test_sse_response_writes_lane_chunks_between_its_own_and_waits_for_a_held_write():
    async def run():
        lane, wire, gate = TokenLane(), [], asyncio.Event()
        gate.set()

        async def send(msg):
            if msg["type"] == "http.response.body" and msg["body"] == b"slow":
                await gate.wait()  # the client reads slowly: uvicorn's flow control
            wire.append(msg.get("body", b"<start>"))

        async def receive():
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        body_go = asyncio.Event()

        async def body():
            yield b"first"
            await body_go.wait()  # the body waits for its next event; the lane writes meanwhile
            yield b"last"

        resp = SSEResponse(body(), media_type="text/event-stream", lane=lane)
        task = asyncio.ensure_future(resp({"type": "http"}, receive, send))
        await asyncio.sleep(0.01)
        assert lane.response is resp and not resp.busy()
        resp.write_now(b"fast")  # completes at once
        gate.clear()
        resp.write_now(b"slow")  # waits on the client: finished by a task of its own
        assert resp.busy()
        body_go.set()
        await asyncio.sleep(0.01)
        assert b"last" not in wire  # the body's next write waits for the held one
        gate.set()
        await task
        return wire, lane.response

    wire, left = asyncio.run(run())
    assert wire == [b"<start>", b"first", b"fast", b"slow", b"last", b""] and left is None
