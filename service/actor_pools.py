"""The prefill and decode actor pools: their Ray actor classes and resources, the check that the cluster can place
them, and `start_pools`, which places every worker (one actor a rank; multi-rank workers in placement groups,
service.rank_placement) and waits until each answers.

Workers are restarted by Ray (max_restarts=-1); multi-rank workers as a whole group by the router actor's
supervisor (service.group_restart), from the recipes `group_recipes` returns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from service.rank_placement import place_worker
from service.ray_cluster import ServiceStartError, job_env, wait_ready
from service.service_config import ServiceConfig, role_engine_options


def worker_classes(cfg: ServiceConfig) -> tuple:
    """(PrefillWorker, DecodeWorker) as Ray actor classes with the pools' resources and restart policy."""
    import ray

    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    # A worker on a GPU engine owns one GPU, or a share of one (Ray sets CUDA_VISIBLE_DEVICES, so "cuda" means it).
    common: dict[str, Any] = dict(
        max_restarts=-1,
        max_task_retries=0,
        num_cpus=cfg.worker_num_cpus,
        num_gpus=worker_gpus(cfg),
        max_concurrency=1000,
    )
    return ray.remote(**common)(PrefillWorker), ray.remote(**common)(DecodeWorker)


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


def group_recipes(
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
                name=f"dsv4-{wid}",
                role=role,
                service=cfg,
                args=(wid, cfg.model_dir, ropts, cfg.transfer),
                kwargs=net,
                opts=ropts,
                model_dir=cfg.model_dir,
                tp_size=size,
                expert_parallel=ep,
                num_cpus=cfg.worker_num_cpus,
                num_gpus=worker_gpus(cfg),
                actor_classes=worker_classes,
                actor_options=actor,
                ready_timeout_s=cfg.ready_timeout_s,
                data_parallel_attention=dp,
            )
    return {wid: placed[wid] for wid in recipes}, recipes


def remote_classes(cfg: ServiceConfig) -> tuple:
    """(PrefillWorker, DecodeWorker, RouterActor) as Ray actor classes (service.kuberay_app starts all three)."""
    from service.router_actor import router_actor_class

    return (*worker_classes(cfg), router_actor_class())


@dataclass(frozen=True)
class PoolLaunch:
    """What placing a worker of either pool needs; `place_one` places one more (at start, or a planner later)."""

    cfg: ServiceConfig
    classes: dict  # role -> the Ray actor class (worker_classes)
    net: dict  # the workers' bind_host, cluster_token and health options
    actor: dict  # extra Ray actor options of every rank (a runtime_env)
    engine_options: dict  # worker_engine_options(cfg), before the per-role options


def pool_launch(cfg: ServiceConfig, host: str, token: str) -> PoolLaunch:
    """host: where internal listeners bind ("127.0.0.1" on one node, else "node"); token: the cluster token."""
    from engine.runtime.health import HealthOptions
    from kv_transfer.registry import resolve_name

    prefill_cls, decode_cls = worker_classes(cfg)
    net = dict(
        bind_host=None if host == "127.0.0.1" else "node",
        cluster_token=token,
        health=HealthOptions(cfg.stall_timeout_s, cfg.worker_test_hooks, exit_on_failure=True),
    )
    actor = {}
    if host == "127.0.0.1" and resolve_name(cfg.transfer) == "nixl" and "UCX_NET_DEVICES" not in os.environ:
        # One node: UCX's network transports listen on loopback only (shared memory and CUDA IPC, which
        # carry the transfers here, are not network devices); otherwise UCX also listens on the node address.
        actor["runtime_env"] = {"env_vars": {**job_env(), "UCX_NET_DEVICES": "lo"}}
    return PoolLaunch(
        cfg=cfg,
        classes={"prefill": prefill_cls, "decode": decode_cls},
        net=net,
        actor=actor,
        engine_options=worker_engine_options(cfg),
    )


def place_one(launch: PoolLaunch, role: str, index: int):
    """Place worker `{role}-{index}` (all its ranks); -> its PlacedWorker (service.rank_placement)."""
    cfg, wid = launch.cfg, f"{role}-{index}"
    ropts = role_engine_options(launch.engine_options, role)
    size, ep, dp = cfg.parallel(role)
    return place_worker(
        launch.classes[role],
        f"dsv4-{wid}",
        (wid, cfg.model_dir, ropts, cfg.transfer),
        launch.net,
        ropts,
        cfg.model_dir,
        size,
        ep,
        cfg.worker_num_cpus,
        worker_gpus(cfg),
        launch.actor,
        cfg.ready_timeout_s,
        dp,
    )


def start_pools(launch: PoolLaunch, handles: dict) -> tuple[dict, dict]:
    """Place every worker of both pools and wait until each answers; -> the multi-rank workers' group recipes.
    Fills handles["prefill"], handles["decode"] ({worker id: handle}) and handles["placed"] as it goes, so a
    failure midway leaves in `handles` what `stop_service` must kill."""
    cfg, placed = launch.cfg, handles["placed"]
    for role, count in (("prefill", cfg.prefill_workers), ("decode", cfg.decode_workers)):
        for i in range(count):
            pw = placed[f"{role}-{i}"] = place_one(launch, role, i)
            handles[role][f"{role}-{i}"] = pw.handle
            handles[role].update(pw.ranks)  # data-parallel attention: each rank a worker
    wait_ready(
        {name: h.ping.remote() for name, h in (*handles["prefill"].items(), *handles["decode"].items())}
        | {f"{name}-rank{r}": f.ping.remote() for name, pw in placed.items() for r, f in enumerate(pw.followers, 1)},
        cfg.ready_timeout_s,
        "worker actors",
    )
    return group_recipes(
        cfg,
        placed,
        launch.classes["prefill"],
        launch.classes["decode"],
        launch.net,
        launch.engine_options,
        launch.actor,
    )
