"""The service as a Ray Serve application builder, for KubeRay: `import_path: service.kuberay_app:build`.

On Kubernetes the pods only run `ray start` (KubeRay); the RayService's `serveConfigV2` names this builder
with its `args`. Serve runs `build(args)` on the cluster: it starts the prefill and decode actors where
the worker groups advertise the custom Ray resources `dsv4_prefill` / `dsv4_decode` (rayStartParams
`resources`), `routers` gRPC router actors (the chart's `serve.routerReplicas`, default 2: started as `dsv4 serve
--routers N` starts them, service.router_actor.start_routers), and returns the bound `OpenAIIngress` app, which
places through all of them (failing over between them) and which Serve's proxies serve on every node (KubeRay's
`<name>-serve-svc`).

The actors are detached and named after a fingerprint of what they were built from, so a re-run of the
builder (a Serve redeploy after `helm upgrade` changed `serveConfigV2`) keeps the workers whose settings
did not change, replaces the others (killed first: the new ones need their GPUs), adds or removes
workers for a new count, and starts new routers for the new set. Scaling a role or changing engine
options is thus applied in place (requests on replaced workers fail); a new pod spec or image rolls a
whole new cluster through the RayService `upgradeStrategy` instead.

Metrics: every dsv4 process of a pod writes to PROMETHEUS_MULTIPROC_DIR (an emptyDir shared in the pod;
the chart sets it in the Serve app's runtime_env, and it is passed to the actors here), so Ray's own
processes keep their metrics out of it. A sidecar container of every pod runs
`python -m service.kuberay_app exporter --port 8080`, which serves that directory's aggregate on the
pod's port `metrics`: a sidecar starts and scales with its pod, unlike a per-node actor that a later
autoscaled node would lack.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.registry import TRANSFER_CHOICES
from service.actor_pools import remote_classes, worker_classes
from service.planner import parse_pool_spec
from service.rank_placement import dp_actor_names, dp_worker_ids, follower_names, group_name
from service.router_actor import RouterActor, start_routers
from service.serve_args import add_serve_args
from service.service_config import ENGINE_OPTION_KEYS, ServiceConfig

NAMESPACE = "dsv4"
ROLES = ("prefill", "decode")
_ARG_KEYS = {
    "model",
    "served_model_name",
    "prefill_workers",
    "decode_workers",
    "transfer",
    "router_policy",
    "router_port",
    "routers",
    "engine",
    "prefill_args",
    "decode_args",
    "prefill_resources",
    "decode_resources",
    "gpus_per_worker",
    "worker_num_cpus",
    "metrics_dir",
    "prefill_tensor_parallel_size",
    "decode_tensor_parallel_size",
    "prefill_expert_parallel",
    "decode_expert_parallel",
    "prefill_data_parallel_attention",
    "decode_data_parallel_attention",
}
# How long a multi-rank worker waits for its placement group (pods of an autoscaled group may still be coming
# up, as single-rank actors wait pending for theirs): the chart's startup probe allows an hour.
PLACEMENT_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class RolePlan:
    """How one role's actors are started: count, engine options and the Ray resources each takes."""

    workers: int
    engine_options: tuple  # (key, value) pairs for load_engine
    resources: tuple  # (custom Ray resource, amount) pairs, of each rank's actor
    num_gpus: float  # of each rank's actor
    tensor_parallel_size: int = 1  # ranks (actors) per worker: service.rank_placement
    expert_parallel: bool = False
    data_parallel_attention: bool = False  # every rank a worker of its own (service.rank_placement)

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"each role needs at least one worker, got {self.workers}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("expert_parallel needs tensor_parallel_size > 1 (experts split across the ranks)")
        if self.data_parallel_attention and not self.expert_parallel:
            raise ValueError(
                "data_parallel_attention needs expert_parallel and tensor_parallel_size > 1 (its ranks "
                "share the routed experts)"
            )


@dataclass(frozen=True)
class EntryConfig:
    service: ServiceConfig
    prefill: RolePlan
    decode: RolePlan
    metrics_dir: str | None = None
    env: tuple = field(default=())  # (name, value) env vars of every actor

    def plan(self, role: str) -> RolePlan:
        return self.prefill if role == "prefill" else self.decode


