"""HTTP read limits (service.http_limits) over raw sockets against real uvicorn servers running the OpenAI app:

- the guarded httptools protocol (what Serve's proxy runs once `proxy_callback` installed it): a head over
  `max_header_bytes` is a 413 before the rest is read, a head or body that does not arrive in time a 408, a
  connection that never sends a byte is closed with a 408, and a normal keep-alive connection is not cut;
- the ASGI layer alone (GuardMiddleware under uvicorn's h11 protocol, allowed big heads): the same 413 and the
  body 408, for a proxy that runs without the callback.
Every refusal is OpenAI's error JSON with `Connection: close`. The router is never reached (none runs here).
The Serve proxy itself is checked in tests/service/test_service_faults.py.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from engine.loading.make_model import default_model_dir  # noqa: E402
from service import openai_protocol as P  # noqa: E402
from service.http_limits import HttpLimits, error_json, guarded, proxy_callback, proxy_env  # noqa: E402
from service.ingress_guard import IngressOptions  # noqa: E402
from service.openai_app import build_app  # noqa: E402
from tests.support.uvicorn_server import serve_in_thread  # noqa: E402

LIMITS = HttpLimits(max_header_bytes=8192, header_timeout_s=1.0, body_timeout_s=1.0)


def _serve(http) -> tuple[uvicorn.Server, int]:
    app = build_app("127.0.0.1:1", default_model_dir(), "dsv4", options=IngressOptions(limits=LIMITS))
    kw = {"h11_max_incomplete_event_size": 1 << 20} if http == "h11" else {}
    return serve_in_thread(app, http=http, **kw)


@pytest.fixture(scope="module")
def guarded_port():
    srv, port = _serve(guarded(LIMITS))
    yield port
    srv.should_exit = True


@pytest.fixture(scope="module")
def asgi_only_port():
    srv, port = _serve("h11")
    yield port
    srv.should_exit = True


@pytest.fixture(params=["guarded", "asgi_only"])
def server(request):
    return request.param, request.getfixturevalue(f"{request.param}_port")


def exchange(port: int, *parts: bytes, pause: float = 0.0, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send `parts` (pausing between them), then read until the server closes; -> (what came back, seconds from
    the last part sent to the close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        for p in parts:
            try:
                s.sendall(p)
            except (BrokenPipeError, ConnectionResetError):  # refused mid-send: read the answer
                break
            time.sleep(pause)
        t0, out = time.monotonic(), b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out, time.monotonic() - t0


def parse(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_error_json_is_the_api_error_shape():
    for status in (408, 413):
        assert json.loads(error_json(status, "m")) == P.error_body(status, "m")


def test_limits_validate_and_travel_through_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="max_header_bytes must be at least 1024, got 10"):
        HttpLimits(max_header_bytes=10)
    with pytest.raises(ValueError, match="body_timeout_s must be > 0 seconds, got 0"):
        HttpLimits(body_timeout_s=0)
    env = proxy_env(LIMITS)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert HttpLimits.from_env() == LIMITS
    from uvicorn import config

    saved = config.HTTP_PROTOCOLS["auto"]
    try:
        assert proxy_callback() == []  # what Serve's proxy calls: the protocol is registered, no middleware
        cls = config.HTTP_PROTOCOLS["auto"]
        assert cls == "service.http_limits:proxy_protocol"
        from service import http_limits

        assert http_limits.proxy_protocol is not None and http_limits.proxy_protocol.limits == LIMITS
    finally:
        config.HTTP_PROTOCOLS["auto"] = saved


def test_oversized_head_is_413(server):
    kind, port = server
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n"
    raw, _ = exchange(port, *(head[i : i + 65536] for i in range(0, len(head), 65536)))
    status, headers, body = parse(raw)
    assert status == 413 and headers["connection"] == "close", raw[:300]
    assert body["error"]["type"] == "RequestTooLargeError" and "limit of 8192 bytes" in body["error"]["message"]


def test_slow_body_is_408(server):
    kind, port = server
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    raw, waited = exchange(port, head, b'{"prompt": ')
    status, headers, body = parse(raw)
    assert status == 408 and headers["connection"] == "close", raw[:300]
    assert body["error"]["message"] == "request body not received within 1 s"
    assert waited < 5


def test_slow_or_silent_head_is_408_at_the_socket(guarded_port):
    # (not in the ASGI layer: an ASGI app is called only once the head is complete)
    port = guarded_port
    t0 = time.monotonic()
    raw, _ = exchange(port, b"GET /health HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: b\r\n", pause=0.4)
    status, _, body = parse(raw)
    assert status == 408 and body["error"]["message"] == "request headers not received within 1 s", raw
    assert time.monotonic() - t0 < 5
    raw, waited = exchange(port)  # connects, never sends
    assert parse(raw)[0] == 408 and waited < 5


def test_keep_alive_connection_is_not_cut_between_requests(server):
    kind, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for _ in range(2):
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            got = s.recv(65536)
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
            time.sleep(1.2)  # longer than the head and body timeouts: idle is keep-alive's business
