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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from decode_worker.token_feed import RequestFailed
from engine.execution.request import TokenEvent

HELLO, BATCH, END, RENEW = "h", "b", "e", "r"
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