def _engine_args(extra_args: list) -> dict:
    """Per-role `dsv4 serve` engine flags (`prefill_args` / `decode_args`) -> load_engine options."""
    parser = argparse.ArgumentParser(prog="dsv4 serve_entry", add_help=False, exit_on_error=False)
    add_serve_args(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # the namespace holds only the flags that were given
    try:
        parsed, rest = parser.parse_known_args([str(a) for a in extra_args])
    except argparse.ArgumentError as e:
        raise ValueError(f"bad engine argument: {e}") from None
    given = vars(parsed)
    not_engine = sorted(k for k in given if k not in ENGINE_OPTION_KEYS)
    if rest or not_engine:
        raise ValueError(
            f"only engine flags of `dsv4 serve` ({', '.join(ENGINE_OPTION_KEYS)}) go in a role's "
            f"args; got {rest + not_engine}"
        )
    return given


def _engine_options(common: dict, extra_args: list) -> tuple:
    unknown = set(common) - set(ENGINE_OPTION_KEYS)
    if unknown:
        raise ValueError(f"unknown engine options {sorted(unknown)}; expected some of {ENGINE_OPTION_KEYS}")
    opts = {k: v for k, v in common.items() if v is not None}
    opts.update({k: v for k, v in _engine_args(extra_args).items() if v is not None})
    return tuple(sorted(opts.items()))


def parse_args(args: dict) -> EntryConfig:
    """Validate the `args` of the Serve application (YAML values, so numbers may arrive as strings)."""
    unknown = set(args) - _ARG_KEYS
    if unknown:
        raise ValueError(f"unknown serve_entry args {sorted(unknown)}; expected some of {sorted(_ARG_KEYS)}")
    transfer = str(args.get("transfer", "auto"))
    if transfer not in TRANSFER_CHOICES:
        raise ValueError(f"transfer must be one of {list(TRANSFER_CHOICES)}, got {transfer!r}")
    pools = {role: parse_pool_spec(args.get(f"{role}_workers", 1), f"{role}_workers") for role in ROLES}
    for role in ROLES:
        if pools[role].elastic and int(args.get(f"{role}_tensor_parallel_size", 1)) > 1:
            raise ValueError(
                f"an elastic {role} pool ({pools[role]}) needs single-rank workers (tensor parallel size 1)"
            )
    service = ServiceConfig(
        model_dir=str(args.get("model") or ""),
        model_name=str(args.get("served_model_name", "dsv4")),
        router_port=int(args.get("router_port", 0)),
        routers=int(args.get("routers", ServiceConfig.routers)),
        prefill_workers=pools["prefill"].min,
        decode_workers=pools["decode"].min,
        prefill_max_workers=pools["prefill"].max,
        decode_max_workers=pools["decode"].max,
        transfer=transfer,
        router_policy=str(args.get("router_policy", "cache_aware")),
        worker_num_cpus=float(args.get("worker_num_cpus", 0.5)),
    )
    gpus = float(args.get("gpus_per_worker", 0))
    common = dict(args.get("engine") or {})
    plans = {
        role: RolePlan(
            workers=getattr(service, f"{role}_workers"),
            engine_options=_engine_options(common, list(args.get(f"{role}_args") or [])),
            resources=tuple(sorted((str(k), float(v)) for k, v in (args.get(f"{role}_resources") or {}).items())),
            num_gpus=gpus,
            tensor_parallel_size=int(args.get(f"{role}_tensor_parallel_size", 1)),
            expert_parallel=_flag(args.get(f"{role}_expert_parallel", False), f"{role}_expert_parallel"),
            data_parallel_attention=_flag(
                args.get(f"{role}_data_parallel_attention", False), f"{role}_data_parallel_attention"
            ),
        )
        for role in ROLES
    }
    metrics_dir = args.get("metrics_dir") or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    env = (("PROMETHEUS_MULTIPROC_DIR", metrics_dir),) if metrics_dir else ()
    return EntryConfig(service, plans["prefill"], plans["decode"], metrics_dir, env)


def _flag(value, what: str) -> bool:
    """A YAML boolean (true/false, or the strings a --set may give)."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"{what} must be true or false, got {value!r}")


def _fingerprint(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:8]


class EntryRouter(RouterActor):
    """The router, plus the address of its node (ingress replicas may run on any node)."""

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        return await super().start(host, port)  # a reused actor (builder re-run) is already serving: its port

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


def actor_class(cls: type, **options: Any) -> Any:
    """ray.remote(**options)(cls): an actor class (Ray's stubs type the decorator for remote functions only)."""
    import ray

    return ray.remote(**options)(cls)


class TokenKeeper:
    """Holds the cluster token (router and transfer listeners) across builder re-runs: workers that are kept
    and workers that are replaced must agree on it."""

    def __init__(self, token: str):
        self._token = token

    def token(self) -> str:
        return self._token


def cluster_token() -> str:
    import ray

    from router.auth import new_token

    keeper = actor_class(TokenKeeper, num_cpus=0).options(
        name="dsv4-token", namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    )
    return ray.get(keeper.remote(new_token()).token.remote())


def _start_role(cfg: EntryConfig, role: str, cls, model_dir: str | None, token: str) -> tuple[dict, dict, dict]:
    """Start (or reuse) one role's workers; -> ({worker id: handle} of what the router dispatches to,
    {worker id: PlacedWorker} and {worker id: GroupRecipe} of the multi-rank ones, for the router's
    GroupSupervisor: a rank that dies brings its whole group back, as under `dsv4 serve`)."""
    from service.group_restart import GroupRecipe

    plan = cfg.plan(role)
    health = _health_options(cfg)
    handles, placed, recipes = {}, {}, {}
    for worker_id in worker_ids(cfg, role):
        name = worker_name(cfg, role, worker_id, model_dir)
        options = dict(
            namespace=NAMESPACE,
            lifetime="detached",
            num_gpus=plan.num_gpus,
            resources=dict(plan.resources),
            runtime_env={"env_vars": dict(cfg.env)},
        )
        opts = dict(plan.engine_options)
        args = (worker_id, model_dir, opts, cfg.service.transfer)
        kwargs = dict(bind_host="node", cluster_token=token, health=health)
        if plan.tensor_parallel_size == 1:
            handles[worker_id] = cls.options(name=name, get_if_exists=True, **options).remote(*args, **kwargs)
            continue
        # A multi-rank worker: its ranks in one detached STRICT_PACK placement group, one bundle (GPU and
        # role resource) a rank; a worker kept from an earlier run of the builder is reused as it is.
        recipe = GroupRecipe(
            name=name,
            role=role,
            service=cfg.service,
            args=args,
            kwargs=kwargs,
            opts=opts,
            model_dir=model_dir,
            tp_size=plan.tensor_parallel_size,
            expert_parallel=plan.expert_parallel,
            num_cpus=cfg.service.worker_num_cpus,
            num_gpus=plan.num_gpus,
            actor_classes=worker_classes,
            actor_options=options,
            ready_timeout_s=PLACEMENT_TIMEOUT_S,
            data_parallel_attention=plan.data_parallel_attention,
        )
        worker = _kept_group(recipe, worker_id) or recipe.place()
        handles[worker_id] = worker.handle
        handles.update(worker.ranks)
        placed[worker_id], recipes[worker_id] = worker, recipe
    return handles, placed, recipes


def _health_options(cfg: EntryConfig):
    """The workers' watchdog: it ends a worker whose engine loop died or stalled, so that Ray (or the group
    supervisor) brings it back, as under `dsv4 serve` (engine.runtime.health)."""
    from engine.runtime.health import HealthOptions

    return HealthOptions(stall_timeout_s=cfg.service.stall_timeout_s, exit_on_failure=True)


def _kept_group(recipe, worker_id: str):
    """The PlacedWorker of a multi-rank worker an earlier run of the builder placed, when all its ranks live;
    else None (a group that lost a rank is dropped: its names and GPUs go to the new one)."""
    from ray.util import get_placement_group

    from service.rank_placement import PlacedWorker

    kept = [_named(n) for n in recipe.actor_names()]
    if not all(kept):
        _drop_broken_group(recipe.name, recipe.tp_size, [h for h in kept if h is not None])
        return None
    try:
        group = get_placement_group(group_name(recipe.name))
    except Exception:  # noqa: BLE001 - no group by that name: the supervisor then only kills the ranks
        group = None
    if recipe.data_parallel_attention:
        ranks = dict(zip(dp_worker_ids(worker_id, recipe.tp_size)[1:], kept[1:]))
        return PlacedWorker(handle=kept[0], followers=[], group=group, ranks=ranks)
    return PlacedWorker(handle=kept[0], followers=kept[1:], group=group)


def _drop_broken_group(name: str, size: int, live: list, wait_s: float = 30.0) -> None:
    """A multi-rank group that lost a rank cannot take it back (the others' collectives failed with it): kill
    its live ranks and free its placement group, so that its names and GPUs are there for the new group."""
    import ray

    for h in live:
        ray.kill(h, no_restart=True)
    _remove_group(name)
    deadline = time.monotonic() + wait_s
    while any(_named(n) for n in (name, *dp_actor_names(name, size)[1:], *follower_names(name, size))):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)


def _named(name: str):
    """The live actor `name` of this namespace, or None."""
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def worker_name(cfg: EntryConfig, role: str, worker_id: str, model_dir: str | None) -> str:
    return f"dsv4-{worker_id}-{_role_fingerprint(cfg, role, model_dir)}"


def actor_names(cfg: EntryConfig, model_dir: str | None) -> set[str]:
    """Every actor of the current layout's workers: rank 0 and the followers (or data-parallel ranks) of
    multi-rank ones."""
    names = set()
    for role in ROLES:
        plan = cfg.plan(role)
        for w in worker_ids(cfg, role):
            name = worker_name(cfg, role, w, model_dir)
            ranks = dp_actor_names if plan.data_parallel_attention else follower_names
            names |= {name, *ranks(name, plan.tensor_parallel_size)}
    return names


def _kill_stale(keep: set, prefix: str) -> None:
    """Kill this namespace's actors named `prefix...` that are not in `keep` (an older layout's)."""
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE and actor["name"].startswith(prefix) and actor["name"] not in keep:
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE))
            except ValueError:  # already gone
                pass
            _remove_group(actor["name"])


