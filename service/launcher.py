"""`dsv4 serve`: start (or join) a Ray cluster, the worker pools, the gRPC router and the HTTP ingress.

Topology (one Ray cluster; scales out unchanged when RAY_ADDRESS points at a multi-node cluster):
  Ray Serve HTTP (FastAPI, OpenAI API) --gRPC--> RouterActor (policy + RayDispatcher)
      --Ray calls--> PrefillWorker x N  --KV pages over NIXL / TCP-->  DecodeWorker x M
Metrics: every process of the node writes to one prometheus multiprocess directory; the driver serves
the aggregate at http://METRICS_HOST:METRICS_PORT/metrics. Workers are restarted by Ray (max_restarts=-1);
multi-rank workers as a whole group by the router actor's supervisor (service.group_restart); the router's
health loop removes a dead worker and adds it back once it is re-introduced to its peers.

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
import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dsv4_kernels.settings import API_DOCS, settings
from engine.runtime.health import DEFAULT_STALL_TIMEOUT_S
from kv_transfer.registry import TRANSFER_CHOICES, TRANSFER_HELP
from service.ingress_guard import DEFAULT_MAX_BODY_BYTES
from service.rank_placement import place_worker, remove_worker
from service.service_config import ENGINE_OPTION_KEYS, ServiceConfig, role_engine_options


class ServiceStartError(RuntimeError):
    """A part of the service did not come up; the message names which part and what Ray reported."""


class RouterActor:
    """Hosts the gRPC router (grpc.aio) in a Ray actor's event loop."""

    def __init__(
        self, prefill: dict, decode: dict, policy: str, token: str | None = None, groups: tuple = ({}, {}), **server_kw
    ):
        """server_kw: RouterServer's admission settings (max_queued, queue_timeout_s, restart_wait_s);
        groups: ({worker id: PlacedWorker}, {worker id: GroupRecipe}) of the multi-rank workers, restarted as a
        group when a rank dies (service.group_restart)."""
        from router.policy import PolicyConfig, RoutingPolicy
        from router.server import RouterServer
        from service.group_restart import GroupSupervisor
        from service.ray_dispatcher import RayDispatcher

        self.dispatcher = RayDispatcher(prefill, decode)
        self.server = RouterServer(
            self.dispatcher,
            RoutingPolicy(PolicyConfig(name=policy)),
            health_interval_s=1.0,
            health_timeout_s=10.0,
            auth_token=token,
            **server_kw,
        )
        self.port = None
        self.host = None
        self._token = token
        placed, recipes = groups
        self.supervisor = GroupSupervisor(placed, recipes, replace=self.dispatcher.replace_handle) if placed else None
        self._supervising = None

    async def start(self, host: str, port: int) -> int:
        """Bind host:port ("node": this node's cluster address); -> the port."""
        from kv_transfer.registry import node_address

        self.host = node_address() if host == "node" else host
        await self.dispatcher.health_check()  # exchanges transfer metadata before the first request
        self.port = await self.server.start(self.host, port)
        if self.supervisor is not None:
            self._supervising = asyncio.get_running_loop().create_task(self.supervisor.run())
        return self.port

    def placed_workers(self) -> dict:
        """The multi-rank workers as they are placed now (a group restart replaces their actors and group)."""
        return dict(self.supervisor.placed) if self.supervisor is not None else {}

    def group_restarts(self) -> int:
        return self.supervisor.restarts if self.supervisor is not None else 0

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def token(self) -> str | None:
        """The cluster token (callable only through Ray: the ingress of a re-run KubeRay builder reads it)."""
        return self._token

    def active(self) -> int:
        return self.server._active

    def queued(self) -> int:
        """Requests waiting at the router for a decode slot."""
        return self.server._queued

    def drain(self) -> None:
        """Refuse new requests from now on (shutdown)."""
        self.server.draining = True

    async def stop(self, grace: float = 1.0) -> None:
        if self._supervising is not None:
            self._supervising.cancel()
        await self.server.stop(grace)


def remote_classes(cfg: ServiceConfig):
    import ray

    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    # A worker on a GPU engine owns one GPU, or a share of one (Ray sets CUDA_VISIBLE_DEVICES, so "cuda" means it).
    common = dict(
        max_restarts=-1,
        max_task_retries=0,
        num_cpus=cfg.worker_num_cpus,
        num_gpus=worker_gpus(cfg),
        max_concurrency=1000,
    )
    return (
        ray.remote(**common)(PrefillWorker),
        ray.remote(**common)(DecodeWorker),
        ray.remote(num_cpus=0, max_concurrency=1000)(RouterActor),
    )


