"""Workers that span several devices: one Ray actor per rank, a worker's actors in one placement group.

`--tensor-parallel-size N` (and `--expert-parallel`) make every prefill and decode worker N actors: a
placement group of N bundles ({GPU: 1} each on CUDA, the worker's CPU reservation each on CPU) with
strategy STRICT_PACK, so a worker's ranks share a host and meet on a loopback port; bundle 0 holds the
worker actor itself (rank 0: it schedules, owns the KV pool the transfers address and answers the router),
bundles 1..N-1 hold `engine.runtime.rank_worker.RankFollower` actors. Followers are not restarted by Ray: a rank
cannot rejoin a running group, so a failed rank takes its worker down with it (the router's health loop
drops that worker, as it drops any dead worker) and service.group_restart places the whole worker again. N = 1
places workers exactly as before.

With data-parallel attention (`--data-parallel-attention`) every bundle holds a worker actor: rank r of worker
"decode-0" is worker "decode-0" (r = 0) or "decode-0-dp<r>", each with its own requests, KV pool, transfer
endpoint and place in the router; their engine loops step in lockstep (engine.runtime.engine_loop). A failed rank fails its
peers' collectives, so the whole group leaves the router together, as a tensor-parallel worker does.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PlacedWorker:
    """Rank 0's actor handle plus what only a multi-rank worker has (its followers and placement group)."""

    handle: object
    followers: list = field(default_factory=list)
    group: object = None
    ranks: dict = field(default_factory=dict)  # data-parallel attention: worker id -> handle of ranks 1..N-1


def place_worker(
    cls,
    name: str,
    args: tuple,
    kwargs: dict,
    opts: dict,
    model_dir: str | None,
    tp_size: int,
    expert_parallel: bool,
    num_cpus: float,
    num_gpus: float,
    actor_options: dict,
    ready_timeout_s: float,
    data_parallel_attention: bool = False,
) -> PlacedWorker:
    """Create worker `name` (cls.options(name=...).remote(*args, **kwargs)) over tp_size ranks.

    args: the worker's positional constructor arguments, its worker id first and among them `opts` (its engine
    options), the dict that gains the `tensor_parallel` spec (and the actor's "rank") here. The placement group
    is reserved (waiting up to ready_timeout_s) before any actor exists. data_parallel_attention: every rank is
    a worker (the module docstring); their ids and handles are in `PlacedWorker.ranks`.
    """
    if tp_size == 1:
        return PlacedWorker(cls.options(name=name, **actor_options).remote(*args, **kwargs))
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from engine.model.parallel import free_loopback_port
    from engine.runtime.rank_worker import RankFollower, TensorParallelSpec

    # Custom resources the actors ask for (KubeRay's dsv4_prefill / dsv4_decode, one unit a rank) must be in
    # their bundles; a detached worker (KubeRay builder) needs a detached group, or the group would end with
    # the job that created it.
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **actor_options.get("resources", {})}
    group = placement_group(
        [dict(bundle) for _ in range(tp_size)],
        strategy="STRICT_PACK",
        name=group_name(name),
        lifetime=actor_options.get("lifetime"),
    )
    try:
        ray.get(group.ready(), timeout=ready_timeout_s)
    except Exception:
        ray.util.remove_placement_group(group)
        raise

    def on(index: int) -> dict:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}

    # The rendezvous port is picked on the ranks' host (STRICT_PACK: one host, maybe not the driver's), by a
    # task in bundle 0; the ranks meet on loopback there.
    port = ray.get(ray.remote(num_cpus=0)(free_loopback_port).options(**on(0)).remote(), timeout=ready_timeout_s)
    spec = TensorParallelSpec(tp_size, expert_parallel, port, data_parallel_attention=data_parallel_attention)
    ranked = {**opts, "tensor_parallel": spec}
    if data_parallel_attention:
        handles = [
            cls.options(name=actor, max_restarts=0, **actor_options, **on(r)).remote(
                *_with_opts(_with_id(args, wid), opts, {**ranked, "rank": r}), **kwargs
            )
            for r, (wid, actor) in enumerate(zip(dp_worker_ids(args[0], tp_size), dp_actor_names(name, tp_size)))
        ]
        return PlacedWorker(handles[0], [], group, dict(zip(dp_worker_ids(args[0], tp_size)[1:], handles[1:])))

    follower_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)(RankFollower)
    followers = [
        follower_cls.options(name=fname, **actor_options, **on(r)).remote(r, model_dir, ranked)
        for r, fname in enumerate(follower_names(name, tp_size), start=1)
    ]
    handle = cls.options(name=name, max_restarts=0, **actor_options, **on(0)).remote(
        *_with_opts(args, opts, ranked), **kwargs
    )
    return PlacedWorker(handle, followers, group)


def group_name(worker_name: str) -> str:
    """The placement group of a multi-rank worker."""
    return f"{worker_name}-ranks"


def follower_names(worker_name: str, tp_size: int) -> list[str]:
    """The actor names of ranks 1..tp_size-1 of a worker."""
    return [f"{worker_name}-rank{r}" for r in range(1, tp_size)]


def dp_worker_ids(worker_id: str, size: int) -> list[str]:
    """The worker ids of a data-parallel attention group's ranks: rank 0 keeps the worker's id."""
    return [worker_id] + [f"{worker_id}-dp{r}" for r in range(1, size)]


def dp_actor_names(worker_name: str, size: int) -> list[str]:
    """The actor names of a data-parallel attention group's ranks."""
    return [worker_name] + [f"{worker_name}-dp{r}" for r in range(1, size)]


def _with_id(args: tuple, worker_id: str) -> tuple:
    return (worker_id, *args[1:])


def _with_opts(args: tuple, old: dict, new: dict) -> tuple:
    return tuple(new if a is old else a for a in args)


def remove_worker(placed: PlacedWorker) -> None:
    """Kill the followers (and data-parallel ranks) and free the placement group (rank 0 is killed with the
    other workers)."""
    import ray

    for h in (*placed.followers, *placed.ranks.values()):
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if placed.group is not None:
        try:
            ray.util.remove_placement_group(placed.group)
        except Exception:  # noqa: BLE001
            pass
