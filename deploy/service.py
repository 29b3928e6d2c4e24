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
import signal
import tempfile
import threading
from dataclasses import dataclass

ENGINE_OPTION_KEYS = ("device", "dtype", "max_batch_tokens", "max_num_seqs", "max_cached_tokens", "kv_cache_dtype")


@dataclass(frozen=True)
class ServiceConfig:
    model_dir: str
    model_name: str = "dsv4"
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 8080
    router_port: int = 50051
    prefill_workers: int = 1
    decode_workers: int = 1
    transfer: str = "auto"
    router_policy: str = "cache_aware"
    engine_options: tuple = ()  # (key, value) pairs for load_engine
    worker_num_cpus: float = 0.5


class RouterActor:
    """Hosts the gRPC router (grpc.aio) in a Ray actor's event loop."""

    def __init__(self, prefill: dict, decode: dict, policy: str):
        from deploy.ray_dispatch import RayDispatcher
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


def _remote_classes(cfg: ServiceConfig):
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
    """Deploy everything on the connected Ray cluster; -> handles and URLs. `http=False` skips Ray Serve."""
    import ray

    prefill_cls, decode_cls, router_cls = _remote_classes(cfg)
    opts = dict(cfg.engine_options)
    prefill = {f"prefill-{i}": prefill_cls.options(name=f"dsv4-prefill-{i}").remote(
        f"prefill-{i}", cfg.model_dir, opts, cfg.transfer) for i in range(cfg.prefill_workers)}
    decode = {f"decode-{i}": decode_cls.options(name=f"dsv4-decode-{i}").remote(
        f"decode-{i}", cfg.model_dir, opts, cfg.transfer) for i in range(cfg.decode_workers)}
    ray.get([h.ping.remote() for h in (*prefill.values(), *decode.values())])
    router = router_cls.options(name="dsv4-router").remote(prefill, decode, cfg.router_policy)
    router_port = ray.get(router.start.remote("127.0.0.1" if cfg.host in ("127.0.0.1", "localhost") else "0.0.0.0",
                                              cfg.router_port))
    router_addr = f"127.0.0.1:{router_port}"
    if http:
        from deploy.serve_app import deploy_http

        deploy_http(router_addr, cfg.model_dir, cfg.model_name, cfg.host, cfg.port)
    return {"prefill": prefill, "decode": decode, "router": router, "router_addr": router_addr,
            "http": f"http://{cfg.host}:{cfg.port}", "metrics": f"http://{cfg.host}:{cfg.metrics_port}/metrics"}


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
        start_metrics_server(cfg.metrics_port, cfg.host)
        handles = start_service(cfg)
        from kv_transfer.base import resolve_name

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
    parser.add_argument("--transfer", default="auto", choices=["auto", "nixl", "tcp"],
                        help="KV transfer backend (auto = NIXL when importable, else the tcp fallback)")
    parser.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "least_loaded",
                                                                           "round_robin"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-cached-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                        help="KV cache format of every worker (default auto: exact rows; fp8: production formats)")


__all__ = ["ServiceConfig", "serve_main", "start_service", "stop_service", "init_ray", "add_serve_args",
           "prepare_metrics_dir", "RouterActor"]