def worker_gpus(cfg: ServiceConfig) -> float:
    """GPUs one rank reserves: 0 off CUDA, else cfg.worker_num_gpus (default 1; a fraction shares a GPU)."""
    if not str(dict(cfg.engine_options).get("device", "cpu")).startswith("cuda"):
        return 0
    share = 1 if cfg.worker_num_gpus is None else cfg.worker_num_gpus
    if not 0 < share <= 1:
        raise ValueError(f"worker_num_gpus must be in (0, 1] (a rank runs on one GPU), got {share}")
    return share


def worker_engine_options(cfg: ServiceConfig) -> dict:
    """The workers' engine options; a worker on a share of a GPU gets that share of the default memory budget."""
    opts = dict(cfg.engine_options)
    share = worker_gpus(cfg)
    if 0 < share < 1 and opts.get("gpu_memory_utilization") is None and opts.get("max_cached_tokens") is None:
        from engine.loading.memory_plan import DEFAULT_UTILIZATION

        opts["gpu_memory_utilization"] = round(DEFAULT_UTILIZATION * share, 4)
    return opts


def single_node() -> bool:
    """Is the connected Ray cluster this one machine (internal endpoints may then stay on loopback)?"""
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) == 1


def internal_host(cfg: ServiceConfig | None = None) -> str:
    """Where internal listeners bind: loopback on one node, else "node" (each process's node address)."""
    return "127.0.0.1" if single_node() else "node"


def check_placement(cfg: ServiceConfig, http: bool = True) -> None:
    """Fail fast, with the numbers, when the cluster can never place every actor of the service."""
    import ray

    from service.serve_ingress import INGRESS_NUM_CPUS

    # one actor a rank
    workers = sum(
        n * cfg.parallel(role)[0] for role, n in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers))
    )
    num_gpus = worker_gpus(cfg)
    need = {
        "CPU": workers * cfg.worker_num_cpus + (cfg.ingress_replicas * INGRESS_NUM_CPUS if http else 0),
        "GPU": workers * num_gpus,
    }
    total, free = ray.cluster_resources(), ray.available_resources()
    short = [
        f"{k}: need {v:g} ({workers} workers x {cfg.worker_num_cpus if k == 'CPU' else num_gpus:g}"
        + (f" + {cfg.ingress_replicas} HTTP replicas x {INGRESS_NUM_CPUS:g}" if k == "CPU" and http else "")
        + f"), the cluster has {total.get(k, 0):g} in all and {free.get(k, 0):g} free"
        for k, v in need.items()
        if v > free.get(k, 0) + 1e-9
    ]
    if short:
        raise ServiceStartError(
            "the Ray cluster cannot place the service:\n  "
            + "\n  ".join(short)
            + "\n  (fewer workers, a smaller per-worker CPU reservation, or a bigger cluster)"
        )


def _job_env() -> dict:
    """The job's runtime_env variables (an actor's own runtime_env replaces them unless repeated)."""
    import ray

    try:
        return dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {})
    except Exception:  # noqa: BLE001 - older Ray: nothing to repeat
        return {}


