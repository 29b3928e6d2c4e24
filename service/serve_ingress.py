"""The HTTP ingress as a Ray Serve deployment: the FastAPI app of `service.openai_app` behind Serve's proxy.

`@serve.ingress` needs the app object when the class is defined, so it is built here at import time with
`make_app(current_server)`; each replica's constructor then calls `openai_app.configure(...)` for its own
process. The routes reach that server through `service.openai_app.current_server`, a module-level function
that cloudpickle sends by reference, so Serve's copy of the app finds the replica's real module state (a
global set by a class pickled by value would land in a throwaway namespace instead). The router client is
created lazily on the first request, inside the loop that serves it.

Liveness: Serve calls `check_health` every HEALTH_PERIOD_S on the replica's own event loop; a loop that a
request has blocked cannot answer within HEALTH_TIMEOUT_S, so Serve marks the replica unhealthy and
replaces it (user-sized work runs off the loop, so this is the last line of defence, not the first).
Token path: with `routers` (what `dsv4 serve` deploys), a replica asks a router where each request runs and then
reads the decode worker's token stream itself (service.direct_path), so the replicas, not the router, carry the
tokens and the token path scales with them. Each reserves only INGRESS_NUM_CPUS of a CPU (a scheduling token) and
the default is two of them, so that one stuck or restarting replica never takes the API down.

Front door: HAProxy in front of the replicas' own HTTP ports, or Serve's Python proxy (service.serve_front: which,
why, and the environment each needs).
"""

from __future__ import annotations

import asyncio
import gc
from typing import cast

from ray import serve
from ray.serve import Deployment
from ray.serve.schema import LoggingConfig

from dsv4_kernels.settings import settings
from engine.runtime import gc_pauses
from service.ingress_guard import IngressOptions
from service.openai_app import DEFAULT_REQUEST_TIMEOUT_S, current_server, make_app
from service.serve_front import serve_front

app = make_app(current_server)
HEALTH_PERIOD_S = 5.0
HEALTH_TIMEOUT_S = 10.0
INGRESS_NUM_CPUS = 0.1
DEFAULT_REPLICAS = 2
GC_GEN0_THRESHOLD = 10_000  # net new container objects between young collections (the default is 700)


@serve.deployment(
    name="dsv4-openai",
    max_ongoing_requests=1000,  # requests mostly wait on the router
    health_check_period_s=HEALTH_PERIOD_S,
    health_check_timeout_s=HEALTH_TIMEOUT_S,
    ray_actor_options={"num_cpus": INGRESS_NUM_CPUS},
)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(
        self,
        router_addr: str,
        model_dir: str,
        model_name: str,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        options: IngressOptions | None = None,
        routers: list | None = None,
    ):
        """routers: the router replicas' actor handles: the router places and this replica streams from the decode
        worker (service.direct_path); None: every request is a Generate stream through the router at router_addr."""
        from service import openai_app  # the real module (this method may have been pickled by value)

        options = options or IngressOptions.from_env()
        factory = None
        if routers:
            from service.direct_path import DirectClient

            def factory():
                return DirectClient(routers, options.router_token, request_timeout_s, feed_host=options.internal_host)

        self.server = openai_app.configure(
            router_addr, model_dir, model_name, request_timeout_s, options, client_factory=factory
        )
        # What the replica holds from here on (Ray, Serve, FastAPI, the tokenizer: ~260K objects) never becomes
        # garbage; left in the collector's oldest generation, every full collection walks all of it (50-240 ms on the
        # 2-core box, a stall every stream of the replica waits out: the token path's latency tail).
        gc_pauses.freeze_startup_heap("ingress")
        gc_pauses.watch_pauses("ingress")
        # Young collections: with the default 700 the replica collected ~12 times a second at 1600 tok/s, every tenth
        # a gen-1 pass of 3-5 ms that each stream's next token waits out; at 10,000 none ran in a 6 s level at 32
        # streams (was 6, 17 ms in all; BENCHMARKS frontdoor). A pass still walks only what is new since the last one.
        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])

    async def check_health(self) -> None:
        await asyncio.sleep(0)  # answering at all proves the event loop is not blocked


def ingress_deployment() -> Deployment:
    """The ingress as what `serve.deployment` made it: a Deployment (Ray's stubs type the decorated name as the
    class itself, which has no `options` or `bind`), with Serve's access log unless DSV4_ACCESS_LOG=0 turns it off
    (a log record a request on the replica's loop: dsv4_kernels.settings gives its cost)."""
    deployment = cast(Deployment, OpenAIIngress)
    return deployment.options(logging_config=LoggingConfig(enable_access_log=settings().access_log))


def deploy_http(
    router_addr: str,
    model_dir: str,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_replicas: int = DEFAULT_REPLICAS,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    app_name: str = "dsv4-openai",
    options: IngressOptions | None = None,
    routers: list | None = None,
):
    """Start Serve's front door on host:port (HAProxy or Serve's HTTP proxy: service.serve_front) and deploy
    `num_replicas` ingress replicas (on the connected Ray cluster) serving the OpenAI API at "/"; -> the deployment
    handle. Returns once it is running.

    The front door's processes are the Serve controller's actors and inherit its environment; the replicas get theirs
    in their runtime_env. A controller already running keeps its own."""
    front = serve_front((options or IngressOptions.from_env()).limits)
    serve.start(
        http_options={"host": host, "port": port},
        controller_options={"runtime_env": {"env_vars": front.controller_env}},
    )
    actor_options = {"num_cpus": INGRESS_NUM_CPUS, "runtime_env": {"env_vars": front.replica_env}}
    deployment = ingress_deployment().options(num_replicas=num_replicas, ray_actor_options=actor_options)
    return serve.run(
        deployment.bind(router_addr, model_dir, model_name, request_timeout_s, options, routers),
        name=app_name,
        route_prefix="/",
    )
