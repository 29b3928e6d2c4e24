"""The fault suite's live service and its clients (tests/service/test_service_faults.py, test_front_doors.py): a
local Ray cluster with 1 prefill + 1 decode worker over tcp, the real routers and the HTTP front door, the API key
and short HTTP limits; an HTTP client bound to it, a /health watcher for attacks, raw-socket exchanges and the
probe's attacks on the front door. Import it after `pytest.importorskip("ray")`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import threading
import time

import ray
import requests

from engine.loading.make_model import default_model_dir
from engine.telemetry.metrics import start_metrics_server
from service.http_limits import HttpLimits
from service.launcher import (
    ServiceConfig,
    init_ray,
    prepare_metrics_dir,
    ray_logs_tail,
    remove_metrics_dir,
    start_service,
    stop_service,
)
from tests.support.ports import free_port
from tests.support.proc import descendants, pids_with_cmdline

KEY = "test-api-key"
SLOTS = 4
QUEUED = 8
# /health must keep answering whatever else is going on. The ingress loop used to stall for minutes (a template
# DoS: 170 s and beyond; a 10 MB prompt: 15-18 s); a bound of a few seconds tells that apart from a busy 2-core CI
# machine running Ray beside the suite, where a healthy probe was seen to take up to ~1.8 s.
HEALTH_BOUND_S = 5.0
AUTH = {"Authorization": f"Bearer {KEY}"}
# short enough to wait for here; a body of the other tests (a few MiB over loopback) arrives well within 5 s
LIMITS = HttpLimits(max_header_bytes=16384, header_timeout_s=2.0, body_timeout_s=5.0)


class Service:
    def __init__(self, cfg: ServiceConfig, handles: dict):
        self.cfg, self.handles = cfg, handles
        self.base = f"http://127.0.0.1:{cfg.port}"
        self.http = Http(self.base)

    def post(self, path: str, body, headers=AUTH, **kw):
        data = body if isinstance(body, (bytes, str)) or hasattr(body, "__next__") else json.dumps(body)
        return self.http.post(path, data=data, headers={"Content-Type": "application/json", **(headers or {})}, **kw)

    def complete(self, **body):
        return self.post("/v1/completions", {"model": "dsv4", "max_tokens": 4, "temperature": 0, **body})

    def stream(self, **body):
        """POST a streaming completion; -> the open httpx response (iterate .iter_lines())."""
        resp = self.http.post(
            "/v1/completions",
            headers=AUTH,
            stream=True,
            json={"model": "dsv4", "temperature": 0, "stream": True, "ignore_eos": True, **body},
        )
        resp.lines = resp.iter_lines(decode_unicode=True)
        return resp

    def queued(self) -> int:
        """Requests waiting for a decode slot, at every router replica."""
        return sum(ray.get([r.queued.remote() for r in self.handles["routers"]]))

    def worker_stats(self):
        return ray.get(
            [h.stats.remote() for h in (*self.handles["prefill"].values(), *self.handles["decode"].values())]
        )


class Http:
    """requests with a base URL, no proxies from the environment (loopback only), and a default timeout."""

    def __init__(self, base: str, timeout: float = 180):
        self.base, self.timeout = base, timeout
        self.session = requests.Session()
        self.session.trust_env = False

    def request(self, method: str, path: str, **kw):
        kw.setdefault("timeout", self.timeout)
        return self.session.request(method, path if path.startswith("http") else self.base + path, **kw)

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw):
        return self.request("POST", path, **kw)

    def close(self):
        self.session.close()


class HealthWatch:
    """Polls /health in a thread during an attack; records the slowest answer and any that never came."""

    def __init__(self, base: str):
        self.base, self.worst, self.misses, self.count = base, 0.0, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        c = Http(self.base, timeout=10)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                c.get("/health")  # 200 or 503 (a worker restarting): either is an answer
            except requests.RequestException as e:
                self.misses.append(repr(e))
            self.worst = max(self.worst, time.monotonic() - t0)
            self.count += 1
            self._stop.wait(0.1)
        c.close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(15)
        if exc[0] is None:
            assert not self.misses and self.worst < HEALTH_BOUND_S, (self.worst, self.misses)
            assert self.count >= 1


@contextlib.contextmanager
def running_service(**overrides):
    """This module's service (1 prefill + 1 decode worker over tcp, SLOTS slots, the API key, LIMITS), with any
    ServiceConfig field overridden; -> a Service, stopped on exit."""
    metrics_dir = prepare_metrics_dir()
    handles, metrics = None, None
    try:
        init_ray(metrics_dir)
        fields = dict(
            model_dir=default_model_dir(),
            prefill_workers=1,
            decode_workers=1,
            transfer="tcp",
            port=free_port(),
            metrics_port=free_port(),
            api_key=KEY,
            max_body_bytes=1 << 20,
            allow_request_chat_template=True,
            router_max_queued=QUEUED,
            router_queue_timeout_s=120.0,
            ready_timeout_s=240.0,
            engine_options=(("max_batch_tokens", 64), ("max_num_seqs", SLOTS)),
            http_limits=LIMITS,
        )
        cfg = ServiceConfig(**{**fields, **overrides})
        metrics, _ = start_metrics_server(cfg.metrics_port, "127.0.0.1")
        handles = start_service(cfg)
    except Exception as e:
        logs = ray_logs_tail()
        if ray.is_initialized():
            stop_service(handles, drain_s=0)
        raise RuntimeError(f"service setup failed: {type(e).__name__}: {e}\n\n{logs}") from e
    s = Service(cfg, handles)
    s.metrics = metrics
    try:
        yield s
    finally:
        s.http.close()
        stop_service(handles, drain_s=0)
        metrics.shutdown()
        metrics.server_close()
        remove_metrics_dir()  # the temp dir this module's service made (kept if the environment named one)


def wait_until(cond, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not met after {timeout:.0f} s"
        time.sleep(0.2)


def cluster_pids() -> set[int]:
    """This process and every live process of its Ray session (the session's daemons, workers and their children).
    Not every child of this process: an earlier module's cluster may still be exiting (its daemons name another
    session; its workers are theirs), and its listeners or HAProxy are not this cluster's."""
    from ray._private import worker

    session = worker._global_node.get_session_dir_path()
    return {os.getpid(), *descendants(set(pids_with_cmdline(session)))}


