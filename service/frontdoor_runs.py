"""`dsv4 bench frontdoor --repeat N`: the same levels swept N times, merged into one row a level, and the added
latency read at exactly half the ceiling.

Why: on a small shared machine one level's p99 moves by 2x between back-to-back sweeps of the same code (the tail
is a few hundred tokens of a 6 s window, and any other process's burst lands in it), so one sweep cannot say
whether a change moved the tail. A merged row holds the median of each rate and latency over the runs, every run's
p99 beside it, and the counts of lost / out-of-order tokens and errors summed (one loss in any run shows).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from typing import Any

_MEDIANS = (
    "offered_tps",
    "delivered_tps",
    "added_ms_p50",
    "added_ms_p99",
    "cpu_ms_per_1k",
    "load_avg",
    "client_lag_ms_p99",
    "added_ms_p99_seen",
    "step_lag_ms_p99",
)
_SUMS = ("requests", "tokens", "lost_tokens", "out_of_order", "errors", "link_prefills", "link_places")


def merge_runs(runs: list[list[Any]]) -> list[Any]:
    """Sweeps of the same levels (LevelResult rows, in the first sweep's order) -> one row a level: medians of the
    rates, latencies, CPU and loads; sums of the counts; `p99_runs` every run's p99. One sweep is returned as is."""
    if len(runs) == 1:
        return runs[0]
    merged = []
    for first in runs[0]:
        same = [r for run in runs for r in run if (r.replicas, r.streams) == (first.replicas, first.streams)]
        values: dict[str, Any] = {f: statistics.median(getattr(r, f) for r in same) for f in _MEDIANS}
        values |= {f: sum(getattr(r, f) for r in same) for f in _SUMS}
        keys = {k for r in same for k in r.cpu_by_component}
        values["cpu_by_component"] = {
            k: statistics.median(r.cpu_by_component.get(k, 0.0) for r in same) for k in sorted(keys)
        }
        values["p99_runs"] = tuple(r.added_ms_p99 for r in same)
        kinds: Counter = Counter()
        for r in same:
            kinds.update(r.error_kinds)
        values["error_kinds"] = dict(kinds.most_common(3))
        merged.append(dataclasses.replace(first, **values))
    return merged


def p99_at(rows: list[Any], tps: float) -> float:
    """The added-latency p99 at `tps` delivered tokens/s, linear between the two levels around it (rows of one
    replica count); the nearest level's outside them."""
    pts = sorted((r.delivered_tps, r.added_ms_p99) for r in rows)
    if tps <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= tps <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (tps - x0) / (x1 - x0)
    return pts[-1][1]