def start_service(cfg: ServiceConfig, http: bool = True) -> dict:
    """Deploy everything on the connected Ray cluster; -> handles and URLs. `http=False` skips Ray Serve.
    Each stage waits at most cfg.ready_timeout_s, then raises ServiceStartError naming what is not up."""
    from engine.runtime.health import HealthOptions
    from kv_transfer.registry import resolve_name
    from router.auth import new_token
    from service.ingress_guard import IngressOptions

    check_placement(cfg, http)
    prefill_cls, decode_cls, router_cls = remote_classes(cfg)
    opts = worker_engine_options(cfg)
    host, token = internal_host(cfg), new_token()
    net = dict(
        bind_host=None if host == "127.0.0.1" else "node",
        cluster_token=token,
        health=HealthOptions(cfg.stall_timeout_s, cfg.worker_test_hooks, exit_on_failure=True),
    )
    actor = {}
    if host == "127.0.0.1" and resolve_name(cfg.transfer) == "nixl" and "UCX_NET_DEVICES" not in os.environ:
        # One node: UCX's network transports listen on loopback only (shared memory and CUDA IPC, which
        # carry the transfers here, are not network devices); otherwise UCX also listens on the node address.
        actor["runtime_env"] = {"env_vars": {**_job_env(), "UCX_NET_DEVICES": "lo"}}
    handles: dict = {"prefill": {}, "decode": {}}
    try:
        placed = handles["placed"] = {}
        for role, cls, count in (
            ("prefill", prefill_cls, cfg.prefill_workers),
            ("decode", decode_cls, cfg.decode_workers),
        ):
            for i in range(count):
                ropts = role_engine_options(opts, role)
                placed[f"{role}-{i}"] = place_worker(
                    cls,
                    f"dsv4-{role}-{i}",
                    (f"{role}-{i}", cfg.model_dir, ropts, cfg.transfer),
                    net,
                    ropts,
                    cfg.model_dir,
                    *cfg.parallel(role)[:2],
                    cfg.worker_num_cpus,
                    worker_gpus(cfg),
                    actor,
                    cfg.ready_timeout_s,
                    cfg.parallel(role)[2],
                )
                handles[role][f"{role}-{i}"] = placed[f"{role}-{i}"].handle
                handles[role].update(placed[f"{role}-{i}"].ranks)  # data-parallel attention: each rank a worker
        prefill, decode = handles["prefill"], handles["decode"]
        groups = _group_recipes(cfg, placed, prefill_cls, decode_cls, net, opts, actor)
        _wait_ready(
            {name: h.ping.remote() for name, h in (*prefill.items(), *decode.items())}
            | {
                f"{name}-rank{r}": f.ping.remote()
                for name, pw in placed.items()
                for r, f in enumerate(pw.followers, start=1)
            },
            cfg.ready_timeout_s,
            "worker actors",
        )
        router = handles["router"] = router_cls.options(name="dsv4-router").remote(
            prefill,
            decode,
            cfg.router_policy,
            token,
            groups=groups,
            max_queued=cfg.router_max_queued,
            queue_timeout_s=cfg.router_queue_timeout_s,
        )
        _wait_ready({"router": router.start.remote(host, cfg.router_port)}, cfg.ready_timeout_s, "gRPC router")
        import ray

        router_addr = handles["router_addr"] = ray.get(router.address.remote())
        if http:
            from service.serve_ingress import deploy_http

            options = IngressOptions.from_env(
                api_key=cfg.api_key,
                router_token=token,
                max_body_bytes=cfg.max_body_bytes,
                allow_request_templates=cfg.allow_request_chat_template,
                max_model_len=dict(cfg.engine_options).get("max_model_len"),
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
            )
            # serve.run returns when the replica runs; the proxy may not route to it yet: wait until it does
            probe = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
            _wait_http(f"http://{probe}:{cfg.port}/health", cfg.ready_timeout_s)
    except BaseException:
        stop_service(handles, drain_s=0, shutdown_ray=False)
        raise
    return {**handles, "http": f"http://{cfg.host}:{cfg.port}", "token": token}


def _group_recipes(
    cfg: ServiceConfig, placed: dict, prefill_cls, decode_cls, net: dict, opts: dict, actor: dict
) -> tuple[dict, dict]:
    """({worker id: PlacedWorker}, {worker id: GroupRecipe}) of the multi-rank workers: how to place each again."""
    from service.group_restart import GroupRecipe

    recipes = {}
    for wid in placed:
        role = wid.rsplit("-", 1)[0]
        size, ep, dp = cfg.parallel(role)
        if size > 1:
            ropts = role_engine_options(opts, role)
            recipes[wid] = GroupRecipe(
                f"dsv4-{wid}",
                prefill_cls if role == "prefill" else decode_cls,
                (wid, cfg.model_dir, ropts, cfg.transfer),
                net,
                ropts,
                cfg.model_dir,
                size,
                ep,
                cfg.worker_num_cpus,
                worker_gpus(cfg),
                actor,
                cfg.ready_timeout_s,
                dp,
            )
    return {wid: placed[wid] for wid in recipes}, recipes


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
    parser.add_argument(
        "--decode-mode",
        default=None,
        choices=["auto", "eager", "graphs", "bucketed"],
        help="decode steps: auto = CUDA graphs on CUDA with exact caches, else eager",
    )
    parser.add_argument(
        "--keep-mxfp4-experts",
        action="store_true",
        default=None,
        help="keep MXFP4 routed experts packed in GPU memory (Triton MXFP4 MoE kernel)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="share of GPU memory the engine may use (default 0.90): the KV cache gets what is left "
        "after weights and an activation/CUDA-graph reserve; --max-cached-tokens overrides it",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest request (prompt + output) in tokens, at most the model's max_position_embeddings "
        "(default): bounds the minimum KV cache the start-up fit check asks for",
    )
    parser.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        default=None,
        help="do not reuse cached prompt prefixes across requests (engine.execution.prefix_cache; on by default)",
    )


