"""The Ray cluster under `dsv4 serve`: starting (or joining) it, where internal endpoints bind, waiting for actors
to come up, the metrics directory every process shares, and the session's logs for a failed start.

A fresh local cluster is started with `address="local"` (a stale /tmp/ray/ray_current_cluster is never joined);
one that misses Ray's start-up deadline is started again (LOCAL_START_ATTEMPTS). The prometheus multiprocess
directory reaches our processes through the job's runtime_env only, so Ray's own daemons keep their metrics out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


class ServiceStartError(RuntimeError):
    """A part of the service did not come up; the message names which part and what Ray reported."""


def single_node() -> bool:
    """Is the connected Ray cluster this one machine (internal endpoints may then stay on loopback)?"""
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) == 1


def free_port(host: str = "127.0.0.1") -> int:
    """A free port of `host` between Ray's worker ports (10002-19999) and the kernel's ephemeral range (32768+, where
    the local ends of Ray's many connections come from), so that nothing takes it between this check and the bind
    by the metrics server, Serve's proxy or HAProxy; a kernel-picked one as a last resort."""
    rng = random.Random()
    for _ in range(100):
        with socket.socket() as s:
            try:
                s.bind((host, rng.randrange(20000, 32768)))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def internal_host() -> str:
    """Where internal listeners bind: loopback on one node, else "node" (each process's node address)."""
    return "127.0.0.1" if single_node() else "node"


def job_env() -> dict:
    """The job's runtime_env variables (an actor's own runtime_env replaces them unless repeated)."""
    import ray

    try:
        return dict((ray.get_runtime_context().runtime_env or {}).get("env_vars") or {})
    except Exception:  # noqa: BLE001 - older Ray: nothing to repeat
        return {}


def wait_ready(refs: dict, timeout_s: float, what: str) -> dict:
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


def wait_http(url: str, timeout_s: float) -> None:
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


SINGLE_NODE_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's own switch; "0": a one-machine cluster on loopback


@contextlib.contextmanager
def _loopback_node():
    """A fresh local cluster on the loopback address: Ray's single-machine mode (what it runs on macOS and Windows)
    makes 127.0.0.1 the node's address, and every Ray listener follows it: GCS, raylet, each worker's gRPC port,
    the agents and Ray's three Prometheus exporters (which otherwise listen on all interfaces). Nothing else can
    join such a cluster; `dsv4 serve` never asks another machine to. The daemons spawned by ray.init inherit the
    variable (their workers get the address from the raylet); this process reads Ray's constant, set while ray.init
    runs. What still listens on other interfaces: docs/security.md."""
    from ray._private import ray_constants

    saved_env, saved_const = os.environ.get(SINGLE_NODE_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[SINGLE_NODE_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_const
        if saved_env is None:
            del os.environ[SINGLE_NODE_VAR]
        else:
            os.environ[SINGLE_NODE_VAR] = saved_env


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
    A local cluster listens on loopback only (_loopback_node).
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
                with contextlib.ExitStack() as stack:
                    if address == "local":
                        stack.enter_context(_loopback_node())
                    if own_session and address == "local":
                        stack.enter_context(_daemons_in_own_session())
                    ray.init(
                        address=address,
                        runtime_env={"env_vars": env},
                        include_dashboard=False,
                        logging_level=logging.WARNING,
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
