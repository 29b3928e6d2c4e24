"""The TCP token feed's open frames (decode_worker.feed_wire: OPEN, OPENED, REFUSED, CANCEL), without Ray: every field
of a request round-trips exactly (a field added to PrefillResult, TransferTicket or SamplingParams that the codec does
not rebuild fails here), each error the Ray `decode` call's caller tells apart comes back as itself, and malformed or
invalid opens are refused (the request alone) or end the stream (a frame that is not an open)."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker import feed_wire
from decode_worker.feed_opens import FeedOpens, Opener
from decode_worker.token_feed import FeedUnknown
from engine.execution.sampling_params import SamplingParams
from engine.handoff import DecodeOverloaded, PeerUnknown, PrefillResult, Transferred, TransferTicket
from engine.runtime.loop_errors import LoopStopped, StepFailed
from kv_transfer.outcomes import PullCancelled, ReadInFlight, TransferError, TransferTimeout

TICKET = TransferTicket(
    source="p7",
    request_id="r-1",
    src_pages=(("attn", (3, 4, 9)), ("index", (1,))),
    num_tokens=123,
    fingerprint="fp-abc",
    staging=(4096, 65536),
    lease_expires_at=1.7e9 + 0.123456789,
    start_tokens=64,
    final=False,
    source_instance="inst-9",
)
RESULT = PrefillResult(
    request_id="r-1",
    worker_id="p7",
    first_token=42,
    first_logprob=-0.123456789012345,  # binary64 on the wire: exact
    prompt_logprobs=(None, -1.5, -2.25),
    seed=987654321,
    finished=False,
    finish_reason=None,
    ticket=TICKET,
    queue_time_s=0.001,
    prefill_time_s=0.25,
    incarnation="p7-1-2",
    cached_tokens=32,
)
PARAMS = SamplingParams(
    max_new_tokens=77,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=5,
    ignore_eos=True,
    logprobs=True,
    prompt_logprobs=True,
    stop_token_ids=(2, 3),
)


def _one(data: bytes) -> list:
    frames = feed_wire.Frames().feed(data)
    assert len(frames) == 1
    return frames[0]


@pytest.mark.parametrize("ticket", [TICKET, None], ids=["ticket", "no-ticket"])
def test_an_open_round_trips_every_field(ticket):
    result = RESULT if ticket is not None else PrefillResult(**{**RESULT.__dict__, "ticket": None})
    got = feed_wire.opened_request(_one(feed_wire.open_request(17, result, [5, 6, 7], PARAMS)))
    assert got.seq == 17 and got.prompt == [5, 6, 7]
    assert got.result == result and got.params == PARAMS
    if ticket is not None:  # rebuilt as the tuples the dataclass holds (hashable, comparable with the original's)
        assert got.result.ticket is not None and hash(got.result.ticket.src_pages) == hash(TICKET.src_pages)
        assert isinstance(got.result.ticket.staging, tuple)
    assert isinstance(got.params.stop_token_ids, tuple) and isinstance(got.result.prompt_logprobs, tuple)


def test_opened_round_trips_transferred():
    seq, done = feed_wire.transferred(
        _one(feed_wire.opened(3, Transferred(request_id="r-1", num_bytes=1 << 40, seconds=0.0123)))
    )
    assert seq == 3 and done == Transferred(request_id="r-1", num_bytes=1 << 40, seconds=0.0123)


@pytest.mark.parametrize(
    "error",
    [
        DecodeOverloaded("decode worker d0 has no room for r-1: no batch slot"),
        PeerUnknown("p7", "d0"),
        FeedUnknown("feed-1", "d0"),
        ReadInFlight("READ still in flight", "r-1"),
        TransferTimeout("pull timed out"),
        PullCancelled("cancelled"),
        TransferError("pull failed"),
        StepFailed("step raised"),
        LoopStopped("loop stopped"),
        ValueError("request r-1 finished at prefill"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_refusal_comes_back_as_the_error_the_worker_raised(error):
    seq, got = feed_wire.refusal(_one(feed_wire.refused(9, error)))
    assert seq == 9 and type(got) is type(error) and str(got) == str(error)
    assert got.__reduce__()[1:] == error.__reduce__()[1:]  # the same constructor arguments as Ray would carry


def test_an_unknown_error_is_a_runtime_error_naming_its_type():
    class Odd(Exception):
        pass

    _, got = feed_wire.refusal(_one(feed_wire.refused(1, Odd("strange"))))
    assert type(got) is RuntimeError and str(got) == "Odd: strange"


def test_a_refusal_with_a_kind_it_does_not_know_is_a_runtime_error():
    _, got = feed_wire.refusal([feed_wire.REFUSED, 1, "no-such-kind", ["why"]])
    assert type(got) is RuntimeError


def test_malformed_replies_are_frame_errors():
    for bad in ([feed_wire.OPENED, 1], [feed_wire.OPENED, 1, [1, 2]], [feed_wire.REFUSED, 1, "value", [3]]):
        with pytest.raises(feed_wire.FrameError):
            feed_wire.transferred(bad) if bad[0] == feed_wire.OPENED else feed_wire.refusal(bad)


def test_an_invalid_open_is_refused_alone_and_a_malformed_one_ends_the_stream():
    """Values the dataclasses reject (top_p 2.0), missing fields or a prompt of non-integers: a ValueError REFUSED
    for that open (the worker's `decode` never runs); an open without its seq: FrameError (the connection ends)."""
    good = _one(feed_wire.open_request(1, RESULT, [1, 2], PARAMS))
    bad_params = [*good[:4], [*good[4][:2], 2.0, *good[4][3:]]]
    short_result = [*good[:2], good[2][:-1], *good[3:]]
    bad_prompt = [*good[:3], [1, "two"], good[4]]
    decoded: list = []
    written: list[bytes] = []

    def decode(*args):
        decoded.append(args)
        raise AssertionError("never reached")

    async def run():
        opens = FeedOpens("f", Opener(decode, lambda rid: None), written.append)
        for seq, payload in enumerate((bad_params, short_result, bad_prompt)):
            payload = [payload[0], seq, *payload[2:]]
            opens.open(payload)
        with pytest.raises(feed_wire.FrameError):
            opens.open([feed_wire.OPEN, "not-a-seq"])

    asyncio.run(run())
    assert decoded == []
    refusals = [feed_wire.refusal(_one(w)) for w in written]
    assert [seq for seq, _ in refusals] == [0, 1, 2]
    assert all(type(e) is ValueError for _, e in refusals)


def test_an_open_drives_the_workers_decode_and_a_cancel_closes_it():
    """FeedOpens with a decode generator of the worker's shape: its Transferred is the OPENED reply and the rest of
    the generator (the join) runs to its end; a CANCEL while it waits before Transferred closes the generator where
    it is (its finally runs: what frees the reservation on the worker), sends no reply and then aborts the request; a
    CANCEL after the open was answered aborts the request."""
    gate = asyncio.Event
    trace: list = []
    written: list[bytes] = []
    aborted: list[str] = []

    async def run():
        hold = gate()

        async def decode(result, prompt, params, feed_id):
            try:
                if result.request_id == "slow":
                    await hold.wait()
                yield Transferred(request_id=result.request_id, num_bytes=10, seconds=0.5)
                trace.append(("joined", result.request_id, feed_id))
            finally:
                trace.append(("closed", result.request_id))

        async def abort(rid):
            aborted.append(rid)

        opens = FeedOpens("feed-9", Opener(decode, abort), written.append)
        quick = PrefillResult(**{**RESULT.__dict__, "request_id": "quick"})
        slow = PrefillResult(**{**RESULT.__dict__, "request_id": "slow"})
        opens.open(_one(feed_wire.open_request(1, quick, [1], PARAMS)))
        opens.open(_one(feed_wire.open_request(2, slow, [1], PARAMS)))
        for _ in range(20):
            await asyncio.sleep(0)
        opens.cancel([feed_wire.CANCEL, 2, "slow"])  # in flight: cancelled
        opens.cancel([feed_wire.CANCEL, 1, "quick"])  # answered already: aborted
        for _ in range(20):
            await asyncio.sleep(0)

    asyncio.run(run())
    assert [feed_wire.transferred(_one(w)) for w in written] == [
        (1, Transferred(request_id="quick", num_bytes=10, seconds=0.5))
    ]
    assert ("joined", "quick", "feed-9") in trace and ("closed", "quick") in trace
    assert ("closed", "slow") in trace and not any(t[0] == "joined" and t[1] == "slow" for t in trace)
    # the answered one aborted; the cancelled one aborted too once its task ended (a reservation call that ran on
    # the engine thread although its wait was cancelled is undone by it)
    assert sorted(aborted) == ["quick", "slow"]
