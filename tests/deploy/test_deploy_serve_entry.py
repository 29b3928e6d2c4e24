"""The chart's Serve application run the way KubeRay runs it, on one local node: `ray start --head` with
the CPU demo's head rayStartParams (through `sh -c`, so the quoted `resources` JSON is expanded as in
KubeRay's container command), Ray's token authentication on as the chart's `authOptions` has KubeRay set it
(RAY_AUTH_MODE=token, RAY_AUTH_TOKEN: the dashboard refuses a call without the token), the rendered
serveConfigV2 submitted through the dashboard's REST API (`serve deploy`, as the operator does), and the
exporter sidecar's command on the multiprocess dir.

Checks: the OpenAI API answers, through both router replicas (the chart's default `serve.routerReplicas`); the
exporter serves the stage metrics of the ingress, router and both workers and none of Ray's own processes; a redeploy
with other decode arguments and a 2-rank decode worker (what `helm upgrade` does to serveConfigV2) replaces the
decode worker and the routers, keeps the prefill worker and gives the same tokens; a killed follower rank brings its
group back.
"""

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import yaml

from tests.support.deploy_fixtures import (
    EXAMPLES,
    REPO,
    documents,
    http_json,
    load_values,
    render,
    sample_names,
    serve_config,
)
from tests.support.ports import free_ports

READY_TIMEOUT_S = 240.0


def venv_bin(name: str) -> str:
    return os.path.join(os.path.dirname(sys.executable), name)


