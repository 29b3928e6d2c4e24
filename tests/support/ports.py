"""Free loopback ports for tests that start Ray / Serve / metrics servers."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free loopback port between Ray's worker ports (10002-19999) and the kernel's ephemeral range
    (32768+, where the local ends of Ray's many connections come from), so that nothing takes it between
    this check and the bind by the metrics server or Serve's proxy; a kernel-picked one as a last resort."""
    rng = random.Random()
    for _ in range(100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", rng.randrange(20000, 32768)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
