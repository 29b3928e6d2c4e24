"""service.body_writer: a streamed response's body chunks written straight to the connection by the guarded uvicorn
protocol's BodyWriter (service.http_limits), against real uvicorn servers over raw sockets:
- the bytes on the wire are those of the ASGI send (the writer turned off), chunk framing and order included, with
  the lane's writes (`SSEResponse.write_now`) between the body's own;
- a client that stops reading: the writer says no once uvicorn's flow control pauses the transport, the response's
  write waits on the client (`busy`), and every chunk arrives in order once the client reads again;
- a client that leaves: the writer says no, the response ends and its body generator is closed;
and the writer alone: each case in which uvicorn's send would not write a chunk right away, and its pickling (Serve's
proxy pickles a scope for a replica) to None.
"""

from __future__ import annotations

import asyncio
import pickle
import re
import socket
import time
import weakref

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httptools")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402

from service import http_stream  # noqa: E402
from service.body_writer import BODY_WRITER, BodyWriter, attach, body_writer  # noqa: E402
from service.http_limits import HttpLimits, guarded  # noqa: E402
from service.http_stream import SSEResponse  # noqa: E402
from service.token_lane import TokenLane  # noqa: E402
from tests.support.uvicorn_server import serve_in_thread  # noqa: E402

BIG = b"x" * (256 << 10)


class _App:
    """Endpoints streaming an SSEResponse whose lane writes between the body's own chunks (as the token feed does)."""

    def __init__(self):
        self.seen: dict = {}  # what the last request's response saw (writer offered, writes held, closed)

    async def mixed(self, request):
        lane = TokenLane()

        writer = body_writer(request.scope)
        self.seen["cycle"] = weakref.ref(writer._cycle()) if writer is not None else None

        async def body():
            yield b"data: head\n\n"
            resp = lane.response
            self.seen["writer"] = resp._direct is not None
            for k in range(20):
                resp.write_now(b"data: lane %d\n\n" % k)
                await asyncio.sleep(0)
            yield b"data: tail\n\n"

        return SSEResponse(body(), media_type="text/event-stream", lane=lane)

    async def flood(self, request):
        lane = TokenLane()

        async def body():
            yield b"data: head\n\n"
            resp, n = lane.response, 0
            while not resp.busy() and n < 4096:  # the client does not read: uvicorn's flow control pauses us
                resp.write_now(b"%08d" % n + BIG)
                n += 1
                await asyncio.sleep(0)
            self.seen["held_after"] = n
            self.seen["writer_refused"] = resp._direct is not None and not resp._direct(b"more")
            yield b"%08d" % n + b"tail"  # waits for the held write, then goes out after it

        return SSEResponse(body(), media_type="application/octet-stream", lane=lane)

    async def endless(self, request):
        lane = TokenLane()

        async def body():
            try:
                yield b"data: head\n\n"
                resp = lane.response
                while True:
                    resp.write_now(b"data: tick\n\n")
                    await asyncio.sleep(0.01)
            finally:
                self.seen["closed"] = True

        return SSEResponse(body(), media_type="text/event-stream", lane=lane)

    def asgi(self):
        routes = [Route(f"/{name}", getattr(self, name)) for name in ("mixed", "flood", "endless")]
        return Starlette(routes=routes)


@pytest.fixture(scope="module")
def served():
    app = _App()
    http = guarded(HttpLimits(max_header_bytes=8192, header_timeout_s=5.0, body_timeout_s=5.0))
    server, port = serve_in_thread(app.asgi(), http=http)
    yield app, port
    server.should_exit = True


def _get(port: int, path: str, *, read: bool = True, timeout: float = 20.0) -> socket.socket | bytes:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    if not read:
        return s
    with s:
        return _read_all(s)


