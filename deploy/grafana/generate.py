"""Writes the Grafana dashboards of the service (`python deploy/grafana/generate.py`): the JSON beside
this file is its output, and a test fails when the two differ.

Conventions: every panel and target reads the `datasource` variable (no datasource uid is written);
`namespace`, `model`, `role` and `worker` variables filter every query; quantiles are
`histogram_quantile(q, sum by (le, ...) (rate(X_bucket[$__rate_interval])))`, means are
rate(_sum)/rate(_count), ratios are ratios of rates; counters that only move on a failure are
`... or on() vector(0)` so that a healthy service draws 0 instead of "No data".
"""

from __future__ import annotations

import json
import os
import sys

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
MODEL = 'namespace=~"$namespace", model_name=~"$model"'
WORKER = 'namespace=~"$namespace", role=~"$role", worker=~"$worker"'
TRANSFER = 'namespace=~"$namespace", worker=~"$worker"'
NS = 'namespace=~"$namespace"'
QUANTILES = (0.5, 0.9, 0.99)


def quantile(q: float, metric: str, sel: str, by: str = "") -> str:
    keys = ", ".join(k for k in ("le", by) if k)
    return f"histogram_quantile({q}, sum by ({keys}) (rate({metric}_bucket{{{sel}}}{RATE})))"


def mean(metric: str, sel: str, by: str = "") -> str:
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} (rate({metric}_sum{{{sel}}}{RATE})) / {agg} (rate({metric}_count{{{sel}}}{RATE}))"


def rate(metric: str, sel: str, by: str = "") -> str:
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} (rate({metric}{{{sel}}}{RATE}))"


def zero_if_absent(expr: str) -> str:
    return f"({expr} or on() vector(0))"


def quantile_targets(metric: str, sel: str, by: str = "") -> list[tuple[str, str]]:
    """p50 / p90 / p99 of a histogram, one series per value of the label `by` when given."""
    split = f" {by}={{{{{by}}}}}" if by else ""
    return [(quantile(q, metric, sel, by), f"p{round(q * 100)}{split}") for q in QUANTILES]


ERRORS = 'namespace=~"$namespace", model_name=~"$model", status="error"'
FAILURES = "dsv4_kv_transfer_failures_total"  # once per failed pull (engine.telemetry.metrics says who counts)
ABORTS = "dsv4_kv_transfer_aborts_total"  # cancelled requests: apart from failures, never in the failure ratio
HANDOFF = "dsv4_kv_handoff_exposed_seconds"  # observed by the dispatcher (service.ray_stream), labelled streamed only

OVERVIEW = ("dsv4-overview", "dsv4 / Overview", [
    ("Requests per second by status", "reqps", [(rate("dsv4_requests_total", MODEL, "status"), "{{status}}")]),
    ("Error ratio (5xx)", "percentunit",
     [(f"{zero_if_absent(rate('dsv4_requests_total', ERRORS))} / {rate('dsv4_requests_total', MODEL)}", "errors")]),
    ("Time to first token", "s", quantile_targets("dsv4_time_to_first_token_seconds", MODEL)),
    ("Inter-token latency", "s", quantile_targets("dsv4_inter_token_latency_seconds", MODEL)),
    ("End-to-end request latency", "s", quantile_targets("dsv4_e2e_request_latency_seconds", MODEL)
     + [(mean("dsv4_e2e_request_latency_seconds", MODEL), "mean")]),
    ("Token throughput", "short", [(rate("dsv4_prompt_tokens_total", WORKER), "prompt tokens/s"),
                                   (rate("dsv4_generation_tokens_total", WORKER), "generated tokens/s")]),
    ("Prefix-cache hit ratio (prompt tokens served from cache)", "percentunit",
     [(f"{rate('dsv4_prefix_cache_hit_tokens_total', NS)} / {rate('dsv4_prefix_cache_query_tokens_total', NS)}",
       "engines (real)"),
      (f"{rate('dsv4_prefix_cache_hit_tokens_total', WORKER, 'role, worker')} / "
       f"{rate('dsv4_prefix_cache_query_tokens_total', WORKER, 'role, worker')}", "{{role}} {{worker}}"),
      # what the router believed cached on the prefill worker it chose: far above the engines' ratio = stale digests
      (f"{rate('dsv4_router_prefix_estimate_hit_tokens_total', NS)} / "
       f"{rate('dsv4_router_prefix_estimate_query_tokens_total', NS)}", "router estimate")]),
    ("Router decisions by stage and reason", "ops",
     [(rate("dsv4_router_decisions_total", NS, "stage, reason"), "{{stage}} / {{reason}}")]),
])