def _remove_group(worker: str) -> None:
    """Free the placement group of a removed multi-rank worker (its GPUs), if it had one."""
    from ray.util import get_placement_group, remove_placement_group

    try:
        remove_placement_group(get_placement_group(group_name(worker)))
    except Exception:  # noqa: BLE001 - a single-rank worker, a follower, or already removed
        pass


def start_backend(cfg: EntryConfig) -> tuple[str, str, list]:
    """Start (or reuse) the workers and the `routers` router replicas on the connected cluster; -> (the first
    router's host:port, the cluster token they require, the routers' actor handles: the ingress places through them,
    failing over between them, and streams from the decode workers itself, service.direct_path). The routers listen
    on their nodes' addresses (ingress replicas run on any node), never on every interface; reused routers keep
    their token, which the new ingress reads from them.

    Workers of an older layout are killed first (their GPUs and role resources are what the new ones
    need); the old routers go once the new ones serve.
    """
    import ray

    model_dir = cfg.service.model_dir or None  # None: each worker builds the built-in tiny model
    workers = actor_names(cfg, model_dir)
    for role in ROLES:  # an elastic pool's added workers of the same build stay (its planner still counts them)
        _kill_stale(workers | _elastic_added(cfg, role, model_dir), f"dsv4-{role}-")
    token = cluster_token()
    prefill_cls, decode_cls, _ = remote_classes(cfg.service)
    prefill, prefill_placed, prefill_recipes = _start_role(cfg, "prefill", prefill_cls, model_dir, token)
    decode, decode_placed, decode_recipes = _start_role(cfg, "decode", decode_cls, model_dir, token)
    groups = ({**prefill_placed, **decode_placed}, {**prefill_recipes, **decode_recipes})
    ray.get([h.ping.remote() for h in (*prefill.values(), *decode.values())])
    pools = _pool_manager(cfg, model_dir, token, prefill, decode)
    # Named like the workers (dsv4-router-I-BUILD): the same build reuses them, another one replaces them.
    names = f"dsv4-router-{{i}}-{_fingerprint(sorted(workers), cfg.service.router_policy)}"
    routers = start_routers(
        cfg.service,
        prefill,
        decode,
        groups,
        ("node", cfg.service.router_port),
        token,
        pools,
        names=names,
        router_cls=actor_class(EntryRouter, num_cpus=0, max_concurrency=1000),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        runtime_env={"env_vars": dict(cfg.env)},
    )
    port = ray.get(routers[0].start.remote())
    addr = f"{ray.get(routers[0].node_ip.remote())}:{port}"
    _kill_stale({names.format(i=i) for i in range(len(routers))}, "dsv4-router-")
    return addr, ray.get(routers[0].token.remote()), routers