def raw_exchange(port: int, *parts: bytes, pause: float = 0.0, says_close: bool = True) -> tuple[int, dict, float]:
    """Send `parts` over a raw socket (pausing between them), read until the server closes (within the socket's
    30 s); -> (status, the JSON body, seconds from connecting to the answer's first byte). says_close: the answer
    has `Connection: close` (HAProxy drops it from a replica's answer, then closes the connection itself)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for p in parts:
            try:
                s.sendall(p)
            except (BrokenPipeError, ConnectionResetError):  # refused mid-send: read the answer
                break
            time.sleep(pause)
        out, answered = b"", None
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                answered = time.monotonic() - t0 if answered is None else answered
                out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    assert answered is not None and (b"connection: close" in head.lower() or not says_close), out[:300]
    if b"content-type: text/html" in head.lower():  # HAProxy's own page (service.serve_front: HTTP limits)
        return int(head.split()[1]), {"html": body.decode(errors="replace")}, answered
    return int(head.split()[1]), json.loads(body), answered


def check_http_attacks(svc, haproxy: bool) -> None:
    """The probe's attacks on the front door: six 8 MiB heads, 20 connections trickling their heads, a trickled
    body: refused within the limits while /health keeps answering. Through HAProxy the heads are refused by HAProxy
    with its own 400 / 408 pages and the body by the replica's server in the API's error shape (413 / 408); through
    Serve's Python proxy all three in the API's shape (service.serve_front)."""
    port = svc.cfg.port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (8 << 20) + b"\r\n\r\n"
    chunks = [head[i : i + (1 << 16)] for i in range(0, len(head), 1 << 16)]
    slow_head = [b"GET /health HTTP/1.1\r\n", *(b"X-%d: y\r\n" % i for i in range(20))]
    slow_body = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Length: 1000\r\n\r\n"
        % (KEY.encode())
    )
    with HealthWatch(svc.base), concurrent.futures.ThreadPoolExecutor(27) as pool:
        big = [pool.submit(raw_exchange, port, *chunks) for _ in range(6)]
        slow = [pool.submit(raw_exchange, port, *slow_head, pause=0.5) for _ in range(20)]
        body = pool.submit(raw_exchange, port, slow_body, b'{"prompt": [1, 2', pause=0.5, says_close=not haproxy)
        for f in big:
            status, err, _ = f.result()
            if haproxy:
                assert status == 400 and "400 Bad request" in err["html"], err
            else:
                assert status == 413 and err["error"]["type"] == "RequestTooLargeError", err
                assert "limit of 16384 bytes" in err["error"]["message"]
        for f in slow:
            status, err, took = f.result()
            if haproxy:
                assert status == 408 and "408 Request Time-out" in err["html"], err
            else:
                assert status == 408 and err["error"]["message"] == "request headers not received within 2 s", err
            assert took < LIMITS.header_timeout_s + 5
        status, err, took = body.result()
        assert status == 408 and err["error"]["message"] == "request body not received within 5 s", err
        assert took < LIMITS.body_timeout_s + 5
    assert svc.complete(prompt=[5, 6, 7]).status_code == 200
