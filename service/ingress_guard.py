"""What keeps one HTTP request from taking the ingress down: options, body limit, API key, text checks,
and the thread pool that user-sized work (tokenising, chat templates) runs on instead of the event loop.

- `IngressOptions`: the ingress's hardening settings (frozen; travel to the Serve replicas through Ray).
- `GuardMiddleware` (pure ASGI, outermost): a request body over `max_body_bytes` is refused with 413 before it
  is buffered (Content-Length) or as soon as the streamed body passes the limit; headers over the limit of
  `limits` are a 413 and a body that takes longer than its `body_timeout_s` a 408 (service.http_limits, which
  also enforces them at the socket of Serve's proxy, where a slow head is timed too); with an `api_key`, every
  `/v1/` route needs `Authorization: Bearer <key>` (401 shaped as OpenAI's, compared in constant time).
- `lone_surrogate(value)`: JSON may carry "\\ud800" escapes that decode to strings no tokenizer (or UTF-8
  encoder) accepts; the request is a 400 naming the field instead of a 500 deep inside the tokenizer.
- `Offloader`: a small bounded thread pool. The `tokenizers` encode/decode calls release the GIL; template
  rendering is Python, but in a thread it only shares the GIL, so the loop keeps answering (/health included)
  and a template that runs away is stopped by its time budget (service/template_sandbox.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dsv4_kernels.settings import settings
from service.http_limits import HttpLimits

DEFAULT_MAX_BODY_BYTES = 32 << 20  # 32 MiB: far beyond any prompt that fits a context, far below memory
_CLOSE = [(b"connection", b"close")]  # after a refused head or body the connection's state is unknown


@dataclass(frozen=True)
class IngressOptions:
    api_key: str | None = None  # None: the OpenAI routes are open (loopback default)
    router_token: str | None = None  # the per-cluster token the router requires (router/auth.py)
    # where the replica's own internal listener (its TCP token feeds', service.tcp_feed) binds: "127.0.0.1", "node"
    # (this node's cluster address); None: service.ray_cluster.internal_host() asked on the replica
    internal_host: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allow_request_templates: bool = False  # request-supplied `chat_template` (vLLM: --trust-request-chat-template)
    template_budget_s: float = 2.0  # wall time a request-supplied template may render for
    offload_threads: int = 4  # threads that tokenise and render
    max_model_len: int | None = None  # the workers' --max-model-len (None: the model's own context)
    limits: HttpLimits = field(default_factory=HttpLimits.from_env)  # header size, header / body time

    def __post_init__(self):
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.template_budget_s <= 0 or self.offload_threads < 1:
            raise ValueError(
                f"template_budget_s must be > 0 and offload_threads >= 1, got {self.template_budget_s}, "
                f"{self.offload_threads}"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string or None")

    @classmethod
    def from_env(cls, **kw) -> IngressOptions:
        """`DSV4_API_KEY` fills api_key when it is not given."""
        if kw.get("api_key") is None and settings().api_key:
            kw["api_key"] = settings().api_key
        return cls(**kw)


def _json(status: int, body: dict, headers: list | None = None) -> tuple[dict, dict]:
    data = json.dumps(body).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            *(headers or []),
        ],
    }
    return start, {"type": "http.response.body", "body": data}


class GuardMiddleware:
    """ASGI middleware; `options()` and `error_body(status, message, param)` are looked up per request."""

    def __init__(self, app, options, error_body):
        self.app, self.options, self.error_body = app, options, error_body

    async def _send_error(self, send, status: int, message: str, headers: list | None = None) -> None:
        for msg in _json(status, self.error_body(status, message, None), headers):
            await send(msg)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            opts = self.options()
        except RuntimeError:  # not configured yet: let the app answer (its routes say so)
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if opts.api_key and scope["path"].startswith("/v1/"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), opts.api_key.encode()):
                return await self._send_error(
                    send,
                    401,
                    "Incorrect API key provided. Pass it as "
                    "`Authorization: Bearer <key>` (the server's --api-key / DSV4_API_KEY).",
                    [(b"www-authenticate", b"Bearer")],
                )
        head = opts.limits.header_bytes(scope)
        if head > opts.limits.max_header_bytes:
            return await self._send_error(send, 413, opts.limits.too_large(head), _CLOSE)
        limit = opts.max_body_bytes
        try:
            length = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            length = 0
        if length > limit:
            return await self._send_error(
                send, 413, f"request body of {length} bytes exceeds the limit of {limit} bytes"
            )
        seen, started, refused, body_done = 0, False, False, False
        body_deadline = asyncio.get_running_loop().time() + opts.limits.body_timeout_s

        async def limited_receive():
            # Past a limit: answer 413 / 408 now and tell the app the client left (FastAPI turns any exception
            # raised while reading the body into its own 400, so an exception cannot carry the status).
            nonlocal seen, refused, body_done
            if refused:
                return {"type": "http.disconnect"}
            try:
                if body_done:  # what follows the body is the disconnect, however long the response takes
                    msg = await receive()
                else:
                    async with asyncio.timeout_at(body_deadline):
                        msg = await receive()
            except TimeoutError:
                refused = True
                if not started:
                    await self._send_error(send, 408, opts.limits.slow_body(), _CLOSE)
                return {"type": "http.disconnect"}
            except Exception as e:
                # Ray Serve cancels a request whose client went away, and its receive() then raises
                # TaskCancelledError: that is the ASGI disconnect the app knows how to end on (streams close
                # their router calls) rather than an error escaping into "Task exception was never retrieved".
                if type(e).__name__ == "TaskCancelledError":
                    return {"type": "http.disconnect"}
                raise
            if msg["type"] == "http.request":
                body_done = not msg.get("more_body", False)
                seen += len(msg.get("body", b""))
                if seen > limit and not started:
                    refused = True
                    await self._send_error(send, 413, f"request body exceeds the limit of {limit} bytes")
                    return {"type": "http.disconnect"}
            return msg

        async def tracking_send(msg):
            nonlocal started
            if refused:
                return  # the 413 is already out: whatever the app answers goes nowhere
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, limited_receive, tracking_send)


def lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string in a JSON-like value holding a lone UTF-16 surrogate, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items: Iterable[tuple[object, object]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        found = lone_surrogate(v, f"{path}.{k}" if path and isinstance(k, str) else f"{path}[{k}]" if path else str(k))
        if found:
            return found
    return None


class Offloader:
    """Run user-sized work off the event loop on a bounded pool (requests beyond its threads queue)."""

    def __init__(self, threads: int):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dsv4-ingress")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
