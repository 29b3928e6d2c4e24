"""`dsv4 bench soak --minutes N`: the whole service under mixed load with faults, for a long time.

Starts the service as `dsv4 serve` does (a fresh local Ray cluster, prefill and decode pools, the router, the
HTTP ingress replicas), then for N minutes `--clients` threads send a mix over HTTP: streaming and plain
completions of random lengths, chat, requests the server must refuse (bad types, unknown roles, oversized
stop lists), and streams the client abandons midway. Every `--fault-every` seconds one worker gets the next fault
of `--faults`, alternating pools: `kill` (`ray.kill`, Ray restarts it), `raise` (its engine's next step raises:
the watchdog ends it, Ray restarts it), `hang` (its next step never returns: marked down at the stall bound, its
streams moved, then restarted), `stop` (SIGSTOP for `--stop-seconds`: marked down, its streams moved, then
SIGCONT), `rank` (one follower rank of a multi-rank worker killed: its whole group is placed again,
service.group_restart; needs `--decode-tensor-parallel-size` or `--prefill-tensor-parallel-size` > 1). `raise`
and `hang` build the workers with their test hooks on (engine.runtime.health). Faults go to the workers as they
are placed now (a group restart replaces a multi-rank worker's actors); `--fault-count N` ends the run one fault
interval after the N-th fault. Once the load ended and the workers are idle (or 30 s passed: a leak), the report
gives: outcomes by type (ok, 4xx by status, 429, 503 in-band or not, other 5xx, transport errors), /health answer
latency, the restarts, what every worker still holds once idle (pages in use, exports not released, quarantined
pulls, staging bytes: any non-zero is a leak), and the resident memory of every service process at the start of
the run and at its end (growth = leak suspects). `--write-benchmarks` puts the report in BENCHMARKS.md (section
`soak`), every number from this run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import threading
import time

from kv_transfer.registry import TRANSFER_CHOICES, TRANSFER_HELP
from service.ray_cluster import free_port


def rss_mib(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.health: list[float] = []

    def add(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1


def _one(session, base: str, rng: random.Random, vocab: int, tally: Tally) -> None:
    """One request of the mix; counts what the client saw."""
    kind = rng.choices(["stream", "plain", "chat", "bad", "abandon"], [35, 30, 15, 10, 10])[0]
    prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(4, 200))]
    body = {"model": "dsv4", "prompt": prompt, "max_tokens": rng.randint(1, 96), "ignore_eos": True}
    path = "/v1/completions"
    if kind == "chat":
        path, body = (
            "/v1/chat/completions",
            {
                "model": "dsv4",
                "max_tokens": rng.randint(1, 48),
                "messages": [{"role": "user", "content": "soak " * rng.randint(1, 40)}],
            },
        )
    elif kind == "bad":
        body = rng.choice(
            [
                {**body, "max_tokens": "5"},
                {"model": "dsv4", "messages": [{"role": "x", "content": "a"}]},
                {**body, "stop": ["s"] * 100},
                {**body, "prompt": [vocab + 5]},
            ]
        )
        path = "/v1/chat/completions" if "messages" in body else path
    stream = kind in ("stream", "abandon")
    try:
        r = session.post(base + path, json={**body, "stream": stream}, stream=stream, timeout=300)
        if r.status_code != 200:
            tally.add(f"http_{r.status_code}" + ("_expected" if kind == "bad" and r.status_code == 400 else ""))
            r.close()
            return
        if not stream:
            tally.add("ok" if kind != "bad" else "bad_request_accepted")
            return
        payloads = []
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data:"):
                payloads.append(line[5:].strip())
                if kind == "abandon" and len(payloads) >= 2:
                    break
        r.close()
        if kind == "abandon":
            tally.add("abandoned")
        elif payloads and payloads[-1] == "[DONE]" and len(payloads) > 1 and "error" in payloads[-2]:
            err = json.loads(payloads[-2])["error"]
            tally.add(f"inband_{err.get('code')}")
        elif payloads and payloads[-1] == "[DONE]":
            tally.add("ok")
        else:
            tally.add("stream_cut")
    except Exception as e:  # noqa: BLE001 - a transport error is an outcome to count
        tally.add(f"client_{type(e).__name__}")


def _health(base: str, stop: threading.Event, tally: Tally) -> None:
    import requests

    s = requests.Session()
    s.trust_env = False
    while not stop.wait(1.0):
        t0 = time.monotonic()
        try:
            s.get(base + "/health", timeout=30)
            tally.health.append(time.monotonic() - t0)
        except Exception:  # noqa: BLE001
            tally.add("health_no_answer")


FAULTS = ("kill", "raise", "hang", "stop", "rank")


def _inject(kind: str, handle, stop_s: float, stopped: list, followers: list) -> None:
    """One fault on one worker (the module docstring); a stopped process is continued after stop_s."""
    import signal

    import ray

    if kind == "rank":
        ray.kill(followers[-1], no_restart=True)  # ranks are never restarted alone: the group comes back
    elif kind == "kill":
        ray.kill(handle, no_restart=False)
    elif kind in ("raise", "hang"):
        ray.get(handle.inject_fault.remote(kind), timeout=30)
    else:
        pid = int(ray.get(handle.stats.remote(), timeout=30).incarnation.split("-")[0])
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        threading.Timer(stop_s, _continue, args=(pid, stopped)).start()


def _continue(pid: int, stopped: list) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass
    if pid in stopped:
        stopped.remove(pid)


def _current(handles) -> tuple[dict, dict]:
    """-> ({pool: {worker id: rank-0 handle}}, {worker id: follower handles}) as the router has them placed now:
    a group restart gives a multi-rank worker new actors, and the handles start_service returned die with it."""
    import ray

    placed = ray.get(handles["router"].placed_workers.remote(), timeout=30)
    pools = {pool: {w: (placed[w].handle if w in placed else h) for w, h in handles[pool].items()} for pool in POOLS}
    return pools, {w: list(p.followers) for w, p in placed.items() if p.followers}


POOLS = ("prefill", "decode")
SETTLE_LIMIT_S = 30.0  # after the load, how long restarts and abandoned requests may take to leave workers idle


def _held(worker) -> dict:
    """Run inside a worker's actor (`__ray_call__`): what it still holds (leaks once the service is idle)."""
    backend = getattr(worker, "backend", None)
    staging = getattr(backend, "staging", None)
    return {
        "exports": len(backend.exported()) if backend is not None else 0,
        "quarantined": len(getattr(worker, "quarantined", {})),
        "staging_bytes": staging.arena.capacity - staging.arena.free_bytes() if staging is not None else 0,
    }


