"""The TCP token feed's wire format, shared by its two ends (decode_worker.tcp_feed, service.tcp_feed).

The framing (a length, then one msgpack array of plain values, no pickle: why there), the HELLO and the hand-off
values' arrays are engine.runtime.frames', shared with the prefill worker's link (prefill_worker.prefill_wire); the
kinds a token feed carries:

- `["h", feed_id, token, key]` HELLO, worker -> replica, the first frame of a connection: the feed it carries, the
  cluster token (router.auth) and the key the replica gave that feed through Ray (service.tcp_feed says why both).
  At most HELLO_MAX bytes: the listener reads no more than that from a peer that has not proved itself.
- `["b", [event, ...]]` BATCH, worker -> replica: one burst of the feed (an engine step's events of every request of
  that replica, in order). A TokenEvent is a 7-element array (its fields in order), a RequestFailed a 3-element one.
- `["e", message]` END, worker -> replica: the worker ends the feed (its engine failed, its lease ran out); every
  request on it fails.
- `["r"]` RENEW, replica -> worker: the replica still reads the feed (its lease starts again).
- `["o", seq, result, prompt, params]` OPEN, replica -> worker: open one request's decode on this feed, what
  `DecodeWorker.decode(result, prompt, params, feed=this feed)` does over Ray (decode_worker.feed_opens says why):
  the PrefillResult (its TransferTicket nested) and the SamplingParams as arrays of their fields in order, the
  prompt as ints. `seq` (an int the replica picks) names the open in its reply and in CANCEL.
- `["k", seq, [request_id, num_bytes, seconds]]` OPENED, worker -> replica: the open's `Transferred` (the caches
  landed; the request joins the batch and its events follow on this feed, a failed join as a RequestFailed).
- `["n", seq, kind, args]` REFUSED, worker -> replica: the open failed before `Transferred`; `kind` names one of
  the errors the Ray call's caller tells apart (`REFUSALS`), `args` its constructor's plain arguments. Any other
  error travels as kind "error" with its type's name in the message (a RuntimeError on the replica).
- `["x", seq, request_id]` CANCEL, replica -> worker: the replica stopped waiting (its client left): an open still
  in flight is cancelled (its pages and slot freed as when a Ray `decode` call is cancelled), one already over is
  aborted.
Frames go from replica to worker only on a connection whose HELLO the replica accepted (service.tcp_feed), and the
worker reads them only from the peer it was told to call through Ray: as trusted as that call itself.

Versions: a worker's `open_tcp_feed` Ray call returns the replica-to-worker frame kinds it takes beyond RENEW
(`WORKER_TAKES`); a replica sends OPEN / CANCEL only to a worker that named them. A worker of a release before them
returns None (the replica keeps the Ray call), and a replica of such a release ignores the reply, so a cluster in
the middle of a rolling upgrade keeps streaming either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from decode_worker.token_feed import FeedUnknown, RequestFailed
from engine.execution.request import TokenEvent
from engine.execution.sampling_params import SamplingParams
from engine.handoff import DecodeOverloaded, PeerUnknown, PrefillResult, Transferred
from engine.runtime import frames
from engine.runtime.frames import FRAME_MAX, HELLO, HELLO_MAX, FrameError, Frames, frame  # noqa: F401 - re-exported
from engine.runtime.loop_errors import LoopStopped, StepFailed
from kv_transfer.outcomes import PullCancelled, ReadInFlight, TransferError, TransferTimeout

BATCH, END, RENEW = "b", "e", "r"
OPEN, OPENED, REFUSED, CANCEL = "o", "k", "n", "x"
WORKER_TAKES = (OPEN, CANCEL)  # what a worker's open_tcp_feed reply names (module docstring, "Versions")


def hello(feed_id: str, token: str, key: str) -> bytes:
    return frames.hello(feed_id, token, key)


def end(message: str) -> bytes:
    return frame([END, message])


RENEW_FRAME = frame([RENEW])


def batch(items) -> bytes:
    """One BATCH frame of TokenEvents and RequestFailed."""
    out = []
    for it in items:
        if isinstance(it, TokenEvent):
            out.append(
                [
                    it.request_id,
                    it.token_id,
                    it.logprob,
                    it.finished,
                    it.finish_reason,
                    list(it.prompt_logprobs),
                    it.cached_tokens,
                ]
            )
        else:
            out.append([it.request_id, it.message, it.engine_stopped])
    return frame([BATCH, out])


def event(row) -> TokenEvent | RequestFailed:
    """One event of a BATCH frame (an element of its list: `batch`'s array) rebuilt; FrameError if malformed."""
    try:
        return _event(row)
    except (TypeError, IndexError) as e:
        raise FrameError(f"a batch frame's event is malformed: {e}") from None


def _event(e) -> TokenEvent | RequestFailed:
    return TokenEvent(e[0], e[1], e[2], e[3], e[4], tuple(e[5]), e[6]) if len(e) == 7 else RequestFailed(*e)


# ---- opening a request over the feed (OPEN / OPENED / REFUSED / CANCEL) ---------------------------------------
def open_request(seq: int, result: PrefillResult, prompt: list[int], params: SamplingParams) -> bytes:
    """One OPEN frame (the values as engine.runtime.frames lays them out)."""
    return frame([OPEN, seq, frames.result_fields(result), list(prompt), frames.fields_of(params)])


@dataclass(frozen=True)
class OpenRequest:
    """An OPEN frame's request, rebuilt: what `DecodeWorker.decode` takes."""

    seq: int
    result: PrefillResult
    prompt: list[int]
    params: SamplingParams


def opened_request(payload: list) -> OpenRequest:
    """An OPEN frame's request (FrameError if the frame has not the shape `open_request` gives it; ValueError if
    its values are not valid arguments, as the dataclasses' own checks say)."""
    if len(payload) != 5 or not isinstance(payload[1], int) or not all(isinstance(x, list) for x in payload[2:]):
        raise FrameError("an open frame that is not [o, seq, result, prompt, params]")
    try:
        result, prompt = frames.result_from(payload[2]), frames.prompt_from(payload[3])
        return OpenRequest(payload[1], result, prompt, frames.params_from(payload[4]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"an open frame's request is malformed: {e}") from None


def opened(seq: int, done: Transferred) -> bytes:
    return frame([OPENED, seq, [done.request_id, done.num_bytes, done.seconds]])


def transferred(payload: list) -> tuple[int, Transferred]:
    """An OPENED frame -> (seq, its Transferred)."""
    try:
        rid, num_bytes, seconds = payload[2]
        return payload[1], Transferred(request_id=rid, num_bytes=num_bytes, seconds=seconds)
    except (TypeError, ValueError, IndexError) as e:
        raise FrameError(f"an opened frame is malformed: {e}") from None


# The errors a `decode` call's caller tells apart (service.ray_stream._open_decode: retried, re-introduced, the
# worker's or the source's death, the request's own fault), by kind: (class, how to take its constructor's args).
# Subclasses first: the first class an error is an instance of names it.
REFUSALS: dict[str, type[BaseException]] = {
    "overloaded": DecodeOverloaded,
    "peer_unknown": PeerUnknown,
    "feed_unknown": FeedUnknown,
    "read_in_flight": ReadInFlight,
    "transfer_timeout": TransferTimeout,
    "pull_cancelled": PullCancelled,
    "transfer": TransferError,
    "step_failed": StepFailed,
    "loop_stopped": LoopStopped,
    "value": ValueError,
}


def _args(error: BaseException) -> list:
    if isinstance(error, PeerUnknown):
        return [error.source, error.worker]
    if isinstance(error, FeedUnknown):
        return [error.feed_id, error.worker_id]
    if isinstance(error, ReadInFlight):
        return [str(error), error.request_id]
    return [str(error)]


def refused(seq: int, error: BaseException) -> bytes:
    """One REFUSED frame for `error` (the exception the Ray call would have raised)."""
    return frames.refused(REFUSED, seq, error, REFUSALS, _args)


def refusal(payload: list) -> tuple[int, BaseException]:
    """A REFUSED frame -> (seq, the error rebuilt as the worker raised it; RuntimeError for one not in REFUSALS)."""
    return frames.refusal(payload, REFUSALS)


def cancel(seq: int, request_id: str) -> bytes:
    return frame([CANCEL, seq, request_id])
