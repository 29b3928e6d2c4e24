"""`BodyWriter`: a streamed response's middle body chunks written straight to its HTTP/1.1 connection, past the ASGI
send chain, when the server is uvicorn's httptools protocol as this service runs it (service.http_limits).

Why: in an ingress replica every streamed token is one `http.response.body` message, and an ASGI send climbs six
wrappers before uvicorn frames it (Starlette's exception handler, our GuardMiddleware, ServerErrorMiddleware, Serve's
replica and request-id wrappers, then uvicorn's own send), each an async function a token: ~4 us of the replica's
loop a token of the ~24 it spent on one (BENCHMARKS frontdoor's reading). For a body message with more to come
every one of them only passes it on; what decides anything is uvicorn's send: flow control (wait while the client
reads slower than we write), a client already gone (drop it), and the chunked framing. `BodyWriter` does exactly
that framing and writes the chunk when none of those cases holds, and otherwise says no, so the caller sends it the
ASGI way, where uvicorn's send waits or drops it as before.

How it gets there: the protocol puts one in each request's ASGI scope under `BODY_WRITER` (an ASGI extension
name; servers that know nothing of it leave it out, and the response keeps the plain ASGI send). The same protocol
runs in Serve's own HTTP proxies, which pickle the scope to a replica in another process: there the writer travels
as None (a connection cannot be written from elsewhere), and the replica's response uses the ASGI send.
"""

from __future__ import annotations

import weakref
from typing import Any

BODY_WRITER = "dsv4.body_writer"  # the scope["extensions"] key


class BodyWriter:
    """One request's response body written to its connection (module docstring); `cycle` is uvicorn's
    RequestResponseCycle of the request (httptools protocol), held weakly: the cycle's scope holds this writer, and a
    strong reference back would make every request a reference cycle that only the cycle collector frees (its passes
    walk every in-flight request's objects: the token path's latency tail, BENCHMARKS frontdoor)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle):
        self._cycle = weakref.ref(cycle)

    def __reduce__(self):
        return _nothing, ()  # pickled (Serve's proxy -> a replica) or copied: None there (module docstring)

    def __call__(self, chunk: bytes) -> bool:
        """Write one non-empty, non-final body chunk now (-> True), as uvicorn's send would for a body message
        with more_body; False, and nothing written, when the send must go the ASGI way: the headers are not out
        (or not chunked), the response is over, the client left, or the transport asks us to wait."""
        c = self._cycle()
        if c is None or c.flow.write_paused or c.disconnected or c.response_complete or not c.response_started:
            return False
        if not c.chunked_encoding or c.scope["method"] == "HEAD":  # what uvicorn's send writes then differs
            return False
        if chunk:  # an empty one: uvicorn writes nothing (its "0" chunk would end the body)
            c.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True


def _nothing() -> None:
    return None


# What the writer reads of uvicorn's RequestResponseCycle (httptools_impl; the same since uvicorn 0.1x). A cycle that
# lacks any of them (another server, a uvicorn that renamed them) gets no writer: its responses keep the ASGI send.
_CYCLE_FIELDS = ("flow", "disconnected", "response_complete", "response_started", "chunked_encoding", "transport")


def attach(scope: Any, cycle) -> None:
    """Offer the request's BodyWriter to the app (the protocol calls this once it made the request's cycle)."""
    if all(hasattr(cycle, f) for f in _CYCLE_FIELDS) and hasattr(cycle.flow, "write_paused"):
        scope.setdefault("extensions", {})[BODY_WRITER] = BodyWriter(cycle)


def body_writer(scope) -> BodyWriter | None:
    """The request's BodyWriter, if its server offered one."""
    ext = scope.get("extensions") or {}
    writer = ext.get(BODY_WRITER)
    return writer if isinstance(writer, BodyWriter) else None
