"""Multi-rank workers restart as a group: a dead rank brings its whole worker back, not only itself.

Why not Ray's own restarts: a rank cannot rejoin a running group (the ranks meet once, on a port of the group's
host, and every collective needs all of them), so every rank of a multi-rank worker runs with max_restarts=0
(service.rank_placement). Instead `GroupSupervisor`, in the router's actor, looks at every rank of every
multi-rank worker each `interval_s`; when one has died (a killed process, or rank 0's watchdog ending it after a
collective failed: engine.runtime.health) it kills the remaining ranks, frees the placement group, places the
worker again from its `GroupRecipe` (a new group, a new rendezvous port, fresh actors under the same names) and
hands the new rank-0 handles to the dispatcher. The router's health loop then sees a new incarnation, introduces
it to its transfer peers and takes it back, as after a one-rank restart. A rank that is alive but silent (a
stopped process, a hung step) is the health loop's business (marked down, streams moved), not a restart here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from service.rank_placement import PlacedWorker, dp_actor_names, follower_names, place_worker, remove_worker
from service.service_config import ServiceConfig

log = logging.getLogger(__name__)

NAME_FREE_TIMEOUT_S = 30.0  # a killed actor's name is released asynchronously


@dataclass(frozen=True)
class GroupRecipe:
    """place_worker's arguments for one multi-rank worker (what start_service placed it with). The Ray actor class
    is made where the group is placed again, from `service` and `role` (service.actor_pools.worker_classes): a Ray
    actor class of our workers does not pickle (cloudpickle takes it by value, and WorkerBase is a typing.Generic),
    so it cannot travel to the router's actor."""

    name: str  # rank 0's actor name
    role: str  # "prefill" / "decode"
    service: ServiceConfig  # what worker_classes makes the role's actor class from
    args: tuple
    kwargs: dict
    opts: dict
    model_dir: str | None
    tp_size: int
    expert_parallel: bool
    num_cpus: float
    num_gpus: float
    actor_classes: Callable  # service.actor_pools.worker_classes: ServiceConfig -> (PrefillWorker, DecodeWorker)
    actor_options: dict
    ready_timeout_s: float
    data_parallel_attention: bool = False

    def place(self) -> PlacedWorker:
        prefill_cls, decode_cls = self.actor_classes(self.service)
        return place_worker(
            prefill_cls if self.role == "prefill" else decode_cls,
            self.name,
            self.args,
            self.kwargs,
            self.opts,
            self.model_dir,
            self.tp_size,
            self.expert_parallel,
            self.num_cpus,
            self.num_gpus,
            self.actor_options,
            self.ready_timeout_s,
            self.data_parallel_attention,
        )

    def actor_names(self) -> list[str]:
        if self.data_parallel_attention:
            return dp_actor_names(self.name, self.tp_size)
        return [self.name, *follower_names(self.name, self.tp_size)]


class GroupSupervisor:
    """Restarts dead multi-rank workers (module docstring). placed: {worker id: PlacedWorker} of each
    multi-rank worker (rank 0's id); recipes: the same ids -> GroupRecipe; replace(worker_id, handle): give the
    dispatcher a new rank-0 (or data-parallel rank) handle."""

    def __init__(self, placed: dict, recipes: dict, replace, interval_s: float = 2.0, ping_timeout_s: float = 10.0):
        self.placed, self.recipes, self.replace = dict(placed), dict(recipes), replace
        self.interval_s, self.ping_timeout_s = interval_s, ping_timeout_s
        self.restarts = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            for wid in list(self.placed):
                try:
                    if not await self._alive(self.placed[wid]):
                        await self._restart(wid)
                except Exception:  # noqa: BLE001 - the next round tries again
                    log.exception("restarting multi-rank worker %s failed; retrying", wid)

    async def _alive(self, placed: PlacedWorker) -> bool:
        """False once any rank's actor has died; a rank that does not answer in time counts as alive."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

        ranks = [placed.handle, *placed.followers, *placed.ranks.values()]
        results = await asyncio.gather(
            *(asyncio.wait_for(_ping(h), self.ping_timeout_s) for h in ranks), return_exceptions=True
        )
        dead = (RayActorError, ActorDiedError, ActorUnavailableError)
        # ActorUnavailableError is transient (a restart in progress): our ranks are never restarted, so only a
        # definite death counts; a RayTaskError (ping raising: rank 0's engine loop ended) too
        return not any(
            isinstance(r, dead) and not isinstance(r, ActorUnavailableError) or isinstance(r, RayTaskError)
            for r in results
        )

    async def _restart(self, wid: str) -> None:
        recipe, old = self.recipes[wid], self.placed[wid]
        log.warning("multi-rank worker %s lost a rank: restarting the whole group (%d ranks)", wid, recipe.tp_size)
        t0 = time.monotonic()
        new = await asyncio.to_thread(_replace_group, recipe, old)
        self.placed[wid] = new
        self.restarts += 1
        self.replace(wid, new.handle)
        for rid, handle in new.ranks.items():  # data-parallel attention: every rank is a worker of the router
            self.replace(rid, handle)
        log.warning("multi-rank worker %s placed again in %.1f s", wid, time.monotonic() - t0)


async def _ping(handle):
    return await handle.ping.remote()


def _replace_group(recipe: GroupRecipe, old: PlacedWorker) -> PlacedWorker:
    """Kill every rank of `old`, free its group, wait for the names, place the worker again (a thread: blocking)."""
    import ray

    try:
        ray.kill(old.handle, no_restart=True)  # type: ignore[arg-type]  # PlacedWorker.handle: an ActorHandle
    except Exception:  # noqa: BLE001 - already gone
        pass
    remove_worker(old)
    deadline = time.monotonic() + NAME_FREE_TIMEOUT_S
    for name in recipe.actor_names():
        while _named_actor_exists(name, recipe.actor_options.get("namespace")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"actor name {name!r} still taken {NAME_FREE_TIMEOUT_S:g} s after the kill")
            time.sleep(0.2)
    return recipe.place()


def _named_actor_exists(name: str, namespace: str | None) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False