def _elastic_added(cfg: EntryConfig, role: str, model_dir: str | None) -> set[str]:
    """Names of the live workers an elastic pool's planner added with this build (same fingerprint)."""
    import ray

    if not cfg.service.pool_bounds(role).elastic:
        return set()
    pattern = re.compile(rf"dsv4-{role}-\d+-{_role_fingerprint(cfg, role, model_dir)}")
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and pattern.fullmatch(a["name"])
    }


def _pool_manager(cfg: EntryConfig, model_dir: str | None, token: str, prefill: dict, decode: dict):
    """The elastic pools' PoolManager (service.pools), detached and named after the build, or None (fixed pools).
    A new worker asks for its role's Ray resource, so KubeRay's autoscaler brings a pod for it."""
    from service.pools import ElasticConfig, WorkerRecipe, start_pool_manager

    if not cfg.service.elastic:
        return None
    config = ElasticConfig(
        prefill=cfg.service.pool_bounds("prefill"),
        decode=cfg.service.pool_bounds("decode"),
        planner=cfg.service.planner,
        start_timeout_s=PLACEMENT_TIMEOUT_S,  # a new pod may take long to come up
    )
    recipes = {
        role: WorkerRecipe(
            service=cfg.service,
            role=role,
            model_dir=model_dir,
            engine_options=cfg.plan(role).engine_options,
            transfer=cfg.service.transfer,
            kwargs=(("bind_host", "node"), ("cluster_token", token), ("health", _health_options(cfg))),
            actor_options=(
                ("namespace", NAMESPACE),
                ("num_gpus", cfg.plan(role).num_gpus),
                ("resources", dict(cfg.plan(role).resources)),
                ("runtime_env", {"env_vars": dict(cfg.env)}),
            ),
            name_suffix=f"-{_role_fingerprint(cfg, role, model_dir)}",
        )
        for role in config.elastic_roles
    }
    name = f"dsv4-pools-{_fingerprint(sorted(actor_names(cfg, model_dir)), str(config))}"
    manager = start_pool_manager(
        config,
        recipes,
        {"prefill": prefill, "decode": decode},
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        runtime_env={"env_vars": dict(cfg.env)},
    )
    _kill_stale({name}, "dsv4-pools-")
    return manager


