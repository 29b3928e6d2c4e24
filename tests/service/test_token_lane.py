"""service.token_lane with service.feed_base's queue and service.http_stream's SSEResponse on a real asyncio loop: a
plain token is written from the feed's receive path only while the request's task waits, everything else goes
through the queue, and the order of what the client gets holds either way (a write that waits on the client too).
A TCP feed's frame (service.tcp_feed.deliver_rows): plain tokens taken from their arrays, the rest rebuilt as events
in order, a malformed array a FrameError; JobEvents.take_token fills the job as take of the same event does."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode_worker.feed_wire import FrameError
from engine.execution.request import TokenEvent
from engine.execution.sampling_params import SamplingParams
from router.client import StreamEvent
from service.feed_base import FeedQueue
from service.http_stream import SSEResponse
from service.openai_job import Job, JobEvents
from service.tcp_feed import TcpTokenFeed
from service.text_stream import TextStream
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


def _bare_feed(queues: dict) -> TcpTokenFeed:
    feed = TcpTokenFeed.__new__(TcpTokenFeed)  # its frames only: no listener, worker or loop tasks
    feed.worker_id, feed.feed_id, feed.queues, feed.last_used = "d0", "f0", queues, time.monotonic()
    return feed


def _row(rid: str, t: int | None, finished: bool = False, plps: list | None = None) -> list:
    """A TokenEvent as a BATCH frame carries it (decode_worker.feed_wire.batch)."""
    return [rid, t, -0.5, finished, "length" if finished else None, plps or [], 0]


def test_a_tcp_frame_s_plain_tokens_go_out_from_their_arrays_and_the_rest_as_events():
    async def run():
        queues: dict = {}
        feed = _bare_feed(queues)
        sent = {rid: [] for rid in "abc"}
        tasks = {}
        for rid in "abc":
            q = queues[rid] = FeedQueue(rid, feed)
            q.lane = _lane(sent[rid])
            tasks[rid] = await _parked(q, q.lane)
        feed.deliver_rows(
            [
                _row("a", 1),
                _row("b", 1),
                _row("gone", 9),  # a request that left: dropped
                _row("a", 2, finished=True),  # a finish: the task's
                _row("a", 3),  # behind it: queued too (order)
                _row("b", 2, plps=[-0.1]),  # prompt logprobs: the task's
                ["c", "engine went away", False],  # a RequestFailed: fails c alone
            ]
        )
        got = {rid: [(e.token_id, e.finished) for e in await tasks[rid]] for rid in "ab"}
        with pytest.raises(RuntimeError, match="engine went away"):
            await tasks["c"]
        queues["c"] = FeedQueue("c", feed)
        with pytest.raises(FrameError):
            feed.deliver_rows([_row("c", 1), 7])  # malformed after a good one: the good one is delivered first
        with pytest.raises(FrameError):
            feed.deliver_rows({"not": "a list"})
        return sent, got, [e.token_id for e in await queues["c"].get()]

    sent, got, c_events = asyncio.run(run())
    assert sent == {"a": [b"1;"], "b": [b"1;"], "c": []}
    assert got == {"a": [(2, True), (3, False)], "b": [(2, False)]}
    assert c_events == [1]


def test_take_token_fills_the_job_as_take_of_the_event_does():
    class _Hist:
        def __init__(self):
            self.n = 0

        def observe(self, amount, now=None):
            self.n += 1

    def job(params):
        return Job("r", [1, 2], params, TextStream(None, [], False, True), time.monotonic(), 1e18)

    for params in (SamplingParams(), SamplingParams(logprobs=1)):
        a, b = job(params), job(params)
        ta, tb = JobEvents(a, frozenset([0]), _Hist(), _Hist()), JobEvents(b, frozenset([0]), _Hist(), _Hist())
        for t in range(5, 12):
            lp = -0.25 * t if params.logprobs else None
            pa = ta.take(StreamEvent("r", t, lp, False, None, ()))
            pb = tb.take_token(t, lp)
            assert pa == pb
        fields = ("token_ids", "logprobs", "prompt_logprobs", "finish_reason", "stop_reason", "cached_tokens")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert (ta.ttft.n, ta.itl.n) == (tb.ttft.n, tb.itl.n) == (1, 6)
