"""The framing of the TCP links between an ingress replica and a worker, shared by the decode worker's token feed
(decode_worker.feed_wire) and the prefill worker's link (prefill_worker.prefill_wire): each defines its frame kinds
on top of this.

Why a format of its own and not pickle: the replica's listener (service.tcp_feed) accepts connections from anyone
who can reach it, so nothing it reads before a peer proved itself may run code, and an authenticated peer's frames
need no more than plain values. A frame is a 4-byte big-endian length, then one msgpack array (strings, ints,
floats, bools, None: msgpack packs a float as IEEE binary64, so logprobs travel exactly), its first element the
frame's kind. Every link opens with a HELLO, worker -> replica: `["h", link_id, token, key]` (the link it carries,
the cluster token and the key the replica gave that link through Ray), at most HELLO_MAX bytes.

Also here, as both links carry them: the hand-off values as arrays of their fields in order (`result_fields` /
`result_from`, `params_from`), a worker's refusal as a kind and its constructor's plain arguments (`refused` /
`refusal`, against each link's table of the errors its caller tells apart), the worker's connect (`call_back`) and
its end of a connection (`PeerLink`: frames in, each to `take`, anything else resets the connection).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields

import msgpack

from engine.execution.sampling_params import SamplingParams
from engine.handoff import PrefillResult, TransferTicket

HELLO = "h"
HELLO_MAX = 1024  # bytes of a HELLO frame (ids and tokens are tens of bytes)
FRAME_MAX = 64 << 20  # any other frame: far above a step's events or a prompt, a bound against a corrupt length
CONNECT_TIMEOUT_S = 10.0
_LEN = struct.Struct(">I")
log = logging.getLogger(__name__)


class FrameError(Exception):
    """Bytes that are not a frame of this format (a peer that is not one of ours, or a corrupt stream)."""


def frame(payload: list) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def hello(link_id: str, token: str, key: str) -> bytes:
    return frame([HELLO, link_id, token, key])


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


# ---- hand-off values as arrays of their fields ----------------------------------------------------------------
def fields_of(obj) -> list:
    return [getattr(obj, f.name) for f in fields(obj)]


def result_fields(result: PrefillResult) -> list:
    """A PrefillResult as its fields in order, its ticket nested the same way. A field added to one of these
    dataclasses travels as one more element (the wire tests round-trip every field: one that needs rebuilding, as
    tuples do, fails them until `result_from` rebuilds it)."""
    res = fields_of(result)
    ticket = result.ticket
    res[[f.name for f in fields(result)].index("ticket")] = None if ticket is None else fields_of(ticket)
    return res


def ticket_from(t: list) -> TransferTicket:
    """`fields_of(ticket)`'s inverse (TypeError / ValueError for values that are not its shape)."""
    ticket = dict(zip([f.name for f in fields(TransferTicket)], t, strict=True))
    ticket["src_pages"] = tuple((g, tuple(p)) for g, p in ticket["src_pages"])
    if ticket["staging"] is not None:
        ticket["staging"] = tuple(ticket["staging"])
    return TransferTicket(**ticket)


def result_from(res: list) -> PrefillResult:
    """`result_fields`' inverse (TypeError / ValueError for values that are not its shape)."""
    values = dict(zip([f.name for f in fields(PrefillResult)], res, strict=True))
    if values["ticket"] is not None:
        values["ticket"] = ticket_from(values["ticket"])
    values["prompt_logprobs"] = tuple(values["prompt_logprobs"])
    return PrefillResult(**values)


def params_from(par: list) -> SamplingParams:
    """SamplingParams from `fields_of(params)` (TypeError / ValueError for values that are not its shape)."""
    sampling = dict(zip([f.name for f in fields(SamplingParams)], par, strict=True))
    sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    return SamplingParams(**sampling)


def prompt_from(prompt: list) -> list[int]:
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        raise ValueError("a prompt of non-integers")
    return prompt


# ---- a worker's refusal ---------------------------------------------------------------------------------------
def refused(kind: str, seq: int, error: BaseException, table: dict[str, type[BaseException]], args=None) -> bytes:
    """A refusal frame `[kind, seq, error kind, args]` for `error`: the first class of `table` it is an instance of
    names it (subclasses first), `args(error)` its constructor's plain arguments (default: its message); any other
    error as "error" with its type's name in the message (a RuntimeError on the replica)."""
    for name, cls in table.items():
        if isinstance(error, cls):
            return frame([kind, seq, name, args(error) if args is not None else [str(error)]])
    return frame([kind, seq, "error", [f"{type(error).__name__}: {error}"]])


def refusal(payload: list, table: dict[str, type[BaseException]]) -> tuple[int, BaseException]:
    """A refusal frame -> (seq, the error rebuilt as the worker raised it; RuntimeError for one not in `table`)."""
    try:
        seq, name, args = payload[1], payload[2], payload[3]
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise TypeError("its arguments are not strings")
        return seq, table.get(name, RuntimeError)(*args)
    except (TypeError, ValueError, IndexError) as e:
        raise FrameError(f"a refusal frame is malformed: {e}") from None


# ---- the worker's end ------------------------------------------------------------------------------------------
async def call_back(
    host: str, port: int, protocol: Callable[[], asyncio.Protocol], first: bytes, send_buffer: int | None = None
) -> asyncio.Transport:
    """Connect to a replica's listener (within CONNECT_TIMEOUT_S) and send `first` (the HELLO) -> the transport.
    No delay on small writes: a frame is a step or a reply, never held back for more."""
    loop = asyncio.get_running_loop()
    transport, _ = await asyncio.wait_for(loop.create_connection(protocol, host, port), CONNECT_TIMEOUT_S)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if send_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    transport.write(first)
    return transport


class PeerLink(asyncio.Protocol):
    """A worker's (or router's) end of a connection it opened to a replica (`call_back`): each whole frame goes to
    `take`; a FrameError there (bytes that are not a frame, a kind this end does not take) resets the connection.
    The replica closing its end closes this one (connection_lost follows)."""

    name = "link"  # what the logs call it: "<name> <link_id>"

    def __init__(self, link_id: str, frames: Frames):
        self.link_id = link_id
        self.frames = frames
        self.transport: asyncio.Transport | None = None

    def take(self, f: list) -> None:
        raise NotImplementedError

    def connection_made(self, transport) -> None:
        self.transport = transport

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            for f in self.frames.feed(data):
                self.take(f)
        except FrameError as e:
            log.warning("%s %s: %s; closing it", self.name, self.link_id, e)
            if self.transport is not None:
                self.transport.abort()

    def eof_received(self) -> bool:
        return False  # the replica closed its end: close ours (connection_lost follows)
