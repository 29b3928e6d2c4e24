"""A real uvicorn server on a free loopback port, run in a daemon thread (the HTTP tests that speak raw sockets or
the official client to it: test_http_limits, test_body_writer)."""

from __future__ import annotations

import threading
import time

import uvicorn

from tests.support.ports import free_port


def serve_in_thread(app, **config) -> tuple[uvicorn.Server, int]:
    """Start uvicorn with `app` on 127.0.0.1 (config: more uvicorn.Config keywords, e.g. http=) -> (the server, its
    port) once it accepts connections; `server.should_exit = True` stops it."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", **config)
    )
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    return server, port