def _read_all(s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := s.recv(1 << 20):
        out += chunk
    return bytes(out)


def _body(raw: bytes) -> bytes:
    """The chunked body's framing as sent (the head's Date header left out)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    return body


def _unchunk(body: bytes) -> bytes:
    out, rest = bytearray(), body
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return bytes(out)
        out += rest[:n]
        assert rest[n : n + 2] == b"\r\n"
        rest = rest[n + 2 :]


def test_bytes_on_the_wire_are_the_asgi_sends(served, monkeypatch):
    app, port = served
    direct = _get(port, "/mixed")
    assert app.seen["writer"] is True
    monkeypatch.setattr(http_stream, "body_writer", lambda scope: None)  # the ASGI send for every chunk
    plain = _get(port, "/mixed")
    assert app.seen["writer"] is False
    assert _body(direct) == _body(plain)
    lanes = [b"data: lane %d\n\n" % k for k in range(20)]
    assert _unchunk(_body(direct)) == b"data: head\n\n" + b"".join(lanes) + b"data: tail\n\n"


def test_a_finished_request_is_freed_by_its_reference_count(served):
    """The writer holds its request's cycle weakly: the scope holds the writer, so a strong reference back would make
    every request a reference cycle, left for the cycle collector, whose passes walk every in-flight request's
    objects (20 ms pauses every ~2 s at 96 streams on the 2-core box: the token path's p99, BENCHMARKS frontdoor)."""
    import gc

    app, port = served
    gc.disable()
    try:
        _get(port, "/mixed")  # Connection: close: uvicorn lets go of the request once the connection ends
        deadline = time.monotonic() + 5
        while app.seen["cycle"]() is not None:
            assert time.monotonic() < deadline, "the request's cycle is still alive: a reference cycle holds it"
            time.sleep(0.02)
    finally:
        gc.enable()


def test_a_client_that_stops_reading_holds_the_writes_and_gets_them_all_in_order(served):
    app, port = served
    s = _get(port, "/flood", read=False)
    assert isinstance(s, socket.socket)
    with s:
        deadline = time.monotonic() + 20
        while "held_after" not in app.seen:
            assert time.monotonic() < deadline, "the response never waited on the client"
            time.sleep(0.05)
        assert app.seen["writer_refused"] is True  # paused: the writer leaves it to uvicorn's send
        got = _unchunk(_body(_read_all(s)))
    n = app.seen["held_after"]
    assert 0 < n < 4096
    assert got == b"data: head\n\n" + b"".join(b"%08d" % k + BIG for k in range(n)) + b"%08d" % n + b"tail"


def test_a_client_that_leaves_ends_the_response(served):
    app, port = served
    app.seen.pop("closed", None)
    s = _get(port, "/endless", read=False)
    assert isinstance(s, socket.socket)
    with s:
        assert re.match(rb"HTTP/1.1 200", s.recv(4096))
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while not app.seen.get("closed"):
        assert time.monotonic() < deadline, "the body generator was not closed after the client left"
        time.sleep(0.05)


class _Transport:
    def __init__(self):
        self.wrote: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.wrote.append(data)


class _Flow:
    write_paused = False


class _Cycle:
    def __init__(self, **kw):
        self.flow, self.transport, self.scope = _Flow(), _Transport(), {"method": "POST"}
        self.disconnected, self.response_complete, self.response_started, self.chunked_encoding = (
            False,
            False,
            True,
            True,
        )
        for k, v in kw.items():
            setattr(self, k, v)


def test_the_writer_frames_a_chunk_or_leaves_it_to_the_asgi_send():
    ok = _Cycle()
    assert BodyWriter(ok)(b"data: a\n\n") and BodyWriter(ok)(b"")
    assert ok.transport.wrote == [b"9\r\ndata: a\n\n\r\n"]  # the empty chunk writes nothing (no "0" chunk)
    paused = _Cycle()
    paused.flow.write_paused = True
    cases = {
        "paused": paused,
        "gone": _Cycle(disconnected=True),
        "over": _Cycle(response_complete=True),
        "head not out": _Cycle(response_started=False),
        "content-length": _Cycle(chunked_encoding=False),
        "HEAD": _Cycle(scope={"method": "HEAD"}),
    }
    for why, cycle in cases.items():
        assert not BodyWriter(cycle)(b"x"), why
        assert cycle.transport.wrote == [], why


def test_the_writer_travels_as_none_and_only_a_writer_counts():
    scope = {"extensions": {BODY_WRITER: BodyWriter(_Cycle())}}
    assert body_writer(scope) is not None
    assert body_writer(pickle.loads(pickle.dumps(scope))) is None
    assert body_writer({}) is None and body_writer({"extensions": {BODY_WRITER: object()}}) is None


def test_a_cycle_without_uvicorns_fields_gets_no_writer():
    """attach offers a writer only to a cycle with every field the writer reads (uvicorn's httptools cycle): another
    server's, or a uvicorn that renamed one, keeps the ASGI send."""
    scope: dict = {}
    attach(scope, _Cycle())
    assert body_writer(scope) is not None
    for missing in ("flow", "disconnected", "response_complete", "response_started", "chunked_encoding", "transport"):
        cycle, scope = _Cycle(), {}
        delattr(cycle, missing)
        attach(scope, cycle)
        assert body_writer(scope) is None, missing
