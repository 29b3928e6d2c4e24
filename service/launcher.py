"""`dsv4 serve`: start (or join) a Ray cluster, the worker pools, the gRPC router and the HTTP ingress.

Topology (one Ray cluster; scales out unchanged when RAY_ADDRESS points at a multi-node cluster):
  Ray Serve HTTP proxy -> ingress replicas (FastAPI, OpenAI API) --gRPC Place--> RouterActor x R (placement only)
  ingress replica --Ray calls--> PrefillWorker x N  --KV pages over NIXL / TCP-->  DecodeWorker x M
  DecodeWorker --Ray stream (tokens)--> the ingress replica that placed the request (service.direct_path)
The parts live in their own modules: the cluster and its logs (service.ray_cluster), the worker pools
(service.actor_pools), the router actor (service.router_actor), the HTTP app on Ray Serve (service.serve_ingress),
the flags (service.serve_args). This module starts and stops them in order.
Metrics: every process of the node writes to one prometheus multiprocess directory; the driver serves
the aggregate at http://METRICS_HOST:METRICS_PORT/metrics. The router's health loop removes a dead worker and adds
it back once it is re-introduced to its peers.

Exposure: only the HTTP API listens on --host. Internal endpoints (the gRPC router, the tcp KV transfer
listeners, the metrics page) bind loopback when the cluster is this one node, the node's own address
otherwise, and the router and the transfer listeners require the per-service token (`router.auth`), which
travels only through Ray. Startup checks the cluster can place every actor (CPUs, GPUs) before creating any,
and fails with the numbers. SIGTERM / SIGINT run `stop_service`: new requests are refused, in-flight ones get
`drain_s` to finish, then the router, Serve, the workers and the local Ray cluster stop, and the metrics
directory this run created is removed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from dsv4_kernels.settings import API_DOCS
from service.actor_pools import (
    check_placement,
    pool_launch,
    remote_classes,
    start_pools,
    worker_engine_options,
    worker_gpus,
)
from service.pools import start_elastic, stop_elastic
from service.rank_placement import remove_worker
from service.ray_cluster import (
    LOCAL_START_ATTEMPTS,
    ServiceStartError,
    init_ray,
    internal_host,
    prepare_metrics_dir,
    ray_logs_dir,
    ray_logs_tail,
    remove_metrics_dir,
    single_node,
    wait_http,
)
from service.router_actor import RouterActor, start_routers
from service.serve_args import add_engine_speed_args, add_serve_args, config_from_args
from service.service_config import ENGINE_OPTION_KEYS, ServiceConfig


def start_service(cfg: ServiceConfig, http: bool = True) -> dict:
    """Deploy everything on the connected Ray cluster; -> handles and URLs. `http=False` skips Ray Serve.
    Each stage waits at most cfg.ready_timeout_s, then raises ServiceStartError naming what is not up."""
    from router.auth import new_token
    from service.ingress_guard import IngressOptions

    check_placement(cfg, http)
    host, token = internal_host(), new_token()
    launch = pool_launch(cfg, host, token)
    handles: dict = {"prefill": {}, "decode": {}, "placed": {}}
    try:
        groups = start_pools(launch, handles)
        prefill, decode = handles["prefill"], handles["decode"]
        pools = handles["pools"] = start_elastic(cfg, launch, handles) if cfg.elastic else None
        routers = handles["routers"] = start_routers(
            cfg, prefill, decode, groups, (host, cfg.router_port), token, pools
        )
        handles["router"] = routers[0]  # the one that supervises multi-rank groups
        import ray

        router_addr = handles["router_addr"] = ray.get(routers[0].address.remote())
        if http:
            from service.serve_ingress import deploy_http

            options = IngressOptions.from_env(
                api_key=cfg.api_key,
                router_token=token,
                internal_host=host,
                max_body_bytes=cfg.max_body_bytes,
                allow_request_templates=cfg.allow_request_chat_template,
                max_model_len=dict(cfg.engine_options).get("max_model_len"),
                limits=cfg.http_limits,
            )
            handles["serve"] = True
            deploy_http(
                router_addr,
                cfg.model_dir,
                cfg.model_name,
                cfg.host,
                cfg.port,
                num_replicas=cfg.ingress_replicas,
                options=options,
                routers=routers,
            )
            # serve.run returns when the replica runs; the proxy may not route to it yet: wait until it does
            probe = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
            wait_http(f"http://{probe}:{cfg.port}/health", cfg.ready_timeout_s)
    except BaseException:
        stop_service(handles, drain_s=0, shutdown_ray=False)
        raise
    return {**handles, "http": f"http://{cfg.host}:{cfg.port}", "token": token}


def _in_flight(routers: list, decode: dict) -> int:
    """Requests still in flight: waiting for a placement at a router, or held by a decode worker (streams run
    from the decode workers to the ingress replicas, past the routers)."""
    import ray

    waiting = sum(ray.get([r.active.remote() for r in routers], timeout=5))
    held = 0
    for h in decode.values():
        try:
            held += ray.get(h.stats.remote(), timeout=5).load.running
        except Exception:  # noqa: BLE001 - a dead worker holds nothing
            pass
    return waiting + held


def stop_service(handles: dict | None, drain_s: float = 10.0, shutdown_ray: bool = True) -> None:
    """Stop in order, each step bounded: refuse new requests, let in-flight ones finish for up to drain_s, kill the
    workers (streams still open end with an in-band error and [DONE] from the ingress, which can place them
    nowhere), stop the routers and Serve, and (shutdown_ray) stop this process's Ray cluster with its daemons."""
    import ray
    from ray import serve

    handles = handles or {}
    routers = list(handles.get("routers") or ([handles["router"]] if handles.get("router") is not None else []))
    placed = dict(handles.get("placed", {}))
    workers = (*handles.get("prefill", {}).values(), *handles.get("decode", {}).values())
    if routers and ray.is_initialized():
        try:
            placed.update(ray.get(routers[0].placed_workers.remote(), timeout=5))  # as a group restart left them
        except Exception:  # noqa: BLE001 - the router is gone: what start_service placed
            pass
        try:
            ray.get([r.drain.remote() for r in routers], timeout=5)
            deadline = time.monotonic() + drain_s
            while time.monotonic() < deadline and _in_flight(routers, handles.get("decode", {})):
                time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            print(f"dsv4: drain: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if ray.is_initialized():
        pools = handles.get("pools")
        elastic = stop_elastic(pools) if pools is not None else []  # the workers it added are detached
        # placed: rank 0 of a group placed again since start
        _kill([*elastic, *([pools] if pools is not None else []), *workers, *(pw.handle for pw in placed.values())])
        for pw in placed.values():
            remove_worker(pw)
        if handles.get("serve"):
            time.sleep(1.0)  # the ingress replicas write the broken streams' in-band errors
        for r in routers:
            try:
                ray.get(r.stop.remote(1.0), timeout=10)
            except Exception as e:  # noqa: BLE001 - best effort on the way out
                print(f"dsv4: router stop: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001
            pass
        _kill(routers)
    if shutdown_ray:
        ray.shutdown()


def _kill(actors) -> None:
    import ray

    for h in actors:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def serve_main(args: argparse.Namespace) -> int:
    metrics_dir = prepare_metrics_dir()
    from engine.telemetry.metrics import start_metrics_server

    cfg = config_from_args(args)
    stop = threading.Event()
    handles, metrics = None, None
    try:
        init_ray(metrics_dir, {API_DOCS: "1"} if cfg.api_docs else {}, own_session=True)
        # After ray.init, which installs its own SIGTERM handler: ours runs the service's shutdown below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        try:
            metrics_host = cfg.metrics_host or internal_host()
            if metrics_host == "node":
                from kv_transfer.node_address import node_address

                metrics_host = node_address()
            metrics, _ = start_metrics_server(cfg.metrics_port, metrics_host)
            handles = start_service(cfg)
        except Exception:
            print(f"dsv4 serve: startup failed\n{ray_logs_tail()}", file=sys.stderr, flush=True)
            raise
        from kv_transfer.registry import resolve_name

        m_host, m_port = metrics.server_address[:2]
        print(
            f"dsv4 serving {cfg.model_name} ({cfg.prefill_workers}P{cfg.decode_workers}D, transfer "
            f"{resolve_name(cfg.transfer)}, policy {cfg.router_policy})",
            flush=True,
        )
        print(
            f"  OpenAI API: {handles['http']}/v1 ({cfg.ingress_replicas} replicas, API key "
            f"{'required' if cfg.api_key else 'off'})",
            flush=True,
        )
        print(
            f"  router:     grpc://{handles['router_addr']} ({cfg.routers} replicas, cluster token required)",
            flush=True,
        )
        print(f"  metrics:    http://{m_host}:{m_port}/metrics", flush=True)
        while not stop.wait(0.5):
            pass
        print(f"dsv4: shutting down (draining for up to {cfg.drain_s:g} s)", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C during shutdown ends it hard
        stop_service(handles, cfg.drain_s)
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        remove_metrics_dir()
    return 0


__all__ = [
    "ENGINE_OPTION_KEYS",
    "LOCAL_START_ATTEMPTS",
    "RouterActor",
    "ServiceConfig",
    "ServiceStartError",
    "add_engine_speed_args",
    "add_serve_args",
    "check_placement",
    "config_from_args",
    "init_ray",
    "prepare_metrics_dir",
    "ray_logs_dir",
    "ray_logs_tail",
    "remote_classes",
    "remove_metrics_dir",
    "serve_main",
    "single_node",
    "start_service",
    "stop_service",
    "worker_engine_options",
    "worker_gpus",
]
