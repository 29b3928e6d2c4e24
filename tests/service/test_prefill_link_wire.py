"""The prefill link's frames (prefill_worker.prefill_wire on engine.runtime.frames): a PREFILL and a PREFILLED
round-trip every field of what they carry, a refusal comes back as the class the worker raised, and what is not
such a frame is refused (FrameError: the connection is reset; ValueError: that call alone is refused)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from engine.execution.sampling_params import SamplingParams
from engine.handoff import PrefillResult, TransferTicket
from engine.runtime.frames import FrameError, Frames
from engine.runtime.loop_errors import LoopStopped, StepFailed
from prefill_worker import prefill_wire


def _one(data: bytes) -> list:
    got = Frames().feed(data)
    assert len(got) == 1
    return got[0]


def _params() -> SamplingParams:
    """Every field away from its default (a field the wire drops or mangles shows as a difference)."""
    return SamplingParams(
        max_new_tokens=17,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=11,
        ignore_eos=True,
        logprobs=True,
        prompt_logprobs=True,
        stop_token_ids=(3, 4),
    )


def test_a_prefill_frame_round_trips_every_field():
    params = _params()
    assert all(getattr(params, f.name) != getattr(SamplingParams(), f.name) for f in fields(SamplingParams))
    call = prefill_wire.prefill_call(_one(prefill_wire.prefill(7, "req-1", [5, 6, 7], params, 1234)))
    assert call == prefill_wire.PrefillCall(
        seq=7, request_id="req-1", prompt=[5, 6, 7], params=params, seed=1234, streamed=False
    )
    assert prefill_wire.prefill_call(_one(prefill_wire.prefill(8, "r", [1], params, None))).seed is None
    streamed = prefill_wire.prefill_call(_one(prefill_wire.prefill(9, "r", [1], params, 3, streamed=True)))
    assert streamed.streamed and streamed.seq == 9


def test_a_prefilled_frame_round_trips_the_result_and_its_ticket():
    ticket = TransferTicket(
        source="p0",
        request_id="req-1",
        src_pages=(("swa", (1, 2)), ("kv4", (3,))),
        num_tokens=40,
        fingerprint="fp",
        staging=(5, 9),
        start_tokens=16,
        final=True,
        lease_expires_at=123.5,
        source_instance="inst",
    )
    result = PrefillResult(
        request_id="req-1",
        worker_id="p0",
        first_token=42,
        first_logprob=-0.123456789012345,
        prompt_logprobs=(None, -1.5, -2.25),
        seed=99,
        finished=False,
        finish_reason=None,
        ticket=ticket,
        queue_time_s=0.01,
        prefill_time_s=0.02,
        incarnation="123-456",
        cached_tokens=8,
    )
    assert prefill_wire.result(_one(prefill_wire.prefilled(3, result))) == (3, result)
    assert prefill_wire.chunk_ticket(_one(prefill_wire.chunk(6, ticket))) == (6, ticket)
    done = PrefillResult(**{**{f.name: getattr(result, f.name) for f in fields(result)}, "ticket": None})
    assert prefill_wire.result(_one(prefill_wire.prefilled(4, done))) == (4, done)


@pytest.mark.parametrize(
    "error", [ValueError("prompt is empty"), StepFailed("a step raised"), LoopStopped("stopped")], ids=repr
)
def test_a_refusal_comes_back_as_the_class_raised(error):
    seq, back = prefill_wire.refusal(_one(prefill_wire.refused(5, error)))
    assert seq == 5 and type(back) is type(error) and str(back) == str(error)


def test_an_unknown_error_comes_back_as_a_runtime_error_naming_it():
    _, back = prefill_wire.refusal(_one(prefill_wire.refused(1, KeyError("x"))))
    assert type(back) is RuntimeError and "KeyError" in str(back)


def test_frames_that_are_not_a_call_are_refused():
    with pytest.raises(FrameError):
        prefill_wire.prefill_call(["p", 1, "rid", "not a prompt", [], None])
    good = _one(prefill_wire.prefill(1, "rid", [1, 2], SamplingParams(), None))
    with pytest.raises(ValueError):  # values, not shape: that call alone is refused
        prefill_wire.prefill_call([*good[:3], [1, "two"], *good[4:]])
    with pytest.raises(ValueError):
        prefill_wire.prefill_call([*good[:5], True])  # a seed that is not an int
    with pytest.raises(FrameError):
        prefill_wire.result(["d", 1, [1, 2]])  # a result of the wrong length
