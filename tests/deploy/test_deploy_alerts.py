"""The alert rules fire on the series they watch: `promtool test rules` (Debian's prometheus) runs the rule file
(deploy/prometheus/dsv4-rules.yaml, the chart's rules at its default values) over synthetic series. The exposed
KV hand-off alert fires for slow non-streamed hand-offs (its summary naming the p99 that `histogram_quantile`
interpolates, computed here independently), stays silent for fast streamed ones and before its `for` has
passed; the pool alert fires for the pool whose added worker never became ready, and clears once the failure
is older than its window.
"""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.support.deploy_fixtures import CHART, RULES_FILE, debian_tool, load_values

PER_MINUTE = 10  # hand-offs a minute in each synthetic series
NAMESPACE = "llm"


def rule(name: str) -> dict:
    """The alert of that name in the rule file (exactly one)."""
    with open(RULES_FILE) as f:
        groups = yaml.safe_load(f)["groups"]
    (found,) = [r for g in groups for r in g["rules"] if r.get("alert") == name]
    return found


def rendered(template: str, labels: dict[str, str], value: str = "") -> str:
    """An annotation as Prometheus renders it: `{{ $labels.X }}` and `{{ $value | humanizeDuration }}` filled."""
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], template)
    return text.replace("{{ $value | humanizeDuration }}", value)


def expected_alert(name: str, labels: dict[str, str], value: str = "") -> dict:
    r = rule(name)
    return {
        "exp_labels": {**r["labels"], **labels},
        "exp_annotations": {k: rendered(v, labels, value) for k, v in r["annotations"].items()},
    }


def quantile_of_buckets(q: float, cumulative: list[tuple[float, float]]) -> float:
    """histogram_quantile's linear interpolation inside the bucket holding rank q x count (bounds ascending, the
    last +Inf; the first bucket starts at 0)."""
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    raise AssertionError("rank past the +Inf bucket")


def bucket_series(streamed: str, cumulative: list[tuple[float, float]]) -> list[dict]:
    """Cumulative bucket counters growing by `count` a minute for 40 minutes."""
    out = []
    for bound, count in cumulative:
        le = "+Inf" if bound == float("inf") else repr(bound)
        series = f'dsv4_kv_handoff_exposed_seconds_bucket{{namespace="{NAMESPACE}", streamed="{streamed}", le="{le}"}}'
        out.append({"series": series, "values": f"0+{count:g}x40"})
    return out


def run_promtool(tmp_path, tests: list[dict]) -> None:
    path = tmp_path / "alerts-test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [RULES_FILE], "evaluation_interval": "1m", "tests": tests}))
    out = subprocess.run([debian_tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_exposed_handoff_alert_fires_for_slow_handoffs_only(tmp_path):
    threshold = float(load_values(f"{CHART}/values.yaml")["monitoring"]["prometheusRule"]["handoffExposedP99Seconds"])
    # non-streamed: a tenth of the hand-offs under the threshold, the rest up to twice it; streamed: all fast
    slow = [(threshold, PER_MINUTE / 10), (2 * threshold, PER_MINUTE), (float("inf"), PER_MINUTE)]
    fast = [(threshold / 10, PER_MINUTE), (float("inf"), PER_MINUTE)]
    slow_p99, fast_p99 = quantile_of_buckets(0.99, slow), quantile_of_buckets(0.99, fast)
    assert fast_p99 < threshold < slow_p99 < 1.0  # (below 1 s: humanizeDuration writes milliseconds, 4 digits)
    fired = expected_alert(
        "Dsv4KVHandoffExposedP99High", {"namespace": NAMESPACE, "streamed": "false"}, f"{slow_p99 * 1000:.4g}ms"
    )
    name = "Dsv4KVHandoffExposedP99High"
    run_promtool(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": bucket_series("false", slow) + bucket_series("true", fast),
                "alert_rule_test": [
                    {"eval_time": "8m", "alertname": name, "exp_alerts": []},  # pending: `for` not yet passed
                    {"eval_time": "30m", "alertname": name, "exp_alerts": [fired]},
                ],
            }
        ],
    )


def test_pool_alert_fires_for_the_pool_whose_worker_never_became_ready(tmp_path):
    failures = 'dsv4_pool_start_failures_total{namespace="%s", pool="%s"}'
    name = "Dsv4PoolWorkerNeverReady"
    run_promtool(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": [
                    {"series": failures % (NAMESPACE, "prefill"), "values": "0x60"},
                    {"series": failures % (NAMESPACE, "decode"), "values": "0x20 1x40"},  # one given up at 21 min
                ],
                "alert_rule_test": [
                    {"eval_time": "15m", "alertname": name, "exp_alerts": []},
                    {
                        "eval_time": "30m",
                        "alertname": name,
                        "exp_alerts": [expected_alert(name, {"namespace": NAMESPACE, "pool": "decode"})],
                    },
                    {"eval_time": "55m", "alertname": name, "exp_alerts": []},  # older than the 15-min window
                ],
            }
        ],
    )
