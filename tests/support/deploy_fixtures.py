"""Shared helpers of the deploy tests (tests/deploy/test_deploy_*.py): chart rendering through the Helm library,
dashboard and rule queries, the real tools (promtool, prometheus, kubernetes-validate, yamllint), and one
live `dsv4 serve` shared by every module whose `dsv4_service` fixture runs `live_service`.

The service is started once, by the first module that needs it, and stopped (SIGINT, which must end it
within 30 s) after the last collected test that uses it, so later test files don't run beside an idle
Ray cluster on the 2-core CI machine.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.support.ports import free_port, free_ports  # noqa: F401 - free_port re-exported for the deploy tests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(REPO, "deploy", "helm", "dsv4")
EXAMPLES = sorted(glob.glob(os.path.join(REPO, "deploy", "helm", "examples", "*.yaml")))
VALUES_FILES = [os.path.join(CHART, "values.yaml"), *EXAMPLES]
GRAFANA = os.path.join(REPO, "deploy", "grafana")
RULES_FILE = os.path.join(REPO, "deploy", "prometheus", "dsv4-rules.yaml")
CRDS = os.path.join(REPO, "tests", "data", "crds")
YAMLLINT_CONFIG = os.path.join(REPO, "deploy", "helm", "yamllint.yaml")
SERVICE_START_TIMEOUT_S = 240.0
SERVICE_STOP_LIMIT_S = 30.0


# ---- tools ----------------------------------------------------------------------------------------------
def helm():
    """The Helm library (PyPI helm-python-sdk), or a skip that says how to get it."""
    helm_python = pytest.importorskip(
        "helm_python", reason="the Helm library is missing: pip install -e '.[test]' (PyPI helm-python-sdk)"
    )
    helm_python.disable_logging()
    return helm_python


def debian_tool(name: str) -> str:
    """Path of promtool / prometheus, or a skip naming the package (installed by `make tools`)."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found: install Debian's prometheus package (`make tools`, needs apt-get as root)")
    return path


def venv_tool(module: str) -> list[str]:
    pytest.importorskip(module, reason=f"{module} is missing: pip install -e '.[test]'")
    return [sys.executable, "-m", module]


# ---- chart ----------------------------------------------------------------------------------------------
def load_values(path: str) -> dict:
    with open(path) as f:
        return yaml.safe_load(f) or {}


def render(values: dict | None = None, name: str = "dsv4", namespace: str = "llm") -> dict[str, str]:
    """template path -> rendered text (empty templates and NOTES.txt left out)."""
    helm_python = helm()
    with helm_python.Chart.load(CHART) as chart:
        out = chart.render(values=values or {}, name=name, namespace=namespace, is_install=True)
    return {k: v for k, v in sorted(out.items()) if v.strip() and not k.endswith("NOTES.txt")}


def documents(rendered: dict[str, str]) -> list[dict]:
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]


def manifest_stream(rendered: dict[str, str]) -> str:
    """What `helm template` prints: every template as a `---` document with a Source comment."""
    return "".join(f"---\n# Source: {path}\n{text.strip(chr(10))}\n" for path, text in rendered.items())


def with_monitoring(values: dict) -> dict:
    """The values plus assumeMonitoringAPI (what a cluster with the operator's CRDs renders)."""
    merged = json.loads(json.dumps(values))
    merged.setdefault("monitoring", {})["assumeMonitoringAPI"] = True
    return merged


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


# ---- dashboards and PromQL ------------------------------------------------------------------------------
def dashboards() -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(GRAFANA, "*.json"))):
        with open(path) as f:
            out[os.path.basename(path)] = json.load(f)
    return out


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every target of every panel."""
    return [
        (name, panel["title"], target["expr"])
        for name, d in dashboards().items()
        for panel in d["panels"]
        for target in panel.get("targets", [])
    ]


LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def variable_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard, variable, series selector, label) of every `label_values(...)` variable."""
    out = []
    for name, d in dashboards().items():
        for var in d["templating"]["list"]:
            if var["type"] == "query":
                m = LABEL_VALUES.match(var["query"]["query"])
                assert m, f"{name}: variable {var['name']} is not label_values(selector, label)"
                out.append((name, var["name"], m["selector"], m["label"]))
    return out


def rule_queries(rules: dict | None = None) -> list[tuple[str, str]]:
    """(rule name, expr) of every rule of a Prometheus rule file's content."""
    if rules is None:
        with open(RULES_FILE) as f:
            rules = yaml.safe_load(f)
    return [(r.get("alert") or r.get("record"), str(r["expr"])) for g in rules["groups"] for r in g["rules"]]


def substitute(expr: str, rate_interval: str = "1m") -> str:
    """Grafana's variables as a dashboard with every variable on "All" sends them."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects (parsed by promql-parser; raises on a syntax error)."""
    promql_parser = pytest.importorskip("promql_parser", reason="promql-parser is missing: pip install -e '.[test]'")
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


# ---- live service ---------------------------------------------------------------------------------------
def http_json(
    url: str, body: dict | None = None, timeout: float = 60.0, headers: dict | None = None
) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


