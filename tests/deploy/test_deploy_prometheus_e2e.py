"""Observability end to end: a real Prometheus (Debian's package) scrapes a live `dsv4 serve` on loopback
every second with the alert rules loaded; after real traffic, every dashboard query (variables on "All",
$__rate_interval = 1m) is evaluated through Prometheus's HTTP API and must return data, every variable
must list values, and every alert rule must evaluate without error.
"""

import math
import time

import pytest
import yaml

from tests.support.deploy_fixtures import (
    RULES_FILE,
    PrometheusServer,
    live_service,
    panel_queries,
    substitute,
    variable_queries,
)

LABELS = {"namespace": "dsv4-e2e", "pod": "dsv4-head-0", "container": "ray-head"}  # what a PodMonitor adds


@pytest.fixture(scope="module")
def dsv4_service(request):
    yield from live_service(request)


@pytest.fixture(scope="module")
def prometheus(dsv4_service):
    prom = PrometheusServer(f"127.0.0.1:{dsv4_service.metrics_port}", [RULES_FILE], LABELS)
    try:
        prom.start()
        prom.wait_for('up{job="dsv4"} == 1', lambda r: len(r) == 1)
        # Traffic only once Prometheus has a sample of every counter, so the rates over the window move.
        prom.wait_for("count(dsv4_running_requests)", lambda r: len(r) == 1)
        time.sleep(1.5)
        for _ in range(2):
            dsv4_service.traffic()
            time.sleep(1.0)
        total = sum(
            float(line.split()[-1])
            for line in dsv4_service.scrape().splitlines()
            if line.startswith("dsv4_requests_total{")
        )
        prom.wait_for("sum(dsv4_requests_total)", lambda r: r and float(r[0]["value"][1]) >= total)
        yield prom
    finally:
        prom.stop()


# Panels of a feature the live service does not run: speculative decoding needs a checkpoint with an MTP layer and
# `--speculative-tokens`, which the shared tiny service has not (their metric names are still checked against the
# exporter by tests/deploy/test_deploy_dashboards.py; tests/engine/test_speculative.py counts them).
NOT_RUN_BY_THE_LIVE_SERVICE = ("dsv4_spec_",)


def test_every_dashboard_query_returns_data(prometheus):
    empty, nan = [], []
    for dashboard, title, expr in panel_queries():
        if any(prefix in expr for prefix in NOT_RUN_BY_THE_LIVE_SERVICE):
            continue
        result = prometheus.query(substitute(expr, rate_interval="1m"))
        values = [float(r["value"][1]) for r in result]
        if not values:
            empty.append(f"{dashboard}: {title}: {expr}")
        elif not any(math.isfinite(v) for v in values):
            nan.append(f"{dashboard}: {title}: {expr} -> {values}")
    assert not empty, "no data:\n" + "\n".join(empty)
    assert not nan, "only NaN/Inf:\n" + "\n".join(nan)


def test_every_variable_lists_values(prometheus):
    for dashboard, name, selector, label in variable_queries():
        values = prometheus.api(f"label/{label}/values", **{"match[]": substitute(selector)})
        assert values, f"{dashboard}: variable {name} lists nothing"
    assert prometheus.api("label/namespace/values", **{"match[]": "dsv4_requests_total"}) == [LABELS["namespace"]]


def test_alert_rules_evaluate_cleanly(prometheus):
    deadline = time.monotonic() + 20
    while True:
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        if rules and all(not r.get("lastEvaluation", "0001").startswith("0001") for r in rules):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    with open(RULES_FILE) as f:
        want = [r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(want)  # every alert of the chart's rule file loaded
    for rule in rules:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
