"""RouterActor: the Ray actor that hosts the gRPC router (placement, admission, the workers' health) and the
supervisor of multi-rank worker groups."""

from __future__ import annotations

import asyncio
from typing import Any


class RouterActor:
    """Hosts the gRPC router (grpc.aio) in a Ray actor's event loop."""

    def __init__(
        self,
        prefill: dict,
        decode: dict,
        policy: str,
        token: str | None = None,
        groups: tuple = ({}, {}),
        pools=None,
        **server_kw,
    ):
        """server_kw: RouterServer's admission settings (max_queued, queue_timeout_s, restart_wait_s);
        groups: ({worker id: PlacedWorker}, {worker id: GroupRecipe}) of the multi-rank workers, restarted as a
        group when a rank dies (service.group_restart); pools: the PoolManager of elastic pools (service.pools),
        whose membership the dispatcher follows."""
        from router.policy import PolicyConfig, RoutingPolicy
        from router.server import RouterServer
        from service.group_restart import GroupSupervisor
        from service.ray_dispatcher import RayDispatcher

        self.dispatcher = RayDispatcher(prefill, decode, pools=pools)
        self.server = RouterServer(
            self.dispatcher,
            RoutingPolicy(PolicyConfig(name=policy)),
            health_interval_s=1.0,
            health_timeout_s=10.0,
            auth_token=token,
            **server_kw,
        )
        self.port: int | None = None
        self.host = ""
        self._token = token
        placed, recipes = groups
        self.supervisor = GroupSupervisor(placed, recipes, replace=self.dispatcher.replace_handle) if placed else None
        self._supervising: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind host:port ("node": this node's cluster address); -> the port."""
        from kv_transfer.registry import node_address

        self.host = node_address() if host == "node" else host
        await self.dispatcher.health_check()  # exchanges transfer metadata before the first request
        self.port = bound = await self.server.start(self.host, port)
        if self.supervisor is not None:
            self._supervising = asyncio.get_running_loop().create_task(self.supervisor.run())
        return bound

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


def router_actor_class():
    """RouterActor as a Ray actor class (no CPU reserved: it mostly waits; many requests at once)."""
    import ray

    options: dict[str, Any] = dict(num_cpus=0, max_concurrency=1000)
    return ray.remote(**options)(RouterActor)
