"""The prefill link's wire format, shared by its two ends (prefill_worker.prefill_link, service.prefill_link).

The framing, the HELLO that opens the connection and the hand-off values' arrays are engine.runtime.frames' (as the
token feed's, decode_worker.feed_wire); the kinds a prefill link carries after its HELLO:

- `["p", seq, request_id, prompt, params, seed]` PREFILL, replica -> worker: what `PrefillWorker.prefill(request_id,
  prompt, params, seed)` does over Ray: the prompt as ints, the SamplingParams as an array of its fields in order,
  the seed an int or None. `seq` (an int the replica picks) names the call in its reply and in CANCEL.
- `["s", seq, request_id, prompt, params, seed]` STREAM, replica -> worker: the same for `PrefillWorker.
  prefill_streamed` (the streamed hand-off, service.ray_stream): its chunk tickets come back as CHUNK frames as the
  prefill steps complete pages, then its PrefillResult as PREFILLED.
- `["c", seq, ticket]` CHUNK, worker -> replica: one chunk TransferTicket of a STREAM call (its fields in order).
- `["d", seq, result]` PREFILLED, worker -> replica: the call's PrefillResult (its TransferTicket nested); the last
  frame of a STREAM call.
- `["n", seq, kind, args]` REFUSED, worker -> replica: the call raised; `kind` names one of the errors its caller
  tells apart (`REFUSALS`), `args` its constructor's plain arguments; any other error as kind "error" (a
  RuntimeError on the replica).
- `["x", seq, request_id]` CANCEL, replica -> worker: the replica stopped waiting (its client left): a call still
  running is cancelled (the prefill drops the request, as when the Ray call is cancelled), the request of one
  already answered is aborted (its export withdrawn, pages freed).

Versions: a worker's `open_prefill_link` Ray call returns the replica-to-worker kinds it takes (`WORKER_TAKES`); a
replica sends PREFILL (STREAM) only to a worker that named it. A worker of an older release has no such method (or names
nothing) and keeps being called through Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.execution.sampling_params import SamplingParams
from engine.handoff import PrefillResult, TransferTicket
from engine.runtime import frames
from engine.runtime.frames import FrameError, frame
from engine.runtime.loop_errors import LoopStopped, StepFailed

PREFILL, PREFILLED, REFUSED, CANCEL = "p", "d", "n", "x"
STREAM, CHUNK = "s", "c"
WORKER_TAKES = (PREFILL, STREAM, CANCEL)  # what a worker's open_prefill_link reply names (module docstring, "Versions")

# The errors a `prefill` call's caller tells apart (service.ray_items.failure: a stopped engine loop is the worker's
# death; a ValueError is the request's fault), subclasses first. A prefill worker queues what it cannot run yet, so
# none of them is an overload: a prompt that can never fit is a ValueError from the engine's validation.
REFUSALS: dict[str, type[BaseException]] = {
    "step_failed": StepFailed,
    "loop_stopped": LoopStopped,
    "value": ValueError,
}


def prefill(
    seq: int, request_id: str, prompt: list[int], params: SamplingParams, seed: int | None, streamed: bool = False
) -> bytes:
    """A PREFILL frame (STREAM with `streamed`)."""
    return frame([STREAM if streamed else PREFILL, seq, request_id, list(prompt), frames.fields_of(params), seed])


@dataclass(frozen=True)
class PrefillCall:
    """A PREFILL frame's call, rebuilt: what `PrefillWorker.prefill` takes."""

    seq: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int | None
    streamed: bool  # a STREAM frame: `prefill_streamed`


def prefill_call(payload: list) -> PrefillCall:
    """A PREFILL frame's call (FrameError if the frame has not the shape `prefill` gives it; ValueError if its
    values are not valid arguments, as the dataclasses' own checks say)."""
    if (
        len(payload) != 6
        or not isinstance(payload[1], int)
        or not isinstance(payload[2], str)
        or not isinstance(payload[3], list)
        or not isinstance(payload[4], list)
    ):
        raise FrameError("a prefill frame that is not [p | s, seq, request_id, prompt, params, seed]")
    seed = payload[5]
    try:
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"a seed that is not an int: {seed!r}")
        prompt, params = frames.prompt_from(payload[3]), frames.params_from(payload[4])
        streamed = payload[0] == STREAM
        return PrefillCall(
            seq=payload[1], request_id=payload[2], prompt=prompt, params=params, seed=seed, streamed=streamed
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"a prefill frame's call is malformed: {e}") from None


def chunk(seq: int, ticket: TransferTicket) -> bytes:
    return frame([CHUNK, seq, frames.fields_of(ticket)])


def chunk_ticket(payload: list) -> tuple[int, TransferTicket]:
    """A CHUNK frame -> (seq, its TransferTicket)."""
    try:
        if len(payload) != 3 or not isinstance(payload[1], int) or not isinstance(payload[2], list):
            raise TypeError("not [c, seq, ticket]")
        return payload[1], frames.ticket_from(payload[2])
    except (TypeError, ValueError) as e:
        raise FrameError(f"a chunk frame is malformed: {e}") from None


def prefilled(seq: int, result: PrefillResult) -> bytes:
    return frame([PREFILLED, seq, frames.result_fields(result)])


def result(payload: list) -> tuple[int, PrefillResult]:
    """A PREFILLED frame -> (seq, its PrefillResult)."""
    try:
        if len(payload) != 3 or not isinstance(payload[1], int) or not isinstance(payload[2], list):
            raise TypeError("not [d, seq, result]")
        return payload[1], frames.result_from(payload[2])
    except (TypeError, ValueError) as e:
        raise FrameError(f"a prefilled frame is malformed: {e}") from None


def refused(seq: int, error: BaseException) -> bytes:
    """One REFUSED frame for `error` (the exception the Ray call would have raised)."""
    return frames.refused(REFUSED, seq, error, REFUSALS)


def refusal(payload: list) -> tuple[int, BaseException]:
    """A REFUSED frame -> (seq, the error rebuilt as the worker raised it)."""
    return frames.refusal(payload, REFUSALS)


def cancel(seq: int, request_id: str) -> bytes:
    return frame([CANCEL, seq, request_id])
