"""The TCP token feed's wire format, shared by its two ends (decode_worker.tcp_feed, service.tcp_feed).

Why a format of its own and not pickle: the replica's listener accepts connections from anyone who can reach it, so
nothing it reads before a peer proved itself may run code, and an authenticated peer's frames need no more than
plain values. A frame is a 4-byte big-endian length, then one msgpack array (strings, ints, floats, bools, None:
msgpack packs a float as IEEE binary64, so logprobs travel exactly), its first element the frame's kind:

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

import struct
from dataclasses import dataclass, fields

import msgpack

from decode_worker.token_feed import FeedUnknown, RequestFailed
from engine.execution.request import TokenEvent
from engine.execution.sampling_params import SamplingParams
from engine.handoff import DecodeOverloaded, PeerUnknown, PrefillResult, Transferred, TransferTicket
from engine.runtime.engine_loop import LoopStopped, StepFailed
from kv_transfer.outcomes import PullCancelled, ReadInFlight, TransferError, TransferTimeout

HELLO, BATCH, END, RENEW = "h", "b", "e", "r"
OPEN, OPENED, REFUSED, CANCEL = "o", "k", "n", "x"
WORKER_TAKES = (OPEN, CANCEL)  # what a worker's open_tcp_feed reply names (module docstring, "Versions")
HELLO_MAX = 1024  # bytes of a HELLO frame (ids and tokens are tens of bytes)
FRAME_MAX = 64 << 20  # any other frame: far above a step's events, a bound against a corrupt length
_LEN = struct.Struct(">I")


class FrameError(Exception):
    """Bytes that are not a frame of this format (a peer that is not one of ours, or a corrupt stream)."""


def frame(payload: list) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def hello(feed_id: str, token: str, key: str) -> bytes:
    return frame([HELLO, feed_id, token, key])


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


def events(payload: list) -> list:
    """A BATCH frame's events, rebuilt (FrameError if they do not have the shape `batch` gives them)."""
    try:
        return [
            TokenEvent(e[0], e[1], e[2], e[3], e[4], tuple(e[5]), e[6]) if len(e) == 7 else RequestFailed(*e)
            for e in payload[1]
        ]
    except (TypeError, IndexError) as e:
        raise FrameError(f"a batch frame's event is malformed: {e}") from None


# ---- opening a request over the feed (OPEN / OPENED / REFUSED / CANCEL) ---------------------------------------
def _fields(obj) -> list:
    return [getattr(obj, f.name) for f in fields(obj)]


def open_request(seq: int, result: PrefillResult, prompt: list[int], params: SamplingParams) -> bytes:
    """One OPEN frame. A field added to one of these dataclasses travels as one more element (tests round-trip
    every field: one that needs rebuilding, as tuples do, fails them until `opened_request` rebuilds it)."""
    res = _fields(result)
    ticket = result.ticket
    res[[f.name for f in fields(result)].index("ticket")] = None if ticket is None else _fields(ticket)
    return frame([OPEN, seq, res, list(prompt), _fields(params)])


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
    res, prompt, par = payload[2], payload[3], payload[4]
    try:
        names = [f.name for f in fields(PrefillResult)]
        values = dict(zip(names, res, strict=True))
        t = values["ticket"]
        if t is not None:
            ticket = dict(zip([f.name for f in fields(TransferTicket)], t, strict=True))
            ticket["src_pages"] = tuple((g, tuple(p)) for g, p in ticket["src_pages"])
            if ticket["staging"] is not None:
                ticket["staging"] = tuple(ticket["staging"])
            values["ticket"] = TransferTicket(**ticket)
        values["prompt_logprobs"] = tuple(values["prompt_logprobs"])
        sampling = dict(zip([f.name for f in fields(SamplingParams)], par, strict=True))
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            raise ValueError("a prompt of non-integers")
        return OpenRequest(payload[1], PrefillResult(**values), prompt, SamplingParams(**sampling))
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
    for kind, cls in REFUSALS.items():
        if isinstance(error, cls):
            return frame([REFUSED, seq, kind, _args(error)])
    return frame([REFUSED, seq, "error", [f"{type(error).__name__}: {error}"]])


def refusal(payload: list) -> tuple[int, BaseException]:
    """A REFUSED frame -> (seq, the error rebuilt as the worker raised it; RuntimeError for one not in REFUSALS)."""
    try:
        seq, kind, args = payload[1], payload[2], payload[3]
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise TypeError("its arguments are not strings")
        return seq, REFUSALS.get(kind, RuntimeError)(*args)
    except (TypeError, ValueError, IndexError) as e:
        raise FrameError(f"a refused frame is malformed: {e}") from None


def cancel(seq: int, request_id: str) -> bytes:
    return frame([CANCEL, seq, request_id])


@dataclass
class Frames:
    """Frames out of a byte stream fed in pieces (`feed` -> the payloads complete so far); `limit`: the largest
    frame accepted (FrameError beyond it, before the bytes are buffered)."""

    limit: int = FRAME_MAX

    def __post_init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes, most: int | None = None) -> list[list]:
        """Take `data`; -> the frames complete so far (at most `most`: the rest stay for a later call, which may
        raise the limit first, as the listener does once a HELLO proved its peer)."""
        buf = self._buf
        buf += data
        out: list[list] = []
        at = 0
        while len(buf) - at >= 4 and (most is None or len(out) < most):
            (n,) = _LEN.unpack_from(buf, at)
            if n > self.limit:
                raise FrameError(f"a frame of {n} bytes (at most {self.limit})")
            if len(buf) - at - 4 < n:
                break
            try:
                payload = msgpack.unpackb(bytes(buf[at + 4 : at + 4 + n]), raw=False, strict_map_key=True)
            except Exception as e:  # noqa: BLE001 - msgpack's several errors for bytes that are not one object
                raise FrameError(f"a frame that is not msgpack: {type(e).__name__}") from None
            if not isinstance(payload, list) or not payload or not isinstance(payload[0], str):
                raise FrameError("a frame that is not [kind, ...]")
            out.append(payload)
            at += 4 + n
        if at:
            del buf[:at]
        return out

    def pending(self) -> int:
        """Bytes held that are not a whole frame yet."""
        return len(self._buf)
