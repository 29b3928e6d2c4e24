"""`dsv4 bench frontdoor`: the service's token path (HAProxy or Serve's proxy -> ingress replica, which places
through a gRPC router and reads the decode worker's token feed itself: TCP or Ray, DSV4_TOKEN_FEED_TRANSPORT) under many
concurrent streams, with a synthetic pool in place of the model; `--ab-json` puts a run with the other transport beside it.

Everything on the token path is production's: `service.serve_ingress.deploy_http` (the front door of service.serve_front and the
OpenAI ingress replicas with their `service.direct_path.DirectClient`), `--routers` replicas of
`service.router_actor.RouterActor` (RouterServer + RayDispatcher + the policy) placing every request; only the
workers are `service.frontdoor_workers` (disaggregated: prefill answers at once, decode emits
`--token-rate` tokens/s per stream). For each ingress replica count, the offered load rises (`--streams`
levels) until delivered tokens/s stops growing; each level reports delivered tokens/s, the added latency per
token (client receive time minus the worker's emit time, time.time() on one host; decode tokens only), CPU per
1K tokens of the service's processes (by component), and checks that every stream's tokens arrived in order
with none lost (the report: service.frontdoor_report). Loopback only; every level is bounded by `--seconds`, and the
run ends by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import urllib.request
from dataclasses import asdict
from typing import Any

from dsv4_kernels.settings import reload, settings
from service.bench_serve import pct
from service.benchmarks_md import write_section
from service.frontdoor_load import (
    CLIENTS,
    SERVICE,
    WARMUP_TAG,
    cpu_by_component,
    cpu_delta,
    env_by_component,
    run_level,
)
from service.frontdoor_report import LevelResult, ramp_seconds, report, row_line
from service.frontdoor_runs import merge_runs
from service.frontdoor_score import LETTER, dump_level, score
from service.frontdoor_workers import SyntheticDecode, SyntheticPrefill


def _letter_id(model_dir: str) -> int:
    from engine.loading.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    if tok is None:
        raise RuntimeError(f"{model_dir}: no tokenizer (the ingress must turn the synthetic tokens into letters)")
    ids = tok.encode(LETTER)
    ids = [i for i in ids if tok.decode([i], False) == LETTER]
    if not ids or any(tok.decode([ids[0] + d], False) != chr(ord(LETTER) + d) for d in range(26)):
        raise RuntimeError(f"{model_dir}: the synthetic streams need one token per letter a..z in order")
    return ids[0]


def start(model_dir: str, decode_workers: int, token_rate: float, letter_id: int, routers: int = 2) -> dict:
    """Ray (local), the synthetic pool and the real routers; -> handles (Serve is deployed per replica count)."""
    import ray

    from router.auth import new_token
    from service.launcher import init_ray
    from service.router_actor import router_actor_class

    init_ray(tempfile.mkdtemp(prefix="dsv4-frontdoor-metrics-"))
    # Both actors are async (max_concurrency bounds their coroutines; the prefill actor's `open_prefill_link` makes it
    # one). The prefill actor was threaded once, and Ray starts a threaded actor's whole pool at once: 10,000 threads
    # took past Ray's 10 s limit on a loaded 2-core machine and killed it. Its `prefill` returns at once: 16 is plenty.
    threaded: Any = ray.remote(num_cpus=0, max_concurrency=16)  # type: ignore[call-overload]
    actor: Any = ray.remote(num_cpus=0, max_concurrency=10_000)  # type: ignore[call-overload]
    token = new_token()
    prefill = {"prefill-0": threaded(SyntheticPrefill).remote("prefill-0", token_rate, letter_id, token)}
    decode = {
        f"decode-{i}": actor(SyntheticDecode).remote(f"decode-{i}", token_rate, letter_id, token)
        for i in range(decode_workers)
    }
    router_cls = router_actor_class()
    replicas = [
        router_cls.options(name=f"dsv4-router-{i}").remote(prefill, decode, "cache_aware", token)
        for i in range(routers)
    ]
    ray.get([r.start.remote() for r in replicas], timeout=120)
    return {
        "prefill": prefill,
        "decode": decode,
        "routers": replicas,
        "token": token,
        "router_addr": ray.get(replicas[0].address.remote()),
    }


def deploy(handles: dict, model_dir: str, port: int, replicas: int) -> str:
    from service.ingress_guard import IngressOptions
    from service.serve_ingress import deploy_http

    deploy_http(
        handles["router_addr"],
        model_dir,
        "dsv4",
        "127.0.0.1",
        port,
        num_replicas=replicas,
        options=IngressOptions.from_env(router_token=handles["token"]),
        routers=handles["routers"],
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return url
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def _step_lag(handles: dict) -> list[float]:
    import ray

    return [x for h in handles["decode"].values() for x in ray.get(h.take_step_lag.remote())]


def _emits(handles: dict) -> dict:
    import ray

    logs: dict = {}
    for h in (*handles["prefill"].values(), *handles["decode"].values()):
        for tag, times in ray.get(h.take_emits.remote()).items():
            logs.setdefault(tag, []).extend(times)
    return {tag: sorted(times) for tag, times in logs.items()}


def run_one(handles: dict, url: str, replicas: int, streams: int, args, letter_id: int, first_tag: int) -> LevelResult:
    import ray

    from service.serve_front import HAPROXY_SERVE_ENV, PROXY_SERVE_ENV, REPLICA_SERVE_ENV

    _emits(handles)  # drop what an earlier level left
    _step_lag(handles)
    ramp = ramp_seconds(args)
    before = cpu_by_component()
    level = asyncio.run(
        run_level(url, streams, args.seconds, args.max_tokens, letter_id, first_tag, ramp, client=args.client)
    )
    records, t0, t_end = level.records, level.t0, level.t_end
    cpu = cpu_delta(before, cpu_by_component())
    names = (*PROXY_SERVE_ENV, *REPLICA_SERVE_ENV, *HAPROXY_SERVE_ENV)
    serve_env = env_by_component(names, ("proxy", "haproxy", "ingress"))
    emits = _emits(handles)
    s = score(records, emits, t0, t_end, args.max_tokens, letter_id)
    if args.dump:
        dump_level(args.dump, replicas, streams, records, emits, t0, t_end)
    service_cpu = sum(cpu.get(k, 0.0) for k in SERVICE)
    return LevelResult(
        replicas,
        streams,
        streams * args.token_rate,
        s["in_window"] / (t_end - t0),
        len(records),
        s["tokens"],
        s["p50"],
        s["p99"],
        1e6 * service_cpu / max(1, s["tokens"]),
        {k: round(v, 2) for k, v in sorted(cpu.items())},
        s["lost"],
        s["disorder"],
        s["errors"],
        os.getloadavg()[0],
        serve_env,
        settings().token_feed,
        serve_env.get("ingress", {}).get("RAY_SERVE_ENABLE_HA_PROXY") == "1",
        pct(list(level.client_lag_ms), 0.99),
        pct(_step_lag(handles), 0.99),
        settings().token_feed_transport,
        prefill_feed=settings().prefill_feed and settings().token_feed and settings().token_feed_transport == "tcp",
        link_prefills=sum(ray.get([h.take_link_prefills.remote() for h in handles["prefill"].values()])),
        link_places=sum(ray.get([r.take_link_places.remote() for r in handles["routers"]])),
        client=args.client,
        error_kinds=s["error_kinds"],
        added_ms_p99_seen=s["p99_seen"],
    )


def sweep(handles: dict, model_dir: str, args, letter_id: int) -> list[LevelResult]:
    """The levels swept --repeat times (later sweeps run the first one's levels), merged (service.frontdoor_runs)."""
    runs = [_sweep_once(handles, model_dir, args, letter_id, None, 0)]
    levels = [(r.replicas, r.streams) for r in runs[0]]
    for k in range(1, args.repeat):
        print(f"repeat {k + 1} of {args.repeat}", flush=True)
        runs.append(_sweep_once(handles, model_dir, args, letter_id, levels, k * len(levels)))
    return merge_runs(runs)


def _sweep_once(
    handles: dict, model_dir: str, args, letter_id: int, levels: list[tuple[int, int]] | None, tag0: int
) -> list[LevelResult]:
    """Per replica count, raise the streams until delivered tokens/s grows by less than --growth (`levels`: run
    exactly these (replicas, streams) instead). tag0: levels run before (each level's prompts are tagged apart)."""
    rows: list[LevelResult] = []
    for replicas in args.replicas:
        url = deploy(handles, model_dir, args.port, replicas)
        if args.warmup_seconds > 0:  # untimed: frontdoor_load.WARMUP_TAG says why
            tag = WARMUP_TAG + (tag0 + len(rows)) * 100_000
            level = (args.streams[0], args.warmup_seconds, args.max_tokens, letter_id, tag, ramp_seconds(args))
            asyncio.run(run_level(url, *level, client=args.client))
        best = 0.0
        for streams in args.streams:
            if levels is not None and (replicas, streams) not in levels:
                continue
            tag = (tag0 + len(rows)) * 100_000
            row = run_one(handles, url, replicas, streams, args, letter_id, first_tag=tag)
            rows.append(row)
            print(row_line(row), flush=True)
            if levels is None and row.delivered_tps < best * (1 + args.growth):
                break  # the ceiling: more offered load no longer raises throughput
            best = max(best, row.delivered_tps)
    return rows


def bench_frontdoor_main(args: argparse.Namespace) -> int:
    from engine.loading.make_model import default_model_dir
    from service.launcher import stop_service

    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    model_dir = args.model or default_model_dir()
    letter_id = _letter_id(model_dir)
    # HAProxy's admin listeners on free ports unless set: back-to-back runs would otherwise race the last run's
    # HAProxy for the fixed defaults while it exits (service.serve_front)
    for name in ("DSV4_HAPROXY_STATS_PORT", "DSV4_HAPROXY_METRICS_PORT"):
        os.environ.setdefault(name, "0")
    reload()
    handles = start(model_dir, args.decode_workers, args.token_rate, letter_id, args.routers)
    try:
        rows = sweep(handles, model_dir, args, letter_id)
    finally:
        stop_service(
            {"prefill": handles["prefill"], "decode": handles["decode"], "routers": handles["routers"]}, drain_s=0
        )
    other = None
    if args.ab_json:
        import json

        with open(args.ab_json) as f:
            other = [LevelResult(**r) for r in json.load(f)]
    text = report(rows, args, args.command_line or "dsv4 bench frontdoor", other)
    print(text)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    if args.write:
        write_section("frontdoor", text)
    if args.write_baseline:  # a run of an earlier commit: the baseline the after/before ratios read
        write_section("frontdoor_before", f"### BEFORE: {args.write_baseline}\n\n{text.split(chr(10), 1)[1]}")
    return 0


def add_bench_frontdoor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replicas",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4],
        help="ingress replica counts, comma-separated",
    )
    p.add_argument(
        "--streams",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[8, 32, 64, 128],
        help="concurrent streaming clients, rising levels (a level that adds < --growth ends the sweep)",
    )
    p.add_argument("--token-rate", type=float, default=50.0, help="tokens/s each synthetic stream emits")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--seconds", type=float, default=6.0, help="each level's duration (in-flight requests finish)")
    p.add_argument(
        "--warmup-seconds",
        type=float,
        default=6.0,
        help="after each deploy, an untimed level this long at the first level's streams (0: none; "
        "service.frontdoor_load.WARMUP_TAG says why)",
    )
    p.add_argument(
        "--ramp-seconds",
        type=float,
        default=None,
        help="the clients start one by one over this long before each level's window (default: one request's "
        "duration, max tokens / token rate)",
    )
    p.add_argument(
        "--client",
        choices=CLIENTS,
        default="raw",
        help="the load client: raw (service.frontdoor_client: bytes stamped as they arrive, parsed after the "
        "response) or aiohttp (a line reader and a parse a chunk as it arrives; the client shares the 2 cores)",
    )
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--routers", type=int, default=2, help="router replicas (placement only)")
    p.add_argument("--growth", type=float, default=0.05, help="a level must raise throughput by this fraction")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="sweep the levels this many times back to back; rows are the medians (service.frontdoor_runs)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--write-baseline",
        default=None,
        metavar="LABEL",
        help="put this run into BENCHMARKS.md as the baseline (section frontdoor_before, headed BEFORE: LABEL) "
        "that later runs' after/before ratios read: run it on the commit to compare against",
    )
    p.add_argument("--model", default=None, help="model dir for the ingress's tokenizer (default: the tiny model)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument(
        "--ab-json",
        default=None,
        metavar="PATH",
        help="rows (--json) of the same command run just before with the other DSV4_TOKEN_FEED_TRANSPORT: the section "
        "states its ceilings and latency beside this run's",
    )
    p.add_argument("--write", action="store_true", help="write the table to BENCHMARKS.md (section frontdoor)")
    p.add_argument(
        "--dump",
        default=None,
        metavar="PATH",
        help="append each level's decode tokens as [emit time, added ms] to this JSON-lines file (the tail's shape)",
    )
    p.add_argument("--command-line", default=None, help=argparse.SUPPRESS)
