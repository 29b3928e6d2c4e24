"""`dsv4 serve`: start (or join) a Ray cluster, the worker pools, the gRPC router and the HTTP ingress.

Topology (one Ray cluster; scales out unchanged when RAY_ADDRESS points at a multi-node cluster):
  Ray Serve HTTP (FastAPI, OpenAI API) --gRPC--> RouterActor (policy + RayDispatcher)
      --Ray calls--> PrefillWorker x N  --KV pages over NIXL / TCP-->  DecodeWorker x M
Metrics: every process of the node writes to one prometheus multiprocess directory; the driver serves
the aggregate at http://HOST:METRICS_PORT/metrics. Workers are restarted by Ray (max_restarts=-1);
the router's health loop removes a dead worker and adds it back with its new transfer metadata.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kv_transfer.registry import TRANSFER_CHOICES, TRANSFER_HELP

ENGINE_OPTION_KEYS = ("device", "dtype", "max_batch_tokens", "max_num_seqs", "max_cached_tokens", "kv_cache_dtype",
                      "decode_mode", "keep_mxfp4_experts")


@dataclass(frozen=True)
class ServiceConfig:
    model_dir: str
    model_name: str = "dsv4"
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 8080
    router_port: int = 0  # 0: any free port (a fixed one can collide with another router on the machine)
    prefill_workers: int = 1
    decode_workers: int = 1
    transfer: str = "auto"
    router_policy: str = "cache_aware"
    engine_options: tuple = ()  # (key, value) pairs for load_engine
    worker_num_cpus: float = 0.5
    ready_timeout_s: float = 300.0  # per startup stage: workers pinged, router bound, HTTP ingress answering


class ServiceStartError(RuntimeError):
    """A part of the service did not come up; the message names which part and what Ray reported."""


class RouterActor:
    """Hosts the gRPC router (grpc.aio) in a Ray actor's event loop."""

    def __init__(self, prefill: dict, decode: dict, policy: str):
        from service.ray_dispatcher import RayDispatcher
        from router.policy import PolicyConfig, RoutingPolicy
        from router.server import RouterServer

        self.dispatcher = RayDispatcher(prefill, decode)
        self.server = RouterServer(self.dispatcher, RoutingPolicy(PolicyConfig(name=policy)),
                                   health_interval_s=1.0, health_timeout_s=10.0)
        self.port = None

    async def start(self, host: str, port: int) -> int:
        await self.dispatcher.health_check()  # exchanges transfer metadata before the first request
        self.port = await self.server.start(host, port)
        return self.port

    async def stop(self) -> None:
        await self.server.stop(1.0)


def remote_classes(cfg: ServiceConfig):
    import ray

    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    # A worker on a GPU engine owns one GPU (Ray sets CUDA_VISIBLE_DEVICES, so "cuda" means that GPU).
    num_gpus = 1 if str(dict(cfg.engine_options).get("device", "cpu")).startswith("cuda") else 0
    common = dict(max_restarts=-1, max_task_retries=0, num_cpus=cfg.worker_num_cpus, num_gpus=num_gpus,
                  max_concurrency=1000)
    return (ray.remote(**common)(PrefillWorker), ray.remote(**common)(DecodeWorker),
            ray.remote(num_cpus=0, max_concurrency=1000)(RouterActor))


