"""RouterActor: the Ray actor that hosts one gRPC router replica (placement, admission, the workers' health) and,
on the replica given the groups, the supervisor of multi-rank worker groups.

Several replicas run side by side (`dsv4 serve --routers N`, the KubeRay app's `routers`: `start_routers`); each probes every worker and builds its state from
what they publish (service.ray_dispatcher), so any replica places any request, and none is on the token path
(service.direct_path). Ray restarts a killed replica (max_restarts=-1): the restarted process starts serving on its
first `address` call (an ingress asks it when its old address stops answering), on the same port when one was
fixed, else on a new one.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from engine.runtime import gc_pauses
from service.ray_cluster import wait_ready

if TYPE_CHECKING:
    from service.service_config import ServiceConfig

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 10.0


class RouterActor:
    """Hosts the gRPC router (grpc.aio) in a Ray actor's event loop."""

    def __init__(
        self,
        prefill: dict,
        decode: dict,
        policy: str,
        token: str | None = None,
        groups: tuple = ({}, {}),
        listen: tuple[str, int] = ("127.0.0.1", 0),
        pools=None,
        **server_kw,
    ):
        """server_kw: RouterServer's admission settings (max_queued, queue_timeout_s, restart_wait_s);
        groups: ({worker id: PlacedWorker}, {worker id: GroupRecipe}) of the multi-rank workers, restarted as a
        group when a rank dies (service.group_restart); listen: (host, port) a restarted process binds ("node":
        this node's cluster address; port 0: any free one); pools: the PoolManager of elastic pools
        (service.pools), whose membership the dispatcher follows."""
        from router.policy import PolicyConfig, RoutingPolicy
        from router.server import RouterServer
        from service.group_restart import GroupSupervisor
        from service.ray_dispatcher import RayDispatcher

        self.dispatcher = RayDispatcher(prefill, decode, pools=pools)
        # Its in-flight count covers only its own recent placements (the stream never passes it): admission also
        # counts what the decode workers report holding.
        self.server = RouterServer(
            self.dispatcher,
            RoutingPolicy(PolicyConfig(name=policy, reported_load=True)),
            health_interval_s=HEALTH_INTERVAL_S,
            health_timeout_s=HEALTH_TIMEOUT_S,
            auth_token=token,
            **server_kw,
        )
        self.port: int | None = None
        self.host = ""
        self.listen = listen
        self._token = token
        self._starting: asyncio.Lock | None = None
        placed, recipes = groups
        self.peers: list = []  # the other router replicas (told of every handle a group restart replaces)
        self.supervisor = GroupSupervisor(placed, recipes, replace=self._replaced) if placed else None
        self._supervising: asyncio.Task | None = None

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Bind host:port (default: `listen`; "node": this node's cluster address); -> the port. Idempotent."""
        from kv_transfer.node_address import node_address

        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.port is not None:
                return self.port
            host = self.listen[0] if host is None else host
            port = self.listen[1] if port is None else port
            self.host = node_address() if host == "node" else host
            await self.dispatcher.health_check()  # exchanges transfer metadata before the first request
            self.port = bound = await self.server.start(self.host, port)
            # What the router holds from here on (Ray, gRPC, the policy) is never garbage; left in the oldest
            # generation, a full collection walks it all: 100-224 ms on the 2-core box (bench frontdoor, 32
            # streams), a core taken from the token path's processes. As the ingress replicas (service.serve_ingress).
            gc_pauses.freeze_startup_heap("router")
            gc_pauses.watch_pauses("router")
            if self.supervisor is not None:
                self._supervising = asyncio.get_running_loop().create_task(self.supervisor.run())
            return bound

    async def address(self) -> str:
        """host:port of the gRPC router (serving from this call on, in a process Ray restarted)."""
        await self.start()
        return f"{self.host}:{self.port}"

    async def open_place_link(self, link_id: str, host: str, port: int, key: str) -> tuple[str, ...]:
        """Connect to an ingress replica's listener at host:port and take its Place calls over that connection
        (router.place_link; `key`: what the replica gave this link, sent back in its HELLO) -> the frame kinds this
        router reads there. Returns once connected; the connection lives on this actor's loop."""
        from router import place_link

        await self.start()
        await place_link.connect(link_id, host, port, self._token or "", key, self.server)
        return place_link.TAKES

    def take_link_places(self) -> int:
        """Place calls taken over place links since the last call (benchmarks: how many placements took that path)."""
        out, self.server.link_places = self.server.link_places, 0
        return out

    def set_peers(self, peers: list) -> None:
        """The other router replicas: the supervisor hands them each new handle too."""
        self.peers = list(peers)

    def replace_handle(self, worker_id: str, handle) -> None:
        """A multi-rank worker placed again by the supervising replica: route to its new actor."""
        self.dispatcher.replace_handle(worker_id, handle)

    def _replaced(self, worker_id: str, handle) -> None:
        self.dispatcher.replace_handle(worker_id, handle)
        for peer in self.peers:
            peer.replace_handle.remote(worker_id, handle)  # fire-and-forget: a dead peer restarts from the start

    def worker_handles(self) -> dict:
        """{worker id: actor handle} of both pools as they are now (an ingress runs placed requests on them)."""
        return self.dispatcher.handles()

    def pid(self) -> int:
        import os

        return os.getpid()

    def placed_workers(self) -> dict:
        """The multi-rank workers as they are placed now (a group restart replaces their actors and group)."""
        return dict(self.supervisor.placed) if self.supervisor is not None else {}

    def group_restarts(self) -> int:
        return self.supervisor.restarts if self.supervisor is not None else 0

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


def router_actor_class():
    """RouterActor as a Ray actor class (no CPU reserved: it mostly waits; many requests at once; restarted by Ray
    when its process dies)."""
    import ray

    options: dict[str, Any] = dict(num_cpus=0, max_concurrency=1000, max_restarts=-1)
    return ray.remote(**options)(RouterActor)


def start_routers(
    cfg: ServiceConfig,
    prefill: dict,
    decode: dict,
    groups: tuple,
    listen: tuple[str, int],
    token: str,
    pools=None,
    *,
    names: str = "dsv4-router-{i}",
    router_cls=None,
    **actor_options: Any,
) -> list:
    """cfg.routers router replicas (named `names` with i = 0, 1, ..), each serving once this returns; the first one also
    supervises the multi-rank worker groups (one supervisor: two would restart a group twice); every one follows
    the elastic pools' membership (pools: their PoolManager, or None). listen: (host or "node", the first replica's
    port; 0: any free one, else one port a replica from there on). router_cls: the Ray actor class (default
    `router_actor_class()`); actor_options: more `.options` of each actor (namespace, lifetime, get_if_exists:
    the KubeRay app's detached routers, reused when its builder runs again)."""
    router_cls = router_cls or router_actor_class()
    host, first_port = listen
    routers = []
    for i in range(cfg.routers):
        routers.append(
            router_cls.options(name=names.format(i=i), **actor_options).remote(
                prefill,
                decode,
                cfg.router_policy,
                token,
                groups=groups if i == 0 else ({}, {}),
                listen=(host, first_port + i if first_port else 0),
                pools=pools,
                max_queued=cfg.router_max_queued,
                queue_timeout_s=cfg.router_queue_timeout_s,
            )
        )
    wait_ready({f"router-{i}": r.start.remote() for i, r in enumerate(routers)}, cfg.ready_timeout_s, "gRPC routers")
    wait_ready({"router-0 peers": routers[0].set_peers.remote(routers[1:])}, cfg.ready_timeout_s, "gRPC routers")
    return routers
