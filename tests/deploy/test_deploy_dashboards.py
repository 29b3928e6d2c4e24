"""Grafana dashboards (deploy/grafana) and the alert rules, checked against the real service: every
dashboard is the generator's output and follows the conventions (a datasource variable and no datasource
uid, namespace/model/role/worker variables, quantiles of rates of buckets over $__rate_interval, every
counter under rate()); every PromQL expression parses (promql-parser) and names only metrics that a live
`dsv4 serve` exports (read from its /metrics after real traffic); every metric the product code defines
is on some panel; `promtool check metrics` lints that scrape.
"""

import ast
import importlib
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.deploy_fixtures import (
    GRAFANA,
    REPO,
    dashboards,
    debian_tool,
    event_only_samples,
    live_service,
    metric_names,
    panel_queries,
    rule_queries,
    sample_names,
    substitute,
    variable_queries,
)

VARIABLES = {"datasource", "namespace", "model", "role", "worker"}
COUNTERISH = ("_total", "_sum", "_count", "_bucket")


@pytest.fixture(scope="module")
def dsv4_service(request):
    yield from live_service(request)


def all_queries() -> list[tuple[str, str]]:
    out = [(f"{d}: {title}", expr) for d, title, expr in panel_queries()]
    out += [(f"{d}: variable {name}", selector) for d, name, selector, _ in variable_queries()]
    out += [(f"rule {name}", expr) for name, expr in rule_queries()]
    return out