class LiveService:
    """`dsv4 serve --transfer tcp` (1P1D, the decode pool elastic up to 2) in a subprocess on loopback ports, with its own metrics dir."""

    def __init__(self):
        self.port, self.metrics_port = free_ports(2)  # distinct (two draws can name one port)
        self.tmp = tempfile.mkdtemp(prefix="dsv4-deploy-test-")
        self.log_path = os.path.join(self.tmp, "serve.log")
        self.proc: subprocess.Popen | None = None
        self.exit_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> None:
        dsv4 = os.path.join(os.path.dirname(sys.executable), "dsv4")
        cmd = (
            [dsv4]
            if os.path.exists(dsv4)
            else [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())"]
        )
        cmd += [
            "serve",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--prefill-workers",
            "1",
            "--decode-workers",
            "1:2",  # elastic (service/pools.py): the planner runs and exports the pool metrics; idle, it stays at 1
            "--transfer",
            "tcp",
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PROMETHEUS_MULTIPROC_DIR")}
        env["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(self.tmp, "metrics")
        env["RAY_ADDRESS"] = "local"  # a new cluster, even where `ray start` left /tmp/ray/ray_current_cluster
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsv4 serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if http_json(self.url + "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"dsv4 serve was not healthy after {SERVICE_START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def stop(self) -> None:
        """SIGINT, then wait; the process group is killed only if it outlives the limit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        start = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(SERVICE_STOP_LIMIT_S)
            self.exit_seconds = time.monotonic() - start
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def complete(self, prompt, max_tokens: int = 8, stream: bool = False, model: str = "dsv4"):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        return http_json(self.url + "/v1/completions", body)

    def traffic(self) -> dict[int, int]:
        """A mix that moves every exported series: short and long prompts, a repeated long prompt (prefix
        cache hits), streaming (inter-token latency) and two client errors; -> count per HTTP status."""
        long_prompt = [(11 * j) % 400 + 2 for j in range(48)]
        calls = [
            ([5, 6, 7], False),
            ([5, 6, 7], True),
            (long_prompt, False),
            (long_prompt, True),
            (long_prompt + [9, 10], False),
            ([8, 9, 10, 11], False),
        ]
        statuses: dict[int, int] = {}
        for prompt, stream in calls:
            status = self.complete(prompt, stream=stream)[0]
            statuses[status] = statuses.get(status, 0) + 1
        for bad in ({"prompt": [5, 6, 7], "model": "no-such-model"}, {"prompt": [10**9], "model": "dsv4"}):
            status = self.complete(bad["prompt"], model=bad["model"])[0]
            statuses[status] = statuses.get(status, 0) + 1
        return statuses

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=30) as resp:
            return resp.read().decode()


_SERVICE: LiveService | None = None


def _later_users(request) -> bool:
    """Whether a collected test after this module still uses the service."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    last = max(mine) if mine else -1
    return any("dsv4_service" in item.fixturenames for item in items[last + 1 :])


def live_service(request):
    """Body of each module's `dsv4_service` fixture: yields the shared live service, started on first use
    and stopped when no later collected test asks for `dsv4_service`."""
    global _SERVICE
    if _SERVICE is None:
        pytest.importorskip("ray", reason="ray is missing")
        svc = LiveService()
        svc.start()
        _SERVICE = svc
    yield _SERVICE
    if not _later_users(request):
        svc, _SERVICE = _SERVICE, None
        try:
            svc.stop()
            assert svc.exit_seconds is not None, f"dsv4 serve ignored SIGINT for {SERVICE_STOP_LIMIT_S:.0f} s"
            assert svc.proc.returncode == 0, f"dsv4 serve exited with {svc.proc.returncode}:\n{svc.log_tail()}"
        finally:
            shutil.rmtree(svc.tmp, ignore_errors=True)


def sample_names(exposition: str) -> set[str]:
    """Every sample name of a Prometheus text exposition (parsed by prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for fam in text_string_to_metric_families(exposition) for s in fam.samples}


def event_only_samples() -> set[str]:
    """Sample names of the service's labelled counters (engine.telemetry.metrics), which have no sample in a scrape
    until their first event; only these may be missing from a live scrape of a healthy service."""
    import prometheus_client

    from engine.telemetry import metrics

    names = set()
    for obj in vars(metrics).values():
        if isinstance(obj, prometheus_client.Counter) and obj._labelnames:
            names.add(f"{obj._name}_total")
    return names


# ---- CRD schemas ---------------------------------------------------------------------------------------
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> JSON Schema of the CRDs kept in tests/data/crds."""
    out = {}
    for path in sorted(glob.glob(os.path.join(CRDS, "*.yaml"))):
        crd = load_values(path)
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            out[(api_version, crd["spec"]["names"]["kind"])] = strict_json_schema(version["schema"]["openAPIV3Schema"])
    return out


def strict_json_schema(node):
    """An openAPIV3Schema as a JSON Schema that rejects unknown fields, as strict field validation does:
    an object with `properties` and no `additionalProperties` allows no other field unless it is marked
    `x-kubernetes-preserve-unknown-fields`."""
    if isinstance(node, list):
        return [strict_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("type") == "object" and "additionalProperties" not in node:
        preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
        out["additionalProperties"] = bool(preserve) or "properties" not in node
    return out


# ---- Prometheus -----------------------------------------------------------------------------------------
class PrometheusServer:
    """Debian's Prometheus on loopback scraping one target every second, with a rule file loaded."""

    def __init__(self, target: str, rule_files: list[str], labels: dict[str, str]):
        self.binary = debian_tool("prometheus")
        self.port = free_port()
        self.tmp = tempfile.mkdtemp(prefix="dsv4-prometheus-")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": rule_files,
            "scrape_configs": [{"job_name": "dsv4", "static_configs": [{"targets": [target], "labels": labels}]}],
        }
        self.config_path = os.path.join(self.tmp, "prometheus.yml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        self.log_path = os.path.join(self.tmp, "prometheus.log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        cmd = [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.tmp}/data",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"prometheus not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]

    def api(self, path: str, **params) -> dict | list:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
            body = json.loads(resp.read().decode())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def wait_for(self, expr: str, predicate, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        result = None
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.5)
        raise AssertionError(f"{expr!r} never satisfied the condition; last result {result}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)
