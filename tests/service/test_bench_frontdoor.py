"""`dsv4 bench frontdoor` at a tiny size: real Ray, HAProxy (Serve's HAProxy mode), ingress replicas streaming from the synthetic decode
actors and two routers placing; every stream's tokens arrive in order with none lost, and the report has its
fields."""

from __future__ import annotations

import argparse
import json

import pytest

from service.bench_frontdoor import add_bench_frontdoor_args, bench_frontdoor_main
from service.frontdoor_load import tag_prompt
from service.frontdoor_report import report
from service.serve_front import HAPROXY_SERVE_ENV, REPLICA_SERVE_ENV
from tests.support.ports import free_port

pytestmark = pytest.mark.ray


def test_tag_prompts_are_unique():
    assert len({tuple(tag_prompt(n, 68)) for n in range(2000)}) == 2000


def test_frontdoor_tiny(tmp_path):
    p = argparse.ArgumentParser()
    add_bench_frontdoor_args(p)
    out = tmp_path / "rows.json"
    args = p.parse_args(
        [
            "--replicas",
            "1,2",
            "--streams",
            "2,4",
            "--seconds",
            "2",
            "--max-tokens",
            "12",
            "--growth",
            "-1",
            "--port",
            str(free_port()),
            "--json",
            str(out),
            "--repeat",
            "2",
            "--warmup-seconds",
            "1",
        ]
    )
    assert bench_frontdoor_main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["replicas"], r["streams"]) for r in rows] == [(1, 2), (1, 4), (2, 2), (2, 4)]
    for r in rows:
        # the median of the two runs' p99s; the second run ran the first one's levels
        assert len(r["p99_runs"]) == 2 and r["added_ms_p99"] == pytest.approx(sum(r["p99_runs"]) / 2)
        assert r["requests"] > 0 and r["tokens"] == 12 * r["requests"]
        assert r["lost_tokens"] == 0 and r["out_of_order"] == 0 and r["errors"] == 0
        assert r["delivered_tps"] > 0 and 0 < r["added_ms_p50"] <= r["added_ms_p99"] < 5000
        assert r["cpu_ms_per_1k"] > 0 and r["cpu_by_component"].get("router", 0) > 0
        assert r["cpu_by_component"].get("ingress", 0) > 0
        # the Serve switches deploy_http sets reached HAProxy's manager and the replicas (service.serve_front)
        assert r["haproxy"] and r["cpu_by_component"].get("haproxy", 0) > 0
        assert r["serve_env"]["haproxy"].items() >= HAPROXY_SERVE_ENV.items()
        assert r["serve_env"]["ingress"].items() >= {**REPLICA_SERVE_ENV, **HAPROXY_SERVE_ENV}.items()
    from service.frontdoor_report import LevelResult

    text = report([LevelResult(**r) for r in rows], args, "dsv4 bench frontdoor --tiny")
    assert "`Place`" in text and "AFTER" in text and "Ceiling" in text and "| 2 | 4 |" in text
    assert all(r["token_feed"] for r in rows) and "`DSV4_TOKEN_FEED=1`" in text  # the default: the token feeds
    assert all(r["feed_transport"] == "tcp" for r in rows) and "`DSV4_TOKEN_FEED_TRANSPORT=tcp`" in text
    # the default: prefills over the prefill actor's link once it is up (the first requests of a replica: Ray)
    assert all(r["prefill_feed"] for r in rows) and "`DSV4_PREFILL_FEED=1`" in text
    assert all(0 < r["link_prefills"] <= r["requests"] for r in rows[1:2] + rows[3:])
    # ... and so do the Place calls over the routers' place links (DSV4_PLACE_LINK, the default)
    assert all(0 < r["link_places"] <= r["requests"] for r in rows[1:2] + rows[3:])
    ab = report([LevelResult(**r) for r in rows], args, "dsv4 bench frontdoor --tiny", [LevelResult(**rows[0])])
    assert "A/B, same session" in ab and "carried by tcp" in ab
    assert "at half the ceiling" in text and "at exactly half the ceiling" in text
    assert "swept 2 times" in text and "each run |" in text
    assert "untimed warm-up level (1 s at 2 streams" in text
    assert "; haproxy RAY_SERVE_ENABLE_HA_PROXY=1" in text and "`DSV4_HAPROXY=1`" in text
