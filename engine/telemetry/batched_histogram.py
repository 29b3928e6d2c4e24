"""`BatchedHistogram`: a labelled Prometheus histogram observed on a hot path, counted locally and added in batches.

Why: the ingress replica observes the inter-token latency once a token. In multiprocess mode (the service's:
engine.telemetry.metrics) every `observe` takes the values' lock, asks the OS for the pid (a fork check) and writes
the sum and one bucket to the shared mmap file, twice each: ~2 us a token on the replica's event loop, where a
step's tokens of all its streams go out one after another (BENCHMARKS frontdoor's reading). Here an observation is a
bisect and two additions; `flush` adds what was counted since the last one to the real histogram's bucket and sum
values (one write per bucket that moved), on the caller's schedule (the replica: when a request ends, and during a
stream at most `flush_s` apart), so a scrape sees the observations at most that late.

The batch goes into the child's own bucket and sum values (prometheus_client's `_upper_bounds`, `_buckets`, `_sum`),
so the exposition is the histogram's as if each value had been observed (tests/engine/test_batched_histogram.py
compares them). A child without those attributes (another prometheus_client) is observed directly.
"""

from __future__ import annotations

import bisect
import math
import time


class BatchedHistogram:
    """`observe` counts locally; `flush` (or `observe` with `now` once `flush_s` has passed) adds to `child`.
    Single-threaded: observe and flush from one thread (the replica's event loop)."""

    def __init__(self, child, flush_s: float = 1.0):
        """child: a labelled prometheus_client Histogram (`Histogram(...).labels(...)`)."""
        self.child = child
        self.flush_s = flush_s
        bounds, self._values, self._sum_value = (
            getattr(child, "_upper_bounds", None),
            getattr(child, "_buckets", None),
            getattr(child, "_sum", None),
        )
        self._direct = bounds is None or self._values is None or self._sum_value is None
        self._bounds: list[float] = list(bounds or ())
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = False
        self._last = time.monotonic()

    def observe(self, amount: float, now: float | None = None) -> None:
        """Count `amount` (seconds); `now` (time.monotonic()): flush if the last flush is `flush_s` old."""
        if self._direct or math.isnan(amount):  # NaN: no bucket takes it; the histogram's own observe decides
            self.child.observe(amount)
            return
        # the first bound >= amount: the bucket prometheus_client's observe increments (`amount <= bound`)
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        self._sum += amount
        self._pending = True
        if now is not None and now - self._last >= self.flush_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Add what was observed since the last flush to the histogram."""
        self._last = time.monotonic() if now is None else now
        if not self._pending:
            return
        assert self._values is not None and self._sum_value is not None
        counts = self._counts
        for i, n in enumerate(counts):
            if n:
                self._values[i].inc(n)
                counts[i] = 0
        self._sum_value.inc(self._sum)
        self._sum = 0.0
        self._pending = False
