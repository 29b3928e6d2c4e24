"""A decode actor's running requests, read through its `stats` Ray method (tests that check nothing is left
running on a worker after streams end, are cancelled or are dropped)."""

from __future__ import annotations

import time


def running(decode) -> int:
    import ray

    return ray.get(decode.stats.remote()).load.running


def wait_idle(decode, timeout_s: float = 10.0) -> int:
    """Poll until the actor runs no request or timeout_s passes -> the count it runs then (0: idle)."""
    deadline = time.monotonic() + timeout_s
    while (left := running(decode)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