STAGES = [("Queue", "dsv4_request_queue_time_seconds", WORKER), ("Prefill", "dsv4_prefill_time_seconds", WORKER),
          ("KV transfer", "dsv4_kv_transfer_time_seconds", TRANSFER), ("Decode", "dsv4_decode_time_seconds", WORKER)]

STAGE_BREAKDOWN = ("dsv4-stages", "dsv4 / Stage breakdown", [
    ("Mean time per stage", "s", [(mean(metric, sel), name) for name, metric, sel in STAGES]),
    *[(f"{name} time", "s", quantile_targets(metric, sel)) for name, metric, sel in STAGES],
    *[(f"{name} time p99 by worker", "s", [(quantile(0.99, metric, sel, "worker"), "{{worker}}")])
      for name, metric, sel in STAGES],
    ("KV transfer throughput (GB/s while transferring)", "decGBs",
     [(f"{rate('dsv4_kv_transfer_bytes_sum', TRANSFER, 'worker')} / "
       f"{rate('dsv4_kv_transfer_time_seconds_sum', TRANSFER, 'worker')} / 1e9", "{{worker}}")]),
    ("KV bytes moved (GB/s)", "decGBs",
     [(f"{rate('dsv4_kv_transfer_bytes_sum', TRANSFER, 'worker, backend')} / 1e9", "{{worker}} ({{backend}})")]),
    ("KV bytes per request", "bytes", quantile_targets("dsv4_kv_transfer_bytes", TRANSFER)),
    ("KV transfer failures per second", "ops",
     [(zero_if_absent(rate(FAILURES, TRANSFER, "worker, backend, kind")), "{{worker}} {{kind}}")]),
    ("KV transfer aborts per second (cancelled requests, not failures)", "ops",
     [(zero_if_absent(rate(ABORTS, TRANSFER, "worker, backend, side")), "{{worker}} {{side}}")]),
    ("KV transfer failure ratio", "percentunit",
     [(f"{zero_if_absent(rate(FAILURES, TRANSFER))} / ({rate('dsv4_kv_transfer_time_seconds_count', TRANSFER)}"
       f" + {zero_if_absent(rate(FAILURES, TRANSFER))})", "failure ratio")]),
    # the hand-off time the prefill did not hide (its result to the caches landing on the decode worker): all of it
    # is in TTFT; a streamed hand-off pulls chunks while later ones are prefilled, so its exposed time stays short
    ("KV hand-off exposed after the prefill, streamed or not", "s",
     quantile_targets(HANDOFF, NS, "streamed") + [(mean(HANDOFF, NS, "streamed"), "mean streamed={{streamed}}")]),
    ("KV hand-offs per second, streamed or not", "ops",
     [(rate(f"{HANDOFF}_count", NS, "streamed"), "streamed={{streamed}}")]),
    ("Streamed KV chunks pulled during the prefill per second", "ops",
     [(zero_if_absent(rate("dsv4_kv_stream_chunks_total", TRANSFER, "worker, backend")), "{{worker}} ({{backend}})")]),
])

