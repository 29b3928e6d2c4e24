"""How much, and how slowly, a client may send before the HTTP ingress answers: header size, header and body time.

Without these bounds a client holds the ingress with headers (Serve's proxy buffered a 64 MiB header: 144 MB ->
1.39 GB, /health stalled 17.5 s) or with connections that trickle their headers or body (50 of them were never
timed out). `HttpLimits` (frozen, from the `http_*` switches of dsv4_kernels.settings) holds the three bounds; they are
enforced in two places, with the same answers (the OpenAI error JSON, `Connection: close`):

- At the socket, in Ray Serve's HTTP proxy: Serve starts its uvicorn server itself and passes only host, port,
  root path, keep-alive and TLS (ray.serve._private.http_util.start_asgi_http_server), so none of uvicorn's own
  settings can be given to it, and uvicorn's httptools protocol has no header limit or header/body timeout
  anyway. What Serve does offer is a proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, run in every
  proxy process before its server starts): `proxy_callback` registers `GuardedHttpToolsProtocol` as uvicorn's
  "auto" protocol there (in an ingress replica serving HTTP itself too: Serve runs the callback there; it also
  offers each request a service.body_writer.BodyWriter in its scope). It counts the bytes of a request's head as
  they arrive (413 past `max_header_bytes`, before more is buffered), and times the head from the connection's
  (or request's) first byte (408 after `header_timeout_s`) and the body from the end of the head (408 after
  `body_timeout_s`). `proxy_env` is the
  environment that installs it: `dsv4 serve` gives it to the Serve controller (its proxies inherit it), the
  chart sets it on every pod.
- In our ASGI layer (service.ingress_guard.GuardMiddleware, in each ingress replica): the same header size and
  body time, for a proxy started without the callback (a Ray cluster set up by hand) and for plain uvicorn. A
  slow head cannot be timed there: an ASGI app is called only once the head is complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from dsv4_kernels.settings import (
    HTTP_BODY_TIMEOUT_S,
    HTTP_HEADER_TIMEOUT_S,
    HTTP_MAX_HEADER_BYTES,
    settings,
)
from service.body_writer import attach

log = logging.getLogger(__name__)

PROXY_CALLBACK_VAR = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "service.http_limits:proxy_callback"
_REASONS = {408: b"Request Timeout", 413: b"Request Entity Too Large"}
_ERROR_TYPES = {408: "TimeoutError", 413: "RequestTooLargeError"}


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 << 10  # request line + headers; browsers and proxies stay well under 16 KiB
    header_timeout_s: float = 10.0  # from the first byte of a request (or the connection) to the end of its head
    body_timeout_s: float = 60.0  # from the end of the head to the end of the body (32 MiB at ~0.5 MB/s)

    def __post_init__(self):
        if isinstance(self.max_header_bytes, bool) or not isinstance(self.max_header_bytes, int):
            raise ValueError(f"max_header_bytes must be an int, got {self.max_header_bytes!r}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls) -> HttpLimits:
        s = settings()
        return cls(
            max_header_bytes=s.http_max_header_bytes,
            header_timeout_s=s.http_header_timeout_s,
            body_timeout_s=s.http_body_timeout_s,
        )

    def env(self) -> dict[str, str]:
        """These limits as the environment `from_env` reads (for a process started elsewhere: Serve's proxy)."""
        return {
            HTTP_MAX_HEADER_BYTES: str(self.max_header_bytes),
            HTTP_HEADER_TIMEOUT_S: repr(self.header_timeout_s),
            HTTP_BODY_TIMEOUT_S: repr(self.body_timeout_s),
        }

    def header_bytes(self, scope: dict) -> int:
        """The size of an ASGI request's head as it came in (request line and headers, near enough)."""
        line = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
        return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or ())

    def too_large(self, size: int) -> str:
        return f"request headers of {size} bytes or more exceed the limit of {self.max_header_bytes} bytes"

    def slow_head(self) -> str:
        return f"request headers not received within {self.header_timeout_s:g} s"

    def slow_body(self) -> str:
        return f"request body not received within {self.body_timeout_s:g} s"