def _leaks(pools: dict) -> dict[str, dict]:
    """Per worker: pages in use, running / waiting requests and `_held`; every value is 0 when nothing leaked."""
    import ray

    out = {}
    for pool in POOLS:
        for wid, h in sorted(pools[pool].items()):
            s = ray.get(h.stats.remote(), timeout=60)
            held = ray.get(h.__ray_call__.remote(_held), timeout=60)
            out[wid] = {"kv_usage": s.kv_usage, "running": s.running, "waiting": s.waiting, **held}
    return out


def _settle(handles, limit_s: float = SETTLE_LIMIT_S) -> tuple[dict, dict[str, dict]]:
    """Once the load ended: (the pools as placed now, `_leaks`) when every worker holds nothing (restarts done,
    abandoned requests freed), or what they still hold after limit_s (a leak)."""
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + limit_s
    while True:
        time.sleep(1.0)
        try:
            pools = _current(handles)[0]
            held = _leaks(pools)
        except ActorUnavailableError:  # a worker still restarting (its last fault's end): not settled yet
            if time.monotonic() >= deadline:
                raise
            continue
        if not any(v for w in held.values() for v in w.values()) or time.monotonic() >= deadline:
            return pools, held


def _pids(handles, pools: dict) -> dict[str, int]:
    import ray

    actors = {**pools["prefill"], **pools["decode"], "router": handles["router"]}
    return {k: ray.get(a.__ray_call__.remote(lambda self: os.getpid()), timeout=60) for k, a in actors.items()}


def _serve_replica_pids() -> dict[str, int]:
    """Serve's HTTP replicas and proxy are named actors in its namespace (no dashboard needed to find them)."""
    import ray

    out: dict = {}  # name -> pid (ray.get of an actor call, typed loosely)
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if "REPLICA" in name.upper() or "PROXY" in name.upper():
            try:
                h = ray.get_actor(name, namespace=a["namespace"])
                out[f"serve-{'replica' if 'REPLICA' in name.upper() else 'proxy'}-{len(out)}"] = ray.get(
                    h.__ray_call__.remote(lambda self: os.getpid()), timeout=30
                )
            except Exception:  # noqa: BLE001 - a replica being replaced: measure the others
                continue
    return out


