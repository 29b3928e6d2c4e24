"""BatchedHistogram: once flushed, the histogram's exposition equals observing each value directly (buckets at their
bounds, the sum, the count); nothing reaches it before a flush unless `flush_s` has passed."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram

from engine.telemetry.batched_histogram import BatchedHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _pair():
    reg = CollectorRegistry()
    direct = Histogram("direct_seconds", "d", ("m",), buckets=BUCKETS, registry=reg).labels("x")
    batched = Histogram("batched_seconds", "b", ("m",), buckets=BUCKETS, registry=reg).labels("x")
    return reg, direct, batched


def _samples(reg: CollectorRegistry, name: str) -> dict:
    return {
        (s.name.replace(name, ""), tuple(sorted(s.labels.items()))): s.value
        for m in reg.collect()
        if m.name == name
        for s in m.samples
        if not s.name.endswith("_created")
    }


def test_flushed_equals_direct_observations():
    reg, direct, child = _pair()
    batched = BatchedHistogram(child, flush_s=3600)
    rng = random.Random(7)
    values = [rng.choice(BUCKETS) for _ in range(50)] + [rng.uniform(0, 2) for _ in range(500)] + [0.0, 5.0, -1.0]
    for i, v in enumerate(values):
        direct.observe(v)
        batched.observe(v, now=None if i % 2 else 0.0)
        if i % 97 == 0:
            batched.flush()
    batched.flush()
    batched.flush()  # nothing pending: no change
    want, got = _samples(reg, "direct_seconds"), _samples(reg, "batched_seconds")
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert abs(got[k] - v) < 1e-9, (k, got[k], v)


def test_held_until_flush_or_interval():
    reg, _, child = _pair()
    batched = BatchedHistogram(child, flush_s=1.0)
    batched.observe(0.02, now=batched._last + 0.5)
    assert _samples(reg, "batched_seconds")[("_count", (("m", "x"),))] == 0
    batched.observe(0.03, now=batched._last + 1.0)  # a second since the last flush: both go in
    assert _samples(reg, "batched_seconds")[("_count", (("m", "x"),))] == 2
    assert abs(_samples(reg, "batched_seconds")[("_sum", (("m", "x"),))] - 0.05) < 1e-12