def proxy_env(limits: HttpLimits) -> dict[str, str]:
    """The environment of a Serve proxy process that enforces `limits` at its socket (see the module doc)."""
    return {PROXY_CALLBACK_VAR: PROXY_CALLBACK, **limits.env()}


def error_json(status: int, message: str) -> bytes:
    """OpenAI's error body (service.openai_protocol.error_body) without importing the API models here."""
    error = {"message": message, "type": _ERROR_TYPES[status], "param": None, "code": status}
    return json.dumps({"error": error}).encode()


def raw_response(status: int, message: str) -> bytes:
    body = error_json(status, message)
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (
        status,
        _REASONS[status],
        len(body),
    )
    return head + body


def guarded(limits: HttpLimits) -> type:
    """uvicorn's HttpToolsProtocol enforcing `limits` (the module doc); `uvicorn.Config(http=...)` takes it."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        limits: HttpLimits
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._in_head, self._head_bytes, self._timer = True, 0, None
            self._arm(self.limits.header_timeout_s, 408, self.limits.slow_head())  # a silent connection too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                if self._head_bytes == 0 and self._timer is None:  # a keep-alive connection's next request
                    self._arm(self.limits.header_timeout_s, 408, self.limits.slow_head())
                self._head_bytes += len(data)
            super().data_received(data)  # may end the head (on_headers_complete) within this chunk
            if self._in_head and self._head_bytes > self.limits.max_header_bytes:
                self._refuse(413, self.limits.too_large(self._head_bytes))

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._arm(self.limits.body_timeout_s, 408, self.limits.slow_body())
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not before:  # the request's cycle (none for an upgrade): its body writer in its scope
                attach(self.cycle.scope, self.cycle)

        def on_message_complete(self) -> None:
            self._disarm()
            self._in_head = True  # the next request's head; timed from its first byte
            super().on_message_complete()

        def _arm(self, seconds: float, status: int, message: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._refuse, status, message)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _refuse(self, status: int, message: str) -> None:
            """Answer `status` unless a response has begun, then close; the app sees the client leave."""
            self._disarm()
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or not cycle.response_started:
                self.transport.write(raw_response(status, message))
            if cycle is not None:
                cycle.disconnected = True  # whatever the app sends now goes nowhere
                cycle.message_event.set()
            log.warning("HTTP %d to %s: %s", status, self.client, message)
            self.transport.close()

    GuardedHttpToolsProtocol.limits = limits
    return GuardedHttpToolsProtocol


proxy_protocol: type | None = None  # the class proxy_callback made uvicorn's "auto" protocol (None: not here)


def proxy_callback() -> list:
    """Serve's proxy callback (PROXY_CALLBACK): make the guarded protocol uvicorn's "auto" one in this process,
    with the limits of this process's environment; no middlewares (-> []). Also freezes what the proxy has loaded so
    far out of the collector's reach (as the ingress replicas do, service.serve_ingress: a full collection walking
    it stalls every stream going through this proxy)."""
    from uvicorn import config

    from engine.runtime import gc_pauses

    gc_pauses.freeze_startup_heap("proxy")
    gc_pauses.watch_pauses("proxy")

    try:
        import httptools  # noqa: F401 - uvicorn's "auto" would run h11 without it
    except ImportError:  # httptools missing: uvicorn runs h11, whose head limit (16 KiB) answers a plain 400
        log.warning("httptools is not installed: the HTTP proxy runs without header timeouts")
        return []
    global proxy_protocol
    limits = HttpLimits.from_env()
    proxy_protocol = guarded(limits)
    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:proxy_protocol"  # Serve's uvicorn.Config keeps http="auto"
    log.info("HTTP proxy limits: %s", limits)
    return []