def test_dashboards_are_the_generator_output():
    spec = importlib.util.spec_from_file_location("dsv4_dashboards", os.path.join(GRAFANA, "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, text in module.render().items():
        with open(os.path.join(GRAFANA, name)) as f:
            assert f.read() == text, f"{name} is stale: run python deploy/grafana/generate.py"


def datasources(node):
    """Every `datasource` value anywhere in a dashboard."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "datasource":
                yield v
            yield from datasources(v)
    elif isinstance(node, list):
        for v in node:
            yield from datasources(v)


def test_dashboard_conventions():
    boards = dashboards()
    assert len(boards) == 3
    for name, d in boards.items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert VARIABLES <= variables.keys(), name
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        for ds in datasources(d):
            assert ds == {"type": "prometheus", "uid": "${datasource}"}, (name, ds)
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)) and all(p["targets"] for p in d["panels"])
    titles = " ".join(p["title"] for d in boards.values() for p in d["panels"]).lower()
    for wanted in (
        "status",
        "error ratio",
        "time to first token",
        "inter-token",
        "end-to-end",
        "queue",
        "prefill",
        "kv transfer",
        "decode",
        "gb/s",
        "failures",
        "kv-cache usage",
        "prefix-cache hit",
        "router",
        "tokens per second",
        "token throughput",
        "pool size",
        "pool scale decisions",
        "hand-off exposed",
        "streamed kv chunks",
        "paused by specgate",
        "fast paths",
        "kernel compiles",
    ):
        assert wanted in titles, wanted


def shape_problems(expr: str) -> list[str]:
    """Counter-like selectors outside rate(), ranges other than $__rate_interval, quantiles that are not
    histogram_quantile(q, sum by (le, ...) (rate(X_bucket[...])))."""
    import promql_parser as pp

    problems, stack = [], []

    def pre(node):
        stack.append(node)
        if isinstance(node, pp.VectorSelector) and node.name.endswith(COUNTERISH):
            calls = [n.func.name for n in stack if isinstance(n, pp.Call)]
            if "rate" not in calls:
                problems.append(f"{node.name} outside rate()")
        if isinstance(node, pp.Call) and node.func.name == "histogram_quantile":
            agg = node.args[1]
            inner = agg.expr if isinstance(agg, pp.AggregateExpr) else None
            if (
                inner is None
                or "le" not in (agg.modifier.labels if agg.modifier else [])
                or not (isinstance(inner, pp.Call) and inner.func.name == "rate")
            ):
                problems.append(f"quantile not over sum by (le) (rate(...)): {node}")

    def post(node):
        stack.pop()

    pp.walk(pp.parse(substitute(expr)), pre, post)
    return problems


def test_every_query_parses_and_is_well_formed():
    pytest.importorskip("promql_parser", reason="promql-parser is missing: pip install -e '.[test]'")
    for _, expr in all_queries():
        metric_names(substitute(expr))  # raises on a syntax error
    for where, expr in [(f"{d}: {t}", e) for d, t, e in panel_queries()]:
        assert shape_problems(expr) == [], where
        ranges = [part.split("]")[0] for part in expr.split("[")[1:]]
        assert set(ranges) <= {"$__rate_interval"}, where


def test_queries_name_only_exported_metrics(dsv4_service):
    statuses = dsv4_service.traffic()
    assert statuses.get(200) == 6 and sum(statuses.values()) == 8, statuses
    exported = {n for n in sample_names(dsv4_service.scrape()) if n.startswith("dsv4_")}
    referenced = set()
    for where, expr in all_queries():
        names = metric_names(substitute(expr))
        assert names and all(n.startswith("dsv4_") for n in names), where
        referenced |= names
    unseen = referenced - exported
    # A labelled counter has no sample before its first event (a failed KV transfer, say): allowed only if
    # the service declares it; everything else must be in the live scrape.
    assert unseen <= event_only_samples(), f"not exported by dsv4 serve: {sorted(unseen - event_only_samples())}"
    assert len(referenced & exported) >= 20, sorted(referenced & exported)


PRODUCT_PACKAGES = ("dsv4_kernels", "engine", "kv_transfer", "prefill_worker", "decode_worker", "router", "service")
METRIC_TYPES = ("Counter", "Gauge", "Histogram", "Summary", "Info", "Enum")  # prometheus_client's, however imported
SERIES_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_info")


def defined_metrics() -> dict[str, str]:
    """Metric name -> module of every `Counter("dsv4_...", ...)` (or Gauge, Histogram, ...) call in the product
    packages, read with `ast` (a metric defined anywhere, not only in engine.telemetry.metrics)."""
    out = {}
    for pkg in PRODUCT_PACKAGES:
        for path in sorted((Path(REPO) / pkg).rglob("*.py")):
            if "_gen" in path.parts:
                continue
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                name = node.args[0]
                if (
                    func.endswith(METRIC_TYPES)
                    and isinstance(name, ast.Constant)
                    and str(name.value).startswith("dsv4_")
                ):
                    out[name.value] = module
    return out


def family(name: str) -> str:
    """A metric's family name as prometheus_client keeps it (a counter's `_total` is its samples' suffix)."""
    return name.removesuffix("_total")


def test_every_defined_metric_has_a_panel():
    import prometheus_client

    defined = defined_metrics()
    # the scan reads what the modules really register: every module-level metric of the modules it found is in it
    for module in sorted(set(defined.values())):
        registered = {
            family(m._name)
            for m in vars(importlib.import_module(module)).values()
            if isinstance(m, prometheus_client.metrics.MetricWrapperBase) and m._name.startswith("dsv4_")
        }
        assert registered == {family(n) for n, mod in defined.items() if mod == module}, module
    assert {"dsv4_kv_stream_chunks_total", "dsv4_kv_handoff_exposed_seconds", "dsv4_router_decisions_total"} <= set(
        defined
    )
    selected = set()
    for _, _, expr in panel_queries():
        selected |= metric_names(substitute(expr))
    missing = sorted(n for n in defined if not {family(n) + s for s in SERIES_SUFFIXES} & selected)
    assert not missing, f"metrics without a panel (add one to deploy/grafana/generate.py): {missing}"


def dsv4_families(exposition: str) -> str:
    """The lines of the dsv4_ families (the multiprocess dir also holds Ray's own processes' metrics)."""
    keep = []
    for line in exposition.splitlines():
        if line.startswith("# "):
            name = line.split()[2] if len(line.split()) > 2 else ""
        else:
            name = line.split("{")[0].split(" ")[0]
        if name.startswith("dsv4_"):
            keep.append(line)
    return "\n".join(keep) + "\n"


def test_promtool_check_metrics_on_a_live_scrape(dsv4_service):
    promtool = debian_tool("promtool")
    exposition = dsv4_families(dsv4_service.scrape())
    assert "# TYPE dsv4_time_to_first_token_seconds histogram" in exposition
    out = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