def start_service(cfg: ServiceConfig, http: bool = True) -> dict:
    """Deploy everything on the connected Ray cluster; -> handles and URLs. `http=False` skips Ray Serve.
    Each stage waits at most cfg.ready_timeout_s, then raises ServiceStartError naming what is not up."""
    prefill_cls, decode_cls, router_cls = remote_classes(cfg)
    opts = dict(cfg.engine_options)
    prefill = {f"prefill-{i}": prefill_cls.options(name=f"dsv4-prefill-{i}").remote(
        f"prefill-{i}", cfg.model_dir, opts, cfg.transfer) for i in range(cfg.prefill_workers)}
    decode = {f"decode-{i}": decode_cls.options(name=f"dsv4-decode-{i}").remote(
        f"decode-{i}", cfg.model_dir, opts, cfg.transfer) for i in range(cfg.decode_workers)}
    _wait_ready({name: h.ping.remote() for name, h in (*prefill.items(), *decode.items())}, cfg.ready_timeout_s,
                "worker actors")
    router = router_cls.options(name="dsv4-router").remote(prefill, decode, cfg.router_policy)
    bind = "127.0.0.1" if cfg.host in ("127.0.0.1", "localhost") else "0.0.0.0"
    router_port = _wait_ready({"router": router.start.remote(bind, cfg.router_port)}, cfg.ready_timeout_s,
                              "gRPC router")["router"]
    router_addr = f"127.0.0.1:{router_port}"
    if http:
        from service.serve_ingress import deploy_http

        deploy_http(router_addr, cfg.model_dir, cfg.model_name, cfg.host, cfg.port)
        # serve.run returns when the replica runs; the proxy may not route to it yet: wait until it does
        probe = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        _wait_http(f"http://{probe}:{cfg.port}/v1/models", cfg.ready_timeout_s)
    return {"prefill": prefill, "decode": decode, "router": router, "router_addr": router_addr,
            "http": f"http://{cfg.host}:{cfg.port}", "metrics": f"http://{cfg.host}:{cfg.metrics_port}/metrics"}


def _wait_ready(refs: dict, timeout_s: float, what: str) -> dict:
    """{name: ObjectRef} -> {name: value}, all within timeout_s; else ServiceStartError naming each failed
    or unfinished one (an actor whose constructor raised reports that error here)."""
    import ray

    names = {ref: name for name, ref in refs.items()}
    done, pending = ray.wait(list(names), num_returns=len(names), timeout=timeout_s)
    values, problems = {}, []
    for ref in done:
        try:
            values[names[ref]] = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - reported below with the others
            problems.append(f"{names[ref]}: {type(e).__name__}: {str(e).strip()[-2000:]}")
    problems += [f"{names[ref]}: not ready after {timeout_s:.0f} s" for ref in pending]
    if problems:
        raise ServiceStartError(f"{what} did not come up:\n  " + "\n  ".join(problems))
    return values


def _wait_http(url: str, timeout_s: float) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            with opener.open(url, timeout=5) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.25)
    raise ServiceStartError(f"HTTP ingress {url} not answering after {timeout_s:.0f} s (last: {last})")


def ray_logs_dir() -> Path | None:
    """The logs directory of this process's Ray session, else of the newest session on the machine."""
    try:
        from ray._private import worker

        node = worker._global_node
    except Exception:  # noqa: BLE001 - private API: fall back to the default temp dir
        node = None
    if node is not None:
        return Path(node.get_logs_dir_path())
    root = Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray"
    sessions = sorted(root.glob("session_2*"), key=lambda p: p.stat().st_mtime)
    return sessions[-1] / "logs" if sessions else None


def ray_logs_tail(max_chars: int = 12000, per_file: int = 1500) -> str:
    """The ends of the Ray session's log files (raylet, GCS, workers, Serve), those reporting errors first:
    what a failed start says when the exception alone does not."""
    logs = ray_logs_dir()
    if logs is None or not logs.is_dir():
        return "Ray logs: no session directory found"
    tails = []
    for path in logs.rglob("*"):
        try:
            if not (path.is_file() and path.suffix in (".err", ".out", ".log")):
                continue
            size, mtime = path.stat().st_size, path.stat().st_mtime
            with open(path, "rb") as f:
                f.seek(max(0, size - per_file))
                text = f.read().decode(errors="replace").strip()
        except OSError:  # a worker's file rotated away meanwhile
            continue
        if text:
            tails.append((not re.search(r"Traceback|Error|FATAL|Exception", text), -mtime, path, text))
    tails.sort(key=lambda t: t[:2])
    out, used = [f"Ray logs ({logs}); ends of the files, those reporting errors first:"], 0
    for *_, path, text in tails:
        block = f"--- {path.relative_to(logs)} ---\n{text}"
        if used + len(block) > max_chars:
            break
        out.append(block)
        used += len(block)
    return "\n".join(out)


