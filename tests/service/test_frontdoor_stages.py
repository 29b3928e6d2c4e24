"""`python -m benchmarks.frontdoor_stages` at a tiny size on a real local Ray: every item read in both modes and over a
token feed, a cost for every stage."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_frontdoor_stages_tiny(capsys):
    from benchmarks.frontdoor_stages import main

    rows = main(["--streams", "2", "--items", "10", "--rate", "500", "--rounds", "1", "--render-calls", "50"])
    assert [r.stage.split(",")[0] for r in rows] == [
        "Ray item",
        "Ray item",
        "token over a feed (2 requests an item)",
        "SSE chunk",
        "SSE chunk",
        "SSE chunk",
        "SSE chunk",
        "TextStream.add (one token)",
    ]
    assert all(r.us_per_call > 0 for r in rows)
    assert all(r.producer_us_per_call is not None and r.producer_us_per_call >= 0 for r in rows[:3])
    assert "| Ray item, next_item (1 fetch) | 20 |" in capsys.readouterr().out