def run_soak(args) -> dict:
    import ray
    import requests

    from engine.loading.make_model import default_model_dir
    from engine.model.config import ModelConfig
    from service.launcher import (
        ServiceConfig,
        init_ray,
        prepare_metrics_dir,
        remove_metrics_dir,
        start_service,
        stop_service,
    )

    model_dir = args.model or default_model_dir()
    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    init_ray(prepare_metrics_dir())
    faults = [f for f in args.faults.split(",") if f]
    if not faults or set(faults) - set(FAULTS):
        raise ValueError(f"--faults must list some of {FAULTS}, got {args.faults!r}")
    if "rank" in faults and max(args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size) < 2:
        raise ValueError(
            "--faults rank needs a multi-rank worker: --prefill-tensor-parallel-size or "
            f"--decode-tensor-parallel-size of 2 or more (got {args.prefill_tensor_parallel_size}, "
            f"{args.decode_tensor_parallel_size})"
        )
    cfg = ServiceConfig(
        model_dir=model_dir,
        port=free_port(),
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        transfer=args.transfer,
        engine_options=(("max_batch_tokens", args.max_batch_tokens),),
        stall_timeout_s=args.stall_timeout_seconds,
        worker_test_hooks=bool({"raise", "hang"} & set(faults)),
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
        expert_parallel=max(args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size) > 1,
        ready_timeout_s=300.0,
    )
    handles = start_service(cfg)
    base = f"http://127.0.0.1:{cfg.port}"
    tally, stop = Tally(), threading.Event()
    stopped: list[int] = []  # pids under SIGSTOP right now
    try:
        pids = {**_pids(handles, _current(handles)[0]), **_serve_replica_pids()}
        time.sleep(5)
        rss0 = {k: rss_mib(p) for k, p in pids.items()}
        threading.Thread(target=_health, args=(base, stop, tally), daemon=True).start()

        def client(seed: int) -> None:
            rng, s = random.Random(seed), requests.Session()
            s.trust_env = False
            while not stop.is_set():
                _one(s, base, rng, vocab, tally)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        started = time.monotonic()
        end, next_fault = started + 60 * args.minutes, started + args.fault_every
        kills: list[str] = []
        injected: list[str] = []  # "kind worker" of every fault
        while time.monotonic() < end:
            time.sleep(1.0)
            if args.fault_count and len(injected) >= args.fault_count:  # the last fault had its interval: done
                end = min(end, next_fault)
                continue
            if args.fault_every > 0 and time.monotonic() >= next_fault:
                n = len(injected)
                pool, kind = POOLS[n % 2], faults[n // 2 % len(faults)]
                wid = "?"
                try:
                    pools, followers = _current(handles)
                    ids = sorted(followers) if kind == "rank" else sorted(pools[pool])
                    wid = ids[n // (2 * len(faults)) % len(ids)]
                    handle = pools["prefill" if wid in pools["prefill"] else "decode"][wid]
                    _inject(kind, handle, args.stop_seconds, stopped, followers.get(wid, []))
                    injected.append(f"{kind} {wid}")
                    kills += [wid] if kind == "kill" else []
                except Exception as e:  # noqa: BLE001 - e.g. the worker is restarting from the last fault
                    print(f"soak: {kind} on {wid} skipped: {type(e).__name__}: {e}", flush=True)
                next_fault = time.monotonic() + args.fault_every
        ended_early = bool(args.fault_count) and len(injected) >= args.fault_count
        minutes = round((time.monotonic() - started) / 60, 2) if ended_early else args.minutes
        stop.set()
        for t in threads:
            t.join(300)
        while stopped:  # a stopped worker is continued before the end is measured
            time.sleep(0.5)
        pools, held = _settle(handles)
        pids_end = {**_pids(handles, pools), **_serve_replica_pids()}
        rss1 = {k: rss_mib(p) for k, p in pids_end.items()}
        health = sorted(tally.health)
        from kv_transfer.registry import resolve_name

        return {
            "minutes": minutes,
            "clients": args.clients,
            "topology": f"{cfg.prefill_workers}P{cfg.decode_workers}D"
            + "".join(f" {role} TP{cfg.parallel(role)[0]}" for role in POOLS if cfg.parallel(role)[0] > 1),
            "transfer": resolve_name(args.transfer),
            "kills": kills,
            "faults": injected,
            "outcomes": dict(tally.counts),
            "health_answers": len(health),
            "health_p50_ms": 1e3 * health[len(health) // 2] if health else float("nan"),
            "health_max_ms": 1e3 * health[-1] if health else float("nan"),
            "rss_start_mib": rss0,
            "rss_end_mib": rss1,
            "group_restarts": ray.get(handles["router"].group_restarts.remote(), timeout=30),
            "held_at_end": held,
            "idle_at_end": not any(v for w in held.values() for v in w.values()),
        }
    finally:
        stop.set()
        for pid in list(stopped):
            _continue(pid, stopped)
        stop_service(handles, drain_s=5)
        remove_metrics_dir()


def report_markdown(r: dict) -> str:
    total = sum(r["outcomes"].values())
    faults = r.get("faults", [f"kill {w}" for w in r["kills"]])
    kills = ", ".join(f"{w} x{n}" for w, n in sorted(collections.Counter(faults).items())) or "none"
    lines = [
        f"## Soak: {r['minutes']:g} min, {r['clients']} clients, {r['topology']} ({r['transfer']}), "
        f"{len(faults)} worker faults ({kills})",
        "",
        "Mixed load over HTTP (streaming, plain, chat, refused bad input, abandoned streams) with a worker "
        "faulted (killed, a step raising or hanging, stopped, a rank of a multi-rank worker killed) every `--fault-every` seconds, alternating "
        "pools; written by `dsv4 bench soak`. Outcomes: "
        "`ok` finished normally, `abandoned` the client left mid-stream on purpose, `http_400_expected` bad "
        "input refused, `http_503` a plain request (or a stream before its first token) and `inband_503` a "
        "stream after its first tokens caught on a killed worker; any other outcome would be listed.",
        "",
        f"{total} requests, {total / (60 * r['minutes']):.1f}/s.",
        "",
        "| outcome | requests | share |",
        "|---|---:|---:|",
    ]
    for k, v in sorted(r["outcomes"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {k} | {v} | {100 * v / max(total, 1):.1f}% |")
    lines += [
        "",
        f"/health: {r['health_answers']} answers, p50 {r['health_p50_ms']:.0f} ms, max "
        f"{r['health_max_ms']:.0f} ms. Pools idle at the end: {r['idle_at_end']}. Multi-rank group restarts: "
        f"{r.get('group_restarts', 0)}.",
        "",
    ]
    if "held_at_end" in r:
        lines += [
            "What each worker still held once idle (pages in use, exports not released, quarantined pulls, "
            "staging bytes; anything but 0 is a leak):",
            "",
            "| worker | kv usage | running | waiting | exports | quarantined | staging bytes |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for w, h in sorted(r["held_at_end"].items()):
            lines.append(
                f"| {w} | {h['kv_usage']:.3f} | {h['running']} | {h['waiting']} | {h['exports']} | "
                f"{h['quarantined']} | {h['staging_bytes']} |"
            )
        lines.append("")
    lines += [
        "| process | RSS start MiB | RSS end MiB | growth MiB |",
        "|---|---:|---:|---:|",
    ]
    for k in sorted(set(r["rss_start_mib"]) | set(r["rss_end_mib"])):
        a, b = r["rss_start_mib"].get(k, float("nan")), r["rss_end_mib"].get(k, float("nan"))
        lines.append(f"| {k} | {a:.0f} | {b:.0f} | {b - a:+.0f} |")
    lines.append("")
    lines.append(
        "A killed worker restarts as a new process, so its end RSS is a fresh process's; growth is "
        "meaningful for the router and the HTTP replicas."
    )
    return "\n".join(lines)


def bench_soak_main(args: argparse.Namespace) -> int:
    if args.report_json:  # re-render a finished run's result (its numbers, nothing re-measured)
        with open(args.report_json) as f:
            result = json.load(f)
    else:
        result = run_soak(args)
    md = report_markdown(result)
    print(md, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.write_benchmarks:
        from service.benchmarks_md import write_section

        write_section("soak", md)
    return 0


def add_bench_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between worker faults (0: none)")
    parser.add_argument("--faults", default="kill", help=f"comma-separated faults to rotate through, of {FAULTS}")
    parser.add_argument(
        "--fault-count",
        type=int,
        default=0,
        help="end the run --fault-every seconds after this many faults (--minutes is then the limit; 0: run it all)",
    )
    parser.add_argument(
        "--stop-seconds", type=float, default=20.0, help="how long a `stop` fault keeps a worker stopped"
    )
    parser.add_argument(
        "--stall-timeout-seconds",
        type=float,
        default=15.0,
        help="the workers' stall bound (a `hang` fault is seen after it)",
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--prefill-tensor-parallel-size", type=int, default=1, help="ranks per prefill worker")
    parser.add_argument(
        "--decode-tensor-parallel-size", type=int, default=1, help="ranks per decode worker (`rank` faults need 2+)"
    )
    parser.add_argument("--transfer", default="auto", choices=TRANSFER_CHOICES, help=TRANSFER_HELP)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--json", default=None, help="also write the raw result here")
    parser.add_argument("--write-benchmarks", action="store_true", help="write the report to BENCHMARKS.md")
    parser.add_argument("--report-json", default=None, help="render the report of a saved --json result instead")