class KubeRayLikeHead:
    def __init__(self):
        values = load_values([e for e in EXAMPLES if e.endswith("values-cpu-demo.yaml")][0])
        values["head"]["extraRayResources"]["dsv4_decode"] = 2  # room for a 2-rank decode worker (a unit a rank)
        (self.rayservice,) = [d for d in documents(render(values)) if d["kind"] == "RayService"]
        self.tmp = tempfile.mkdtemp(prefix="dsv4kr-")  # short: Ray's unix sockets live under it
        self.metrics_dir = os.path.join(self.tmp, "metrics")
        os.makedirs(self.metrics_dir)
        # every port this head uses, distinct (two free_port draws can name the same port: Ray then refuses to start)
        ports = free_ports(7)
        self.gcs_port, self.dashboard_port, self.http_port, self.exporter_port = ports[:4]
        self._ray_ports = ports[4:]  # metrics export, Ray client server, dashboard agent
        self.env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PROMETHEUS_MULTIPROC_DIR")}
        # what KubeRay sets on the Ray containers from the chart's authOptions Secret
        self.token = secrets.token_hex(24)
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.procs: list[subprocess.Popen] = []

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def spawn(self, cmd, log: str, env=None) -> subprocess.Popen:
        with open(os.path.join(self.tmp, log), "wb") as f:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,  # the checkout under test: its workers import this tree first
                env=env or self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        with open(os.path.join(self.tmp, name), "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def start_ray(self) -> None:
        params = dict(self.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"])
        params.update(
            {
                "dashboard-host": "127.0.0.1",
                "metrics-export-port": str(self._ray_ports[0]),
                "port": str(self.gcs_port),
                "dashboard-port": str(self.dashboard_port),
                "ray-client-server-port": str(self._ray_ports[1]),
                "dashboard-agent-listen-port": str(self._ray_ports[2]),
                "num-cpus": "2",
                # a private temp dir keeps `ray start` from pointing later `ray.init()`s of this
                # machine (/tmp/ray/ray_current_cluster) at this short-lived cluster
                "temp-dir": os.path.join(self.tmp, "r"),
            }
        )
        line = " ".join(f"--{k}={v}" for k, v in params.items())  # as KubeRay joins rayStartParams
        self.ray = self.spawn(
            ["sh", "-c", f"exec {shlex.quote(venv_bin('ray'))} start --head --block --disable-usage-stats {line}"],
            "ray.log",
        )
        self.wait(lambda: http_json(self.dashboard + "/api/version", timeout=5, headers=self.auth)[0] == 200, "ray.log")
        assert http_json(self.dashboard + "/api/version", timeout=5)[0] in (401, 403)  # no token: refused

    def wait(self, ready, log: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a process exited early:\n{self.log(log)}")
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"not ready after {timeout_s:.0f} s:\n{self.log(log)}")

    def deploy(self, decode_args: list[str], **args) -> None:
        """Submit the chart's serveConfigV2 with these decode args (and other builder `args` replaced)."""
        config = serve_config(self.rayservice)
        config["http_options"] = {"host": "127.0.0.1", "port": self.http_port}
        (app,) = config["applications"]
        app["args"]["metrics_dir"] = self.metrics_dir
        app["args"]["decode_args"] = decode_args
        app["args"].update(args)
        app["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        path = os.path.join(self.tmp, "serve.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        out = subprocess.run(
            [venv_bin("serve"), "deploy", "-a", self.dashboard, path],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr

    def app_running(self, decode_args: list[str], **args) -> bool:
        status, body = http_json(self.dashboard + "/api/serve/applications/", timeout=10, headers=self.auth)
        app = body["applications"].get("dsv4", {}) if status == 200 else {}
        deployed_args = (app.get("deployed_app_config") or {}).get("args", {})
        return (
            app.get("status") == "RUNNING"
            and deployed_args.get("decode_args") == decode_args
            and all(deployed_args.get(k) == v for k, v in args.items())
        )

    def dsv4_actors(self) -> set[str]:
        """Names of the ALIVE actors in the dsv4 namespace (Ray's state API)."""
        return set(self.dsv4_actor_pids())

    def kill_actor(self, name: str) -> None:
        """ray.kill (no restart) of a dsv4 actor, from a driver of its own connected to this cluster."""
        code = (
            "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "ray.kill(ray.get_actor(sys.argv[2], namespace='dsv4'), no_restart=True)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, f"127.0.0.1:{self.gcs_port}", name],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr

    def router_placements(self, completions: int) -> dict[str, int]:
        """Router actor name -> requests it placed (its gRPC Stats), once each has placed one of up to
        `completions` requests sent to the OpenAI API (one at a time), from a driver of its own."""
        code = """
import json, sys, urllib.request, ray
from router.client import RouterClient
ray.init(address=sys.argv[1], logging_level="ERROR")
names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["namespace"] == "dsv4" and a["name"].startswith("dsv4-router-"))
clients = {}
for n in names:
    actor = ray.get_actor(n, namespace="dsv4")
    clients[n] = RouterClient(ray.get(actor.address.remote()), timeout_s=30, token=ray.get(actor.token.remote()))
body = json.dumps({"model": "dsv4", "prompt": [5, 6, 7, 8], "max_tokens": 2}).encode()
for _ in range(int(sys.argv[3])):
    req = urllib.request.Request(sys.argv[2], body, {"Content-Type": "application/json"})
    assert urllib.request.urlopen(req, timeout=60).status == 200
    placed = {n: c.stats().requests_total for n, c in clients.items()}
    if all(placed.values()):
        break
print(json.dumps(placed))
"""
        url = f"http://127.0.0.1:{self.http_port}/v1/completions"
        out = subprocess.run(
            [sys.executable, "-c", code, f"127.0.0.1:{self.gcs_port}", url, str(completions)],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    def dsv4_actor_pids(self) -> dict[str, int]:
        """Name -> pid of the ALIVE actors in the dsv4 namespace (Ray's state API)."""
        url = (
            self.dashboard + "/api/v0/actors?limit=1000&detail=true&filter_keys=state&filter_predicates=%3D"
            "&filter_values=ALIVE"
        )
        with urllib.request.urlopen(urllib.request.Request(url, headers=self.auth), timeout=30) as resp:
            actors = json.loads(resp.read())["data"]["result"]["result"]
        return {a["name"]: a.get("pid") for a in actors if a.get("ray_namespace") == "dsv4" and a.get("name")}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(45)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    pytest.importorskip("ray", reason="ray is missing")
    pytest.importorskip("helm_python", reason="the Helm library is missing: pip install -e '.[test]'")
    h = KubeRayLikeHead()
    try:
        h.start_ray()
        yield h
    finally:
        h.stop()


def completion(head) -> int:
    return http_json(
        f"http://127.0.0.1:{head.http_port}/v1/completions", {"model": "dsv4", "prompt": [5, 6, 7, 8], "max_tokens": 6}
    )[0]


def test_chart_serve_config_serves_and_exports_metrics(head):
    head.deploy([])
    head.wait(
        lambda: head.app_running([]) and http_json(f"http://127.0.0.1:{head.http_port}/health", timeout=5)[0] == 200,
        "ray.log",
    )
    assert completion(head) == 200
    # serve.routerReplicas (2 by default): both routers alive, and the ingress places through each of them
    placed = head.router_placements(completions=8)
    assert len(placed) == 2 and all(placed.values()), placed
    env = dict(head.env, PROMETHEUS_MULTIPROC_DIR=head.metrics_dir)
    head.spawn(
        [
            sys.executable,
            "-m",
            "service.kuberay_app",
            "exporter",
            "--host",
            "127.0.0.1",
            "--port",
            str(head.exporter_port),
        ],
        "exporter.log",
        env=env,
    )
    url = f"http://127.0.0.1:{head.exporter_port}/metrics"
    head.wait(lambda: urllib.request.urlopen(url, timeout=5).status == 200, "exporter.log", timeout_s=30)
    names = sample_names(urllib.request.urlopen(url, timeout=30).read().decode())
    assert {
        "dsv4_requests_total",
        "dsv4_router_decisions_total",
        "dsv4_prefill_time_seconds_count",
        "dsv4_kv_transfer_time_seconds_count",
        "dsv4_decode_time_seconds_count",
    } <= names
    assert all(n.startswith("dsv4_") for n in names), sorted(n for n in names if not n.startswith("dsv4_"))


def test_redeploy_replaces_only_what_changed(head):
    """A redeploy with other decode arguments and `decode.tensorParallelSize: 2` as the chart passes them (one
    redeploy: the decode role's fingerprint covers its engine options and its rank layout alike): the decode worker
    and both routers are replaced, the prefill worker and the cluster token's keeper are kept; the new decode worker
    is two actors (rank 0 and a follower) in one placement group on the role's resource units, and the service
    answers with the same tokens as before. A killed follower brings the whole group back (the router's
    GroupSupervisor, as under `dsv4 serve`): both ranks are new processes and it answers again."""
    token_keeper = {"dsv4-token"}  # the cluster token's keeper outlives every redeploy
    before = head.dsv4_actors() - token_keeper
    names = {n.rsplit("-", 1)[0] for n in before}
    assert names == {"dsv4-prefill-0", "dsv4-decode-0", "dsv4-router-0", "dsv4-router-1"}, before
    args = ["--max-num-seqs", "16"]
    body = {"model": "dsv4", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}
    url = f"http://127.0.0.1:{head.http_port}/v1/completions"
    status, before_out = http_json(url, body)
    assert status == 200
    head.deploy(args, decode_tensor_parallel_size=2)
    head.wait(lambda: head.app_running(args, decode_tensor_parallel_size=2) and completion(head) == 200, "ray.log")
    after = head.dsv4_actors()
    assert token_keeper <= after, after
    after -= token_keeper
    prefill = {n for n in before if n.startswith("dsv4-prefill-")}
    assert prefill <= after, (before, after)  # unchanged worker kept
    decode = sorted(n for n in after if n.startswith("dsv4-decode-"))
    routers = {n for n in after if n.startswith("dsv4-router-")}
    assert len(decode) == 2 and decode[1] == decode[0] + "-rank1", after
    assert len(routers) == 2 and len(after) == 5, after  # nothing else runs
    assert not (after - prefill) & before, (before, after)  # decode and both routers replaced
    status, out = http_json(url, body)
    assert status == 200 and out["choices"][0]["text"] == before_out["choices"][0]["text"], (before_out, out)

    pids = {n: p for n, p in head.dsv4_actor_pids().items() if n in decode}
    head.kill_actor(decode[1])  # the follower rank dies

    def restarted() -> bool:
        now = head.dsv4_actor_pids()
        return all(now.get(n) not in (None, pids[n]) for n in decode) and completion(head) == 200

    head.wait(restarted, "ray.log", timeout_s=120)
    status, out = http_json(url, body)
    assert status == 200 and out["choices"][0]["text"] == before_out["choices"][0]["text"], (before_out, out)


def test_builder_args_are_validated():
    from service import kuberay_app as serve_entry

    cfg = serve_entry.parse_args(
        {
            "prefill_workers": "2",
            "engine": {"device": "cuda", "dtype": "bfloat16"},
            "decode_args": ["--max-num-seqs", "64"],
            "gpus_per_worker": 1,
            "prefill_resources": {"dsv4_prefill": 1},
        }
    )
    assert cfg.prefill.workers == 2 and cfg.prefill.resources == (("dsv4_prefill", 1.0),)
    assert dict(cfg.decode.engine_options) == {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 64}
    assert cfg.prefill.num_gpus == 1.0
    for bad in (
        {"transfer": "rdma"},
        {"engine": {"devices": "cuda"}},
        {"decode_args": ["--dtype", "fp16"]},
        {"prefill_args": ["--unknown", "1"]},
        {"decode_workers": 0},
        {"replicas": 2},
    ):
        with pytest.raises(ValueError):
            serve_entry.parse_args(bad)