def worker_ids(cfg: EntryConfig, role: str) -> list[str]:
    return [f"{role}-{i}" for i in range(cfg.plan(role).workers)]


def _role_fingerprint(cfg: EntryConfig, role: str, model_dir: str | None) -> str:
    """What a worker is built from (not how many there are: scaling keeps the existing ones)."""
    plan = cfg.plan(role)
    layout: tuple[int | bool | str, ...] = (
        () if plan.tensor_parallel_size == 1 else (plan.tensor_parallel_size, plan.expert_parallel)
    )
    layout += ("data-parallel attention",) if plan.data_parallel_attention else ()  # (older layouts keep their names)
    return _fingerprint(model_dir, cfg.service.transfer, plan.engine_options, plan.resources, plan.num_gpus, *layout)


def ingress_max_model_len(cfg: EntryConfig) -> int | None:
    """The longest request both roles serve (their --max-model-len), for the ingress; None: the model's."""
    lens = [dict(cfg.plan(role).engine_options).get("max_model_len") for role in ROLES]
    return min((int(n) for n in lens if n), default=None)


def build(args: dict):
    """Serve application builder: start the backend, -> the OpenAI ingress app bound to its router."""
    from engine.loading.make_model import default_model_dir
    from service.ingress_guard import IngressOptions
    from service.serve_ingress import ingress_deployment

    cfg = parse_args(args)
    router_addr, token, routers = start_backend(cfg)
    # The API key comes from the pod's environment (DSV4_API_KEY, from the chart's Secret).
    options = IngressOptions.from_env(
        router_token=token, internal_host="node", max_model_len=ingress_max_model_len(cfg)
    )
    return ingress_deployment().bind(
        router_addr,
        cfg.service.model_dir or default_model_dir(),
        cfg.service.model_name,
        options=options,
        routers=routers,
    )


def run_exporter(port: int, host: str = "0.0.0.0") -> None:
    """Serve the pod's multiprocess directory on host:port until SIGTERM/SIGINT (the chart's sidecar)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        raise SystemExit("PROMETHEUS_MULTIPROC_DIR must name the pod's shared metrics directory")
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
    from engine.telemetry.metrics import start_metrics_server

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server, _ = start_metrics_server(port, host)
    print(f"dsv4 metrics exporter on http://{host}:{port}/metrics", flush=True)
    stop.wait()
    server.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.kuberay_app")
    sub = parser.add_subparsers(dest="command", required=True)
    exporter = sub.add_parser("exporter", help="serve this pod's dsv4 metrics (sidecar)")
    exporter.add_argument("--host", default="0.0.0.0")
    exporter.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    run_exporter(args.port, args.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