LOCAL_START_ATTEMPTS = 3  # init_ray: a fresh local cluster that misses Ray's start-up deadline is started again


@contextlib.contextmanager
def _daemons_in_own_session():
    """Ray's daemons (GCS, raylet, ...) that ray.init spawns start in a session of their own: a SIGTERM to the
    driver's process group (`kill -TERM -- -PGID`, systemd, container runtimes) then reaches only the driver, whose
    handler drains and stops them in order (`stop_service`), instead of killing them under the drain. Measured:
    9 s instead of 45 s with a 2 s drain. A driver killed hard relies on Ray's own fate-sharing (not changed here).
    Patches the one Popen class Ray's `start_ray_process` uses, only while ray.init runs."""
    from ray._private import services

    base: Any = services.ConsolePopen  # Ray's Popen subclass (typed as a type alias there)

    class OwnSession(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    setattr(services, "ConsolePopen", OwnSession)  # noqa: B010 - assigning a class mypy takes for a type alias
    try:
        yield
    finally:
        setattr(services, "ConsolePopen", base)  # noqa: B010


def owner_only_ray_token() -> str | None:
    """Make Ray's token file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token, which Ray writes world-readable) readable
    by its owner only; -> its path when it exists. Whoever reads the token can run code on the cluster. Ray's
    token authentication itself is never turned off here (no RAY_AUTH_MODE is set)."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        st = path.stat()
    except OSError:
        return None
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, 0o600)
    return str(path)


def init_ray(metrics_dir: str, extra_env: dict | None = None, own_session: bool = False) -> None:
    """Start a fresh local cluster unless RAY_ADDRESS is set; our workers share the metrics directory.

    `address="local"` so a stale /tmp/ray/ray_current_cluster from an earlier run is never joined. The
    metrics variable reaches our processes through the job's runtime_env only: Ray's own daemons (raylet,
    dashboard agent), spawned by ray.init, must not inherit it or their metrics would mix into ours.
    A local cluster that misses Ray's start-up deadline is started again, up to LOCAL_START_ATTEMPTS times.
    own_session (`dsv4 serve`): a local cluster's daemons start in their own session (_daemons_in_own_session).
    """
    import ray

    env = {
        "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **(extra_env or {}),
    }
    address = os.environ.get("RAY_ADDRESS") or "local"
    saved = os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    try:
        for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
            try:
                with _daemons_in_own_session() if own_session and address == "local" else contextlib.nullcontext():
                    ray.init(
                        address=address, runtime_env={"env_vars": env}, include_dashboard=False, logging_level="WARNING"
                    )
                owner_only_ray_token()
                return
            except Exception as e:
                # A fresh local cluster can miss Ray's start-up deadline on a loaded machine ("The current node
                # timed out during startup": its raylet had not registered; seen once on the 2-core CI box).
                # Start it again; a cluster named by RAY_ADDRESS is someone else's to fix.
                if address != "local" or attempt == LOCAL_START_ATTEMPTS:
                    raise
                print(
                    f"dsv4: the local Ray cluster did not start ({type(e).__name__}: {e}); starting it again "
                    f"({attempt + 1}/{LOCAL_START_ATTEMPTS})",
                    file=sys.stderr,
                    flush=True,
                )
                ray.shutdown()
                time.sleep(2.0 * attempt)
    finally:
        if saved is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved


def stop_service(handles: dict | None, drain_s: float = 10.0, shutdown_ray: bool = True) -> None:
    """Stop in order, each step bounded: refuse new requests, let in-flight ones finish for up to drain_s, stop
    the router (streams still open end with an in-band error and [DONE] from the ingress), stop Serve, kill the
    workers, and (shutdown_ray) stop this process's Ray cluster with its daemons."""
    import ray
    from ray import serve

    handles = handles or {}
    router = handles.get("router")
    placed = dict(handles.get("placed", {}))
    if router is not None and ray.is_initialized():
        try:
            placed.update(ray.get(router.placed_workers.remote(), timeout=5))  # as a group restart left them
        except Exception:  # noqa: BLE001 - the router is gone: what start_service placed
            pass
        try:
            ray.get(router.drain.remote(), timeout=5)
            deadline = time.monotonic() + drain_s
            while time.monotonic() < deadline and ray.get(router.active.remote(), timeout=5):
                time.sleep(0.1)
            ray.get(router.stop.remote(1.0), timeout=10)
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            print(f"dsv4: router stop: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if ray.is_initialized():
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001
            pass
        for h in (
            *handles.get("prefill", {}).values(),
            *handles.get("decode", {}).values(),
            *([router] if router is not None else []),
        ):
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for pw in placed.values():
            try:
                ray.kill(pw.handle, no_restart=True)  # rank 0 of a group placed again since start
            except Exception:  # noqa: BLE001 - already gone
                pass
            remove_worker(pw)
    if shutdown_ray:
        ray.shutdown()


_own_metrics_dir: str | None = None  # the directory prepare_metrics_dir made in this process (not one it was given)


def prepare_metrics_dir() -> str:
    """Must run before prometheus_client is imported anywhere in this process. A directory made here (not
    one named by PROMETHEUS_MULTIPROC_DIR) is this run's: `remove_metrics_dir` deletes it at the end."""
    global _own_metrics_dir
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="dsv4-metrics-")
        _own_metrics_dir = path
    os.makedirs(path, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def remove_metrics_dir() -> None:
    import shutil

    global _own_metrics_dir
    path, _own_metrics_dir = _own_metrics_dir, None
    if path and os.environ.get("PROMETHEUS_MULTIPROC_DIR") == path:
        shutil.rmtree(path, ignore_errors=True)
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]  # a later prepare_metrics_dir makes (and owns) a new one


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    from engine.loading.make_model import default_model_dir
    from engine.loading.model_source import local_model_dir

    engine_options = tuple((k, getattr(args, k)) for k in ENGINE_OPTION_KEYS if getattr(args, k, None) is not None)
    # A repo id is fetched here, once, before any pool starts: workers get the local snapshot path (one on
    # another node that lacks it fetches that same commit itself: engine.loading.model_source).
    return ServiceConfig(
        model_dir=local_model_dir(args.model) or default_model_dir(),
        model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        router_port=args.router_port,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        transfer=args.transfer,
        router_policy=args.router_policy,
        engine_options=engine_options,
        worker_num_cpus=args.worker_num_cpus,
        ingress_replicas=args.ingress_replicas,
        api_key=args.api_key or settings().api_key,
        max_body_bytes=args.max_body_bytes,
        allow_request_chat_template=args.allow_request_chat_template,
        api_docs=args.api_docs,
        metrics_host=args.metrics_host,
        drain_s=args.drain_seconds,
        router_max_queued=args.max_queued,
        router_queue_timeout_s=args.queue_timeout_seconds,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
        data_parallel_attention=getattr(args, "data_parallel_attention", False),
        prefill_tensor_parallel_size=getattr(args, "prefill_tensor_parallel_size", None),
        decode_tensor_parallel_size=getattr(args, "decode_tensor_parallel_size", None),
        worker_num_gpus=getattr(args, "worker_num_gpus", None),
        stall_timeout_s=getattr(args, "stall_timeout_seconds", DEFAULT_STALL_TIMEOUT_S),
        ready_timeout_s=getattr(args, "ready_timeout_seconds", 900.0),
    )


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
            metrics_host = cfg.metrics_host or internal_host(cfg)
            if metrics_host == "node":
                from kv_transfer.registry import node_address

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
        print(f"  router:     grpc://{handles['router_addr']} (cluster token required)", flush=True)
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


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="model directory or Hugging Face repo id (org/name[@revision], "
        "fetched once into the HF cache); default: the built-in tiny model",
    )
    parser.add_argument("--served-model-name", default="dsv4")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8080)
    parser.add_argument("--router-port", type=int, default=0, help="gRPC router port (0 = any free port)")
    parser.add_argument(
        "--metrics-host",
        default=None,
        help="metrics listen address (default: loopback on one node, the node address on a cluster)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every /v1 route (default: $DSV4_API_KEY)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest accepted HTTP request body (413 beyond)",
    )
    parser.add_argument(
        "--allow-request-chat-template",
        action="store_true",
        help="let requests supply `chat_template` (rendered in a sandbox with a time budget)",
    )
    parser.add_argument("--api-docs", action="store_true", help="serve /docs and /openapi.json")
    parser.add_argument("--ingress-replicas", type=int, default=2, help="HTTP ingress replicas")
    parser.add_argument(
        "--worker-num-cpus", type=float, default=0.25, help="Ray CPU reservation of each prefill/decode worker"
    )
    parser.add_argument(
        "--worker-num-gpus",
        type=float,
        default=None,
        help="GPUs each worker rank reserves on cuda (default 1); a fraction such as 0.5 puts a "
        "prefill and a decode worker on one GPU, each with that share of the memory budget",
    )
    parser.add_argument(
        "--ready-timeout-seconds",
        type=float,
        default=900.0,
        help="how long each start-up stage may take (workers: loading plus the warm-up that compiles "
        "every kernel before serving, minutes for a large model on a cold kernel cache)",
    )
    parser.add_argument(
        "--stall-timeout-seconds",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="a worker whose engine stays this long in one step is unhealthy: the router moves its "
        "streams and the worker is restarted (keep it well above the slowest step, a compile)",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM / Ctrl-C, how long in-flight requests may take to finish",
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests that may wait at the router for a decode slot (429 beyond)",
    )
    parser.add_argument(
        "--queue-timeout-seconds", type=float, default=60.0, help="how long a request may wait there (503 after)"
    )
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks per prefill/decode worker: one Ray actor (one GPU on cuda) each, packed on "
        "one host by a STRICT_PACK placement group; heads and dense projections split",
    )
    parser.add_argument(
        "--prefill-tensor-parallel-size",
        type=int,
        default=None,
        help="ranks per prefill worker when it differs from --tensor-parallel-size",
    )
    parser.add_argument(
        "--decode-tensor-parallel-size",
        type=int,
        default=None,
        help="ranks per decode worker when it differs from --tensor-parallel-size",
    )
    parser.add_argument(
        "--expert-parallel", action="store_true", help="split routed experts by expert id across each worker's ranks"
    )
    parser.add_argument(
        "--data-parallel-attention",
        action="store_true",
        help="with --expert-parallel: every rank of a worker keeps the whole attention and serves its "
        "own requests and KV cache (a worker of its own to the router); only the MoE layers "
        "exchange tokens, the ranks stepping in lockstep",
    )
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--transfer", default="auto", choices=TRANSFER_CHOICES, help=TRANSFER_HELP)
    parser.add_argument(
        "--router-policy", default="cache_aware", choices=["cache_aware", "least_loaded", "round_robin"]
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-cached-tokens", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "exact", "fp8"],
        help="KV cache format of every worker (default auto: fp8 where FlashMLA decodes it, else exact rows)",
    )
    parser.add_argument(
        "--index-cache-dtype",
        default=None,
        choices=["auto", "mxfp4", "fp8"],
        help="indexer keys of an fp8 cache (default auto: FP8 on Hopper, else MXFP4)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        choices=[0, 1, 2, 3],
        help="MTP speculative decoding on the decode pool: draft K tokens a step with the checkpoint's "
        "MTP layer (0 = off). The prefill pool gets it too: it runs the MTP layer over each prompt "
        "so that layer's KV travels with the hand-off (and both pools' cache layouts match)",
    )
    parser.add_argument(
        "--prefill-expert-format",
        default=None,
        choices=["auto", "mxfp4", "fp8"],
        help="routed experts of the prefill pool (default auto: FP8 128x128 through DeepGEMM's grouped "
        "GEMM on a bf16 CUDA engine with DeepGEMM, else MXFP4); the decode pool keeps MXFP4",
    )
    add_engine_speed_args(parser)


__all__ = [
    "ServiceConfig",
    "ServiceStartError",
    "serve_main",
    "start_service",
    "stop_service",
    "init_ray",
    "add_serve_args",
    "prepare_metrics_dir",
    "remove_metrics_dir",
    "ray_logs_dir",
    "ray_logs_tail",
    "RouterActor",
    "check_placement",
    "single_node",
    "config_from_args",
    "worker_gpus",
    "worker_engine_options",
]
