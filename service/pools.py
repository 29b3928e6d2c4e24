"""Elastic pools: the `PoolManager` actor grows and shrinks the prefill and decode pools on the planner's decisions.

`dsv4 serve --prefill-workers MIN:MAX --decode-workers MIN:MAX` starts MIN workers of each pool and one
PoolManager actor (named `dsv4-pools`). Every `interval_s` it reads `signals()` from each ready worker of an elastic
pool, asks `service.planner.Planner` for the pool's size, and acts:

- Grow: a new worker actor (a new id, never reused) is created and joins the membership only once it answers
  `ping` (loaded and warmed up). Every router replica reads the membership (`membership`, polled by
  `RayDispatcher.sync_pools` on its health loop); the router's health probe then introduces it to its transfer
  peers (the same code that introduces a restarted worker) and marks it healthy: only then is it placed on.
  A worker that is not ready within `start_timeout_s` is killed and counted (`dsv4_pool_start_failures_total`),
  so a scale-up that cannot be scheduled never freezes the planner (it counts as capacity only while starting).
- Shrink (the worker with the fewest streams, newest first on ties): it stays in the membership flagged
  draining, so routers stop placing on it (`WorkerInfo.draining`: `RoutingPolicy` skips it) while its streams
  finish; once it reports no running or waiting request on two checks in a row (or `drain_timeout_s` passed:
  the router then migrates what is left, as on a worker death) it leaves the membership, so routers drop it
  and its prefix digest; `router_sync_s` later the actor is killed and, for a prefill worker, every decode
  worker forgets it as a transfer peer (`DecodeWorker.remove_peer`).

Crash safety: workers are detached actors named `<prefix><role>-<n><suffix>`, so they outlive a PoolManager
that dies; Ray restarts the manager, which rebuilds the membership from the named actors it finds (a worker
that was draining comes back as ready, and is drained again if the pool is still idle). Routers keep their last
membership while the manager is away. Only single-rank workers are elastic (a multi-rank worker's group restart
lives in the router actor: service.group_restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from service.planner import POOLS, Planner, PlannerConfig, PoolBounds, PoolObservation, ScaleDecision, WorkerSample

log = logging.getLogger(__name__)
MANAGER_NAME = "dsv4-pools"
HISTORY = 512  # decisions kept for `status` (the bench prints them)


@dataclass(frozen=True)
class PoolMember:
    worker_id: str
    role: str
    handle: Any  # the worker's Ray actor handle
    draining: bool = False


@dataclass(frozen=True)
class PoolMembership:
    """The workers of the elastic pools as every router replica should see them; `version` grows with each change."""

    version: int
    roles: tuple[str, ...]  # the pools this membership governs (a fixed pool keeps the router's own list)
    members: tuple[PoolMember, ...] = ()

    def pool(self, role: str) -> dict[str, Any]:
        return {m.worker_id: m.handle for m in self.members if m.role == role}

    @property
    def draining(self) -> frozenset[str]:
        return frozenset(m.worker_id for m in self.members if m.draining)


@dataclass(frozen=True)
class ElasticConfig:
    prefill: PoolBounds
    decode: PoolBounds
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    drain_timeout_s: float = 300.0  # a draining worker's streams may take this long; then they migrate
    start_timeout_s: float = 900.0  # a new worker must answer ping (loaded, warmed up) within this
    signal_timeout_s: float = 5.0
    router_sync_s: float = 3.0  # > the routers' health interval: every router has seen a change after this

    def __post_init__(self):
        for name in ("drain_timeout_s", "start_timeout_s", "signal_timeout_s", "router_sync_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def bounds(self, role: str) -> PoolBounds:
        return self.prefill if role == "prefill" else self.decode

    @property
    def elastic_roles(self) -> tuple[str, ...]:
        return tuple(r for r in POOLS if self.bounds(r).elastic)


@dataclass(frozen=True)
class WorkerRecipe:
    """How to start one more worker of a pool: its Ray class and the constructor arguments every worker of the
    pool shares (the launcher's, so a new worker is built like the first ones)."""

    service: Any  # the ServiceConfig the pool's Ray actor class is made from (service.actor_pools.worker_classes)
    role: str
    model_dir: str | None
    engine_options: tuple  # (key, value) pairs
    transfer: str
    kwargs: tuple  # (name, value) pairs: bind_host, cluster_token, health
    actor_options: tuple  # (name, value) pairs of .options(): runtime_env, namespace, resources, ...
    name_prefix: str = "dsv4-"
    name_suffix: str = ""

    def name(self, worker_id: str) -> str:
        return f"{self.name_prefix}{worker_id}{self.name_suffix}"

    def start(self, worker_id: str):
        # The class is made here: a Ray actor class does not survive pickling into the manager's arguments.
        from service.actor_pools import worker_classes

        cls = dict(zip(POOLS, worker_classes(self.service)))[self.role]
        # Detached: a worker outlives the manager that made it (its owner), which Ray may restart.
        options = {**dict(self.actor_options), "lifetime": "detached"}
        return cls.options(name=self.name(worker_id), **options).remote(
            worker_id, self.model_dir, dict(self.engine_options), self.transfer, **dict(self.kwargs)
        )


def launch_recipe(launch, role: str) -> WorkerRecipe:
    """A pool's recipe from `dsv4 serve`'s PoolLaunch (service.actor_pools): built like the first workers."""
    from service.service_config import role_engine_options

    cfg = launch.cfg
    return WorkerRecipe(
        service=cfg,
        role=role,
        model_dir=cfg.model_dir,
        engine_options=tuple(sorted(role_engine_options(launch.engine_options, role).items())),
        transfer=cfg.transfer,
        kwargs=tuple(sorted(launch.net.items())),
        actor_options=tuple(sorted(launch.actor.items())),
    )


def start_elastic(cfg, launch, handles: dict):
    """`dsv4 serve`'s PoolManager for the elastic pools of `cfg` (a ServiceConfig), whose first workers are in
    handles["prefill"] / handles["decode"]; new workers are built from `launch` (service.actor_pools.PoolLaunch)."""
    config = ElasticConfig(
        prefill=cfg.pool_bounds("prefill"),
        decode=cfg.pool_bounds("decode"),
        planner=cfg.planner,
        drain_timeout_s=cfg.drain_timeout_s,
        start_timeout_s=cfg.ready_timeout_s,
    )
    recipes = {role: launch_recipe(launch, role) for role in config.elastic_roles}
    return start_pool_manager(config, recipes, {role: dict(handles[role]) for role in POOLS})


def stop_elastic(manager) -> list:
    """Stop the manager's planning; -> every worker handle it knows (to kill), starting ones included."""
    import ray

    try:
        return ray.get(manager.shutdown.remote(), timeout=10)
    except Exception as e:  # noqa: BLE001 - the manager is gone: its workers are detached and named, find them
        log.warning("pool manager shutdown: %s: %s", type(e).__name__, e)
        return []


def start_pool_manager(config: ElasticConfig, recipes: dict, initial: dict, **actor_options):
    """The PoolManager actor (named MANAGER_NAME unless actor_options say otherwise; restarted by Ray; no CPU
    reserved: it mostly waits); its loop starts with the first `membership` call (a router's health check)."""
    import ray

    options: dict[str, Any] = dict(num_cpus=0, max_restarts=-1, max_concurrency=100)
    cls = ray.remote(**options)(PoolManager)
    return cls.options(**{"name": MANAGER_NAME, **actor_options}).remote(config, recipes, initial)


def worker_index(worker_id: str) -> int:
    """n of "<role>-<n>" (-1 for another id, e.g. a data-parallel rank's "decode-0-dp1")."""
    match = re.fullmatch(r"[a-z]+-(\d+)", worker_id)
    return int(match.group(1)) if match else -1


class PoolManager:
    """A Ray actor (async): the planner's loop, the pools' membership, and growing and draining workers."""

    def __init__(self, config: ElasticConfig, recipes: dict, initial: dict):
        """recipes: {role: WorkerRecipe} of the elastic pools; initial: {role: {worker id: handle}} as started."""
        self.config = config
        self.recipes = dict(recipes)
        self.planner = Planner(config.planner)
        self.members: dict[str, PoolMember] = {}
        self.starting: dict[str, dict[str, Any]] = {role: {} for role in POOLS}  # worker id -> handle (or None)
        self._stopped = False
        # Milliseconds at construction, then +1 a change: a restarted manager's versions are newer than any a router
        # holds from before the restart (a counter from 1 could repeat one with other members).
        self.version = time.time_ns() // 1_000_000
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self._last: dict[str, dict[str, WorkerSample]] = {role: {} for role in POOLS}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None
        for role, handles in initial.items():
            for wid, handle in handles.items():
                self.members[wid] = PoolMember(wid, role, handle)
        self._recover()
        self._next = {
            role: 1 + max((worker_index(w) for w, m in self.members.items() if m.role == role), default=-1)
            for role in POOLS
        }

    def _recover(self) -> None:
        """After a restart: the workers this manager added before are named, detached actors; take them back."""
        import ray

        namespace = ray.get_runtime_context().namespace
        for role, recipe in self.recipes.items():
            pattern = re.compile(re.escape(recipe.name_prefix) + rf"({role}-\d+)" + re.escape(recipe.name_suffix) + "$")
            ns = dict(recipe.actor_options).get("namespace", namespace)
            for actor in ray.util.list_named_actors(all_namespaces=True):
                match = pattern.match(actor["name"])
                if match and actor["namespace"] == ns and match.group(1) not in self.members:
                    with contextlib.suppress(ValueError):  # gone between the listing and the lookup
                        handle = ray.get_actor(actor["name"], namespace=ns)
                        self.members[match.group(1)] = PoolMember(match.group(1), role, handle)
                        log.info("pool manager: recovered %s", match.group(1))

    # ---- what routers, the launcher and the bench read ----------------------------------------------
    def membership(self, known_version: int = -1) -> PoolMembership | None:
        """The elastic pools' membership; None when the caller's `known_version` is current."""
        self._ensure_running()
        if known_version == self.version:
            return None
        members = tuple(m for m in self.members.values() if m.role in self.recipes)
        return PoolMembership(self.version, tuple(self.recipes), members)

    def status(self) -> dict:
        """Pool sizes by state and the decisions so far (newest last)."""
        self._ensure_running()
        return {"version": self.version, "sizes": self.sizes(POOLS), "decisions": list(self.history)}

    def shutdown(self) -> list:
        """Stop planning (the service is stopping); -> every worker handle to kill, starting ones included."""
        self._stopped = True
        for task in (self._loop, *self._tasks):
            if task is not None:
                task.cancel()
        starting = [h for pool in self.starting.values() for h in pool.values() if h is not None]
        return [m.handle for m in self.members.values()] + starting

    # ---- the loop -----------------------------------------------------------------------------------
    def _ensure_running(self) -> None:
        if self._stopped:
            return
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run(), name="pool-planner")

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - one bad tick must not end the planner
                log.exception("pool planner tick failed")
            await asyncio.sleep(self.config.planner.interval_s)

    async def tick(self) -> list[ScaleDecision]:
        decisions = []
        for role in self.recipes:
            obs = await self._observe(role)
            decision = self.planner.decide(obs, time.monotonic())
            self._record(decision)
            self._act(decision)
            decisions.append(decision)
        return decisions

    async def _observe(self, role: str) -> PoolObservation:
        # One snapshot before the await: a worker that becomes ready meanwhile moves from `starting` to the
        # members, and counting one side before and the other after would lose it (and grow the pool again).
        active = [m for m in self.members.values() if m.role == role and not m.draining]
        starting = len(self.starting[role])
        draining = sum(1 for m in self.members.values() if m.role == role and m.draining)
        timeout = self.config.signal_timeout_s
        results = await asyncio.gather(
            *(asyncio.wait_for(m.handle.signals.remote(), timeout) for m in active), return_exceptions=True
        )
        now = time.monotonic()
        samples = {
            m.worker_id: WorkerSample(
                worker_id=m.worker_id,
                running=r.load.running,
                waiting=r.load.waiting,
                kv_usage=r.load.kv_usage,
                queue_tokens=r.queue_tokens,
                ttft_p90_s=r.ttft_p90_s,
                itl_p90_s=r.itl_p90_s,
                samples=r.samples,
                at=now,
            )
            for m, r in zip(active, results)
            if not isinstance(r, BaseException)
        }
        self._last[role] = samples
        return PoolObservation(
            pool=role,
            bounds=self.config.bounds(role),
            ready=tuple(samples.values()),
            starting=starting,
            draining=draining,
            silent=len(active) - len(samples),
        )

    def _record(self, d: ScaleDecision) -> None:
        from engine.telemetry import metrics

        metrics.POOL_DESIRED_WORKERS.labels(d.pool).set(d.desired)
        metrics.POOL_PRESSURE.labels(d.pool).set(d.pressure)
        if d.changed:
            direction = "up" if d.desired > d.current else "down"
            metrics.POOL_SCALE_DECISIONS.labels(d.pool, direction, d.reason).inc()
            log.warning(
                "pool %s: %d -> %d workers (%s, pressure %.2f; %s)", d.pool, d.current, d.desired, d.reason,
                d.pressure, d.detail,
            )  # fmt: skip
        elif d.reason not in ("steady", "confirming"):
            log.info("pool %s: holding at %d (%s; %s)", d.pool, d.current, d.reason, d.detail)
        self.history.append(
            {"t": time.time(), "pool": d.pool, "current": d.current, "desired": d.desired, "reason": d.reason,
             "pressure": round(d.pressure, 3)}
        )  # fmt: skip
        self._publish_sizes()

    def _publish_sizes(self) -> None:
        from engine.telemetry import metrics

        for role, sizes in self.sizes(tuple(self.recipes)).items():
            for state, n in sizes.items():
                metrics.POOL_WORKERS.labels(role, state).set(n)

    def sizes(self, roles: tuple[str, ...]) -> dict[str, dict[str, int]]:
        """{role: {"ready" | "starting" | "draining": workers}}."""
        return {
            role: {
                "ready": sum(1 for m in self.members.values() if m.role == role and not m.draining),
                "starting": len(self.starting[role]),
                "draining": sum(1 for m in self.members.values() if m.role == role and m.draining),
            }
            for role in roles
        }

    def _act(self, d: ScaleDecision) -> None:
        for _ in range(d.desired - d.current):
            self._spawn(self._grow(d.pool))
        for _ in range(d.current - d.desired):
            victim = self._victim(d.pool)
            if victim is None:
                break
            self.members[victim.worker_id] = replace(victim, draining=True)  # now, so the next victim differs
            self.version += 1
            self._spawn(self._drain(victim))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _victim(self, role: str) -> PoolMember | None:
        """The ready worker with the fewest streams (the newest among equals): the cheapest to drain."""
        ready = [m for m in self.members.values() if m.role == role and not m.draining]
        if not ready:
            return None
        last = self._last[role]

        def busy(m: PoolMember) -> tuple[int, int]:
            s = last.get(m.worker_id)
            return (s.running + s.waiting if s is not None else 0, -worker_index(m.worker_id))

        return min(ready, key=busy)

    # ---- grow and drain -----------------------------------------------------------------------------
    async def _grow(self, role: str) -> None:
        import ray

        wid = f"{role}-{self._next[role]}"
        self._next[role] += 1
        self.starting[role][wid] = None
        self._publish_sizes()
        handle = None
        try:
            handle = self.starting[role][wid] = self.recipes[role].start(wid)
            await asyncio.wait_for(handle.ping.remote(), self.config.start_timeout_s)
        except Exception as e:  # noqa: BLE001 - not scheduled, constructor failed, timed out: give it up
            from engine.telemetry import metrics

            log.warning("pool %s: new worker %s did not become ready: %s: %s", role, wid, type(e).__name__, e)
            metrics.POOL_START_FAILURES.labels(role).inc()
            if handle is not None:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
            return
        finally:
            self.starting[role].pop(wid, None)
        self.members[wid] = PoolMember(wid, role, handle)
        self.version += 1
        self._publish_sizes()
        log.warning("pool %s: worker %s is ready and joins the routers", role, wid)

    async def _drain(self, member: PoolMember) -> None:
        """No new placements (the routers see `draining` within router_sync_s), streams finish, then it goes."""
        import ray

        wid, cfg = member.worker_id, self.config
        log.warning("pool %s: draining %s", member.role, wid)
        self._publish_sizes()
        await asyncio.sleep(cfg.router_sync_s)
        left = await self._wait_idle(member.handle, cfg.drain_timeout_s)
        if left:
            log.warning(
                "pool %s: %s still had %d requests after %.0f s; they migrate", member.role, wid, left,
                cfg.drain_timeout_s,
            )  # fmt: skip
        self.members.pop(wid, None)
        self.version += 1
        await asyncio.sleep(cfg.router_sync_s)  # every router has dropped it (and its prefix digest)
        with contextlib.suppress(Exception):
            ray.kill(member.handle, no_restart=True)
        if member.role == "prefill":
            peers = [m.handle for m in self.members.values() if m.role == "decode"]
            await asyncio.gather(*(h.remove_peer.remote(wid) for h in peers), return_exceptions=True)
        self._publish_sizes()
        log.warning("pool %s: %s removed", member.role, wid)

    async def _wait_idle(self, handle, timeout_s: float) -> int:
        """Wait until the worker holds no request on two checks in a row; -> requests left at the deadline."""
        deadline, idle, busy = time.monotonic() + timeout_s, 0, 0
        while time.monotonic() < deadline:
            try:
                stats = await asyncio.wait_for(handle.stats.remote(), self.config.signal_timeout_s)
            except Exception:  # noqa: BLE001 - dead or wedged: nothing left to wait for
                return 0
            busy = stats.load.running + stats.load.waiting
            idle = idle + 1 if busy == 0 else 0
            if idle >= 2:
                return 0
            await asyncio.sleep(0.5)
        return busy