WORKERS = ("dsv4-workers", "dsv4 / Load per role and worker", [
    ("Running requests", "short", [(f"sum by (role, worker) (dsv4_running_requests{{{WORKER}}})",
                                    "{{role}} {{worker}}")]),
    ("Waiting requests", "short", [(f"sum by (role, worker) (dsv4_waiting_requests{{{WORKER}}})",
                                    "{{role}} {{worker}}")]),
    ("KV-cache usage", "percentunit", [(f"max by (role, worker) (dsv4_kv_cache_usage_ratio{{{WORKER}}})",
                                        "{{role}} {{worker}}")]),
    ("KV-cache usage by role (max)", "percentunit",
     [(f"max by (role) (dsv4_kv_cache_usage_ratio{{{WORKER}}})", "{{role}}")]),
    ("Generated tokens per second", "short", [(rate("dsv4_generation_tokens_total", WORKER, "role, worker"),
                                               "{{role}} {{worker}}")]),
    ("Prompt tokens per second", "short", [(rate("dsv4_prompt_tokens_total", WORKER, "role, worker"),
                                            "{{role}} {{worker}}")]),
    # elastic pools (service/pools.py): the planner's view; no data while both pools are fixed
    ("Pool size by state (elastic pools)", "short",
     [(f"max by (pool, state) (dsv4_pool_workers{{{NS}}})", "{{pool}} {{state}}")]),
    ("Pool desired vs ready workers", "short",
     [(f"max by (pool) (dsv4_pool_desired_workers{{{NS}}})", "{{pool}} desired"),
      (f'max by (pool) (dsv4_pool_workers{{{NS}, state="ready"}})', "{{pool}} ready")]),
    ("Pool pressure (largest signal / its target; 1 = at target)", "short",
     [(f"max by (pool) (dsv4_pool_pressure{{{NS}}})", "{{pool}}")]),
    ("Pool scale decisions by reason", "ops",
     [(zero_if_absent(rate("dsv4_pool_scale_decisions_total", NS, "pool, direction, reason")),
       "{{pool}} {{direction}} {{reason}}"),
      (zero_if_absent(rate("dsv4_pool_start_failures_total", NS, "pool")), "{{pool}} start failures")]),
    # speculative decoding (engine.telemetry.metrics SPEC_*): speculative engines only, no data elsewhere
    ("Speculative decoding: draft acceptance rate", "percentunit",
     [(f"{rate('dsv4_spec_accepted_tokens_total', WORKER, 'role, worker')} / "
       f"{rate('dsv4_spec_draft_tokens_total', WORKER, 'role, worker')}", "{{role}} {{worker}}")]),
    ("Speculative decoding: accepted draft tokens per verify step", "short",
     [(f"{rate('dsv4_spec_accepted_tokens_total', WORKER, 'role, worker')} / "
       f"{rate('dsv4_spec_verify_steps_total', WORKER, 'role, worker')}", "{{role}} {{worker}}")]),
    # SpecGate (engine.execution.spec_policy) pauses drafting where it does not pay: steps without drafts vs request
    # verify steps (one a request a step with drafts); only paused steps = the engine runs as a plain one
    ("Speculative decoding: steps with drafting paused by SpecGate vs verify steps", "ops",
     [(rate("dsv4_spec_undrafted_steps_total", WORKER, "role, worker"), "{{role}} {{worker}} paused steps"),
      (rate("dsv4_spec_verify_steps_total", WORKER, "role, worker"), "{{role}} {{worker}} request verify steps")]),
    # set once at start: 0 = the engine fell back from that GPU fast path (the worker's start-up WARNING says why)
    ("GPU fast paths (1 = in use, 0 = fell back)", "short",
     [(f"min by (role, worker, path) (dsv4_fast_path_active{{{WORKER}}})", "{{role}} {{worker}} {{path}}")]),
    ("Kernel compiles while serving (each stalls its step for seconds)", "ops",
     [(zero_if_absent(rate("dsv4_kernel_compiles_total", WORKER, "role, worker")), "{{role}} {{worker}}")]),
    # Python's cycle collector (engine.runtime.gc_pauses): each pass pauses its whole process (a worker's step, every
    # stream of a replica); long passes or frequent young ones = a start-up heap not frozen or requests in cycles
    ("Collector pause p99 by process kind and generation", "s",
     [(quantile(0.99, "dsv4_gc_pause_seconds", NS, "component, generation"), "{{component}} gen{{generation}}")]),
    ("Collector pause time per second (share of a core paused)", "percentunit",
     [(rate("dsv4_gc_pause_seconds_sum", NS, "component"), "{{component}}")]),
    ("Objects frozen out of the collector's walks at start-up (0 = never frozen)", "short",
     [(f"max by (component) (dsv4_gc_frozen_objects{{{NS}}})", "{{component}}")]),
])


def variable(name: str, label: str, query: str, metric_label: str) -> dict:
    q = f"label_values({query}, {metric_label})"
    return {"name": name, "label": label, "type": "query", "datasource": DS, "query": {"query": q, "refId": name},
            "definition": q, "refresh": 2, "includeAll": True, "allValue": ".*", "multi": True, "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


TEMPLATING = [
    {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "refresh": 1,
     "current": {}},
    variable("namespace", "Namespace", "dsv4_requests_total", "namespace"),
    variable("model", "Model", 'dsv4_requests_total{namespace=~"$namespace"}', "model_name"),
    variable("role", "Role", 'dsv4_running_requests{namespace=~"$namespace"}', "role"),
    variable("worker", "Worker", 'dsv4_running_requests{namespace=~"$namespace", role=~"$role"}', "worker"),
]


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {"id": i + 1, "type": "timeseries", "title": title, "datasource": DS,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DS, "expr": expr, "legendFormat": legend,
                         "range": True} for j, (expr, legend) in enumerate(targets)]}


def dashboard(uid: str, title: str, panels: list) -> dict:
    return {"uid": uid, "title": title, "tags": ["dsv4", "llm-serving"], "timezone": "browser", "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
            "annotations": {"list": []}, "links": [], "templating": {"list": TEMPLATING},
            "panels": [panel(i, *p) for i, p in enumerate(panels)]}


DASHBOARDS = (OVERVIEW, STAGE_BREAKDOWN, WORKERS)


def render() -> dict[str, str]:
    """file name -> JSON text of every dashboard."""
    return {f"{uid}.json": json.dumps(dashboard(uid, title, panels), indent=2) + "\n"
            for uid, title, panels in DASHBOARDS}


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    for name, text in render().items():
        with open(os.path.join(here, name), "w") as f:
            f.write(text)
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