def add_engine_speed_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `dsv4 generate` and `dsv4 serve` that pick GPU execution paths (default None = auto)."""
    parser.add_argument("--decode-mode", default=None, choices=["auto", "eager", "graphs", "bucketed"],
                        help="decode steps: auto = CUDA graphs on CUDA with exact caches, else eager")
    parser.add_argument("--keep-mxfp4-experts", action="store_true", default=None,
                        help="keep MXFP4 routed experts packed in GPU memory (Triton MXFP4 MoE kernel)")


def init_ray(metrics_dir: str) -> None:
    """Start a fresh local cluster unless RAY_ADDRESS is set; our workers share the metrics directory.

    `address="local"` so a stale /tmp/ray/ray_current_cluster from an earlier run is never joined. The
    metrics variable reaches our processes through the job's runtime_env only: Ray's own daemons (raylet,
    dashboard agent), spawned by ray.init, must not inherit it or their metrics would mix into ours.
    """
    import ray

    env = {"PROMETHEUS_MULTIPROC_DIR": metrics_dir, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    saved = os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", runtime_env={"env_vars": env},
                 include_dashboard=False, logging_level="WARNING")
    finally:
        if saved is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved


def stop_service(handles: dict | None) -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
    if handles:
        try:
            ray.get(handles["router"].stop.remote(), timeout=5)
        except Exception:  # noqa: BLE001
            pass
    ray.shutdown()


def prepare_metrics_dir() -> str:
    """Must run before prometheus_client is imported anywhere in this process."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="dsv4-metrics-")
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def serve_main(args: argparse.Namespace) -> int:
    from engine.make_model import default_model_dir

    metrics_dir = prepare_metrics_dir()
    from engine.metrics import start_metrics_server

    engine_options = tuple((k, getattr(args, k)) for k in ENGINE_OPTION_KEYS if getattr(args, k, None) is not None)
    cfg = ServiceConfig(model_dir=args.model or default_model_dir(), model_name=args.served_model_name,
                        host=args.host, port=args.port, metrics_port=args.metrics_port, router_port=args.router_port,
                        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                        transfer=args.transfer, router_policy=args.router_policy, engine_options=engine_options)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    init_ray(metrics_dir)
    handles = None
    try:
        try:
            start_metrics_server(cfg.metrics_port, cfg.host)
            handles = start_service(cfg)
        except Exception:
            print(f"dsv4 serve: startup failed\n{ray_logs_tail()}", file=sys.stderr, flush=True)
            raise
        from kv_transfer.registry import resolve_name

        print(f"dsv4 serving {cfg.model_name} ({cfg.prefill_workers}P{cfg.decode_workers}D, transfer "
              f"{resolve_name(cfg.transfer)}, policy {cfg.router_policy})", flush=True)
        print(f"  OpenAI API: {handles['http']}/v1", flush=True)
        print(f"  router:     grpc://{handles['router_addr']}", flush=True)
        print(f"  metrics:    {handles['metrics']}", flush=True)
        while not stop.wait(0.5):
            pass
        print("dsv4: shutting down", flush=True)
    finally:
        stop_service(handles)
    return 0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    parser.add_argument("--served-model-name", default="dsv4")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8080)
    parser.add_argument("--router-port", type=int, default=0, help="gRPC router port (0 = any free port)")
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--transfer", default="auto", choices=TRANSFER_CHOICES, help=TRANSFER_HELP)
    parser.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "least_loaded",
                                                                           "round_robin"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-cached-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                        help="KV cache format of every worker (default auto: exact rows; fp8: production formats)")
    add_engine_speed_args(parser)


__all__ = ["ServiceConfig", "ServiceStartError", "serve_main", "start_service", "stop_service", "init_ray",
           "add_serve_args", "prepare_metrics_dir", "ray_logs_dir", "ray_logs_tail", "RouterActor"]
