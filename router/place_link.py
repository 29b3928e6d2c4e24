"""A router replica's link to one ingress replica: the replica's `Place` (and `Settle`) calls as frames on a TCP
connection this router opens back to the replica's listener, in place of gRPC calls (service.place_link has the
replica's side).

Why: a gRPC `Place` cost the ingress replica's event loop ~0.48 ms a request (grpc.aio's call object, its
interceptor chain and the hand-offs between gRPC's poller threads and the loop), and the router about as much
again, at ~160 requests a second on a 2-core box where the token path's processes wait for a core (BENCHMARKS.md,
section frontdoor's reading). The workers' links to the same listener showed the way (decode_worker.tcp_feed,
prefill_worker.prefill_link): the replica asks this router through Ray to call back (`RouterActor.open_place_link`),
the router connects and says HELLO with the cluster token and the key the replica gave it, then the replica writes
one PLACE frame a request and this router answers it with one frame.

The frames (engine.runtime.frames' framing; the placement messages are the gRPC API's own protobuf bytes, so both
transports carry the same request and answer, and a field added to the API travels on both):
- `["p", seq, PlaceRequest bytes]` PLACE, replica -> router: `RouterServer.place` on it, as `Place` runs it.
- `["a", seq, PlaceResponse bytes]` PLACED, router -> replica: its answer.
- `["n", seq, code, message]` REFUSED, router -> replica: its RouterFailure (code: the gRPC status number), or
  UNKNOWN for an error of the router's own (what a gRPC handler's exception gives).
- `["x", seq]` CANCEL, replica -> router: the caller stopped waiting (its client left, its deadline passed): the
  placement's task is cancelled, as a cancelled gRPC call's handler is.
- `["s", [request_id, ...]]` SETTLE, replica -> router: `Settle` for those placements (no answer: best effort,
  as the gRPC call's caller treats it).
The connection's end cancels every placement still running here (nobody takes their answers). The peer is the one
the replica named through Ray (as trusted as that call); anything it sends that is not one of its frames resets the
connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from engine.runtime import frames
from router.migration import RouterFailure
from router.protos import pb2

log = logging.getLogger(__name__)
PLACE, PLACED, REFUSED, CANCEL, SETTLE = "p", "a", "n", "x", "s"
TAKES = (PLACE, CANCEL, SETTLE)  # what `RouterActor.open_place_link` replies: the frames this router reads
UNKNOWN = 2  # gRPC's status number for an error that is not a RouterFailure


class Placer(Protocol):
    """What a link runs its frames on (router.server.RouterServer); `link_places` counts the PLACE frames taken."""

    link_places: int

    async def place(self, request) -> object: ...

    def settle_all(self, request_ids) -> bool: ...


# ---- frames ---------------------------------------------------------------------------------------------------
def place(seq: int, request: bytes) -> bytes:
    return frames.frame([PLACE, seq, request])


def placed(seq: int, reply: bytes) -> bytes:
    return frames.frame([PLACED, seq, reply])


def refused(seq: int, code: int, message: str) -> bytes:
    return frames.frame([REFUSED, seq, code, message])


def cancel(seq: int) -> bytes:
    return frames.frame([CANCEL, seq])


def settle(request_ids: list[str]) -> bytes:
    return frames.frame([SETTLE, list(request_ids)])


def _seq(f: list, size: int) -> int:
    if len(f) != size or not isinstance(f[1], int):
        raise frames.FrameError(f"a {f[0]!r} frame that is not {size} values with its seq")
    return f[1]


# ---- the router's end -----------------------------------------------------------------------------------------
class _Link(frames.PeerLink):
    """The router's end of one link: PLACE / CANCEL / SETTLE frames in, a task a placement, its answer out."""

    name = "place link"

    def __init__(self, link_id: str, placer: Placer):
        super().__init__(link_id, frames.Frames())
        self.placer = placer
        self._running: dict[int, asyncio.Task] = {}

    def take(self, f: list) -> None:
        kind = f[0]
        if kind == PLACE:
            self._start(_seq(f, 3), f[2])
        elif kind == CANCEL:
            task = self._running.pop(_seq(f, 2), None)
            if task is not None:
                task.cancel()
        elif kind == SETTLE:
            if len(f) != 2 or not isinstance(f[1], list) or not all(isinstance(r, str) for r in f[1]):
                raise frames.FrameError("a settle frame that is not [s, [request id, ...]]")
            self.placer.settle_all(f[1])
        else:
            raise frames.FrameError(f"a {kind!r} frame from the replica")

    def _start(self, seq: int, body: object) -> None:
        if not isinstance(body, bytes):
            raise frames.FrameError("a place frame without its request's bytes")
        try:
            request = pb2.PlaceRequest.FromString(body)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError: this call's bytes, not the stream
            self._write(refused(seq, UNKNOWN, f"a PlaceRequest that does not parse: {type(e).__name__}"))
            return
        self._running[seq] = asyncio.get_running_loop().create_task(self._run(seq, request))
        self.placer.link_places += 1

    async def _run(self, seq: int, request) -> None:
        try:
            reply = await self.placer.place(request)
        except asyncio.CancelledError:
            return  # CANCEL or the connection's end: nobody waits for the answer
        except RouterFailure as f:
            self._write(refused(seq, f.code, f.message))
            return
        except Exception as e:  # noqa: BLE001 - as a gRPC handler's own error: UNKNOWN, logged here
            log.exception("place link %s: placement %d failed", self.link_id, seq)
            self._write(refused(seq, UNKNOWN, f"{type(e).__name__}"))
            return
        finally:
            self._running.pop(seq, None)
        self._write(placed(seq, reply.SerializeToString()))  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        running, self._running = self._running, {}
        if running:
            log.info("place link %s lost (%r): %d placements cancelled", self.link_id, exc, len(running))
        for task in running.values():
            task.cancel()


async def connect(link_id: str, host: str, port: int, token: str, key: str, placer: Placer) -> None:
    """Open link `link_id` to its ingress replica at host:port (HELLO first); returns once connected. The connection
    then lives on this loop until either end closes it."""
    await frames.call_back(host, port, lambda: _Link(link_id, placer), frames.hello(link_id, token, key))
