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
with none lost. Loopback only; every level is bounded by `--seconds`, and the run ends by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

from dsv4_kernels.settings import reload, settings
from service.bench_serve import pct
from service.benchmarks_md import BENCHMARKS_MD, markers, write_section
from service.frontdoor_client import kernel_receive_times
from service.frontdoor_load import (
    CLIENTS,
    SERVICE,
    cpu_by_component,
    cpu_delta,
    env_by_component,
    run_level,
    warm_up,
)
from service.frontdoor_runs import merge_runs, p99_at
from service.frontdoor_score import LETTER, dump_level, score
from service.frontdoor_workers import SyntheticDecode, SyntheticPrefill

TOKEN_PATH = (
    "the routers only place (gRPC `Place`); the tokens go from the decode actor to the ingress replica that owns the "
    "request (service/direct_path.py), then to the client"
)
FRONT = {
    True: "through HAProxy (Serve's HAProxy mode: the replica serves HTTP on its own port; service/serve_front.py, "
    "`DSV4_HAPROXY=1`)",
    False: "through Serve's Python proxy (`DSV4_HAPROXY=0`)",
}
FEED_PATH = {
    "tcp": "over the decode actor's token feed to that replica, carried by TCP (the decode actor connects to the "
    "replica's listener and writes one frame an engine step for all of the replica's requests there: "
    "service/tcp_feed.py, `DSV4_TOKEN_FEED=1`, `DSV4_TOKEN_FEED_TRANSPORT=tcp`)",
    "ray": "over the decode actor's token feed to that replica, carried by Ray (one Ray streaming call per decode actor "
    "and replica, one item an engine step for all of the replica's requests there: service/token_feed.py, "
    "`DSV4_TOKEN_FEED=1`, `DSV4_TOKEN_FEED_TRANSPORT=ray`)",
    "none": "in one Ray streaming call a request (`DSV4_TOKEN_FEED=0`)",
}
PREFILL_PATH = {
    True: "each request's prefill goes as a frame on a TCP connection the prefill actor opened to the replica's "
    "listener (service/prefill_link.py, `DSV4_PREFILL_FEED=1`; the Ray call until that link is up)",
    False: "each request's prefill is a Ray actor call (`DSV4_PREFILL_FEED=0`)",
}
STEP_CLOCK = (
    "The synthetic decode actors run a step clock as an engine's continuous batch does (every running request gets "
    "one token a step, `--token-rate` steps a second), so a step's tokens of every stream leave at once."
)


@dataclass(frozen=True)
class LevelResult:
    replicas: int
    streams: int
    offered_tps: float
    delivered_tps: float
    requests: int
    tokens: int
    added_ms_p50: float
    added_ms_p99: float
    cpu_ms_per_1k: float  # the service's processes (SERVICE components), per 1K tokens received
    cpu_by_component: dict
    lost_tokens: int
    out_of_order: int
    errors: int
    load_avg: float = 0.0  # the machine's 1-minute load average at the level's end (other work on it shows here)
    serve_env: dict = field(default_factory=dict)  # proxy / ingress -> the Serve switches their processes ran with
    token_feed: bool = True  # DSV4_TOKEN_FEED as the replicas read it (they inherit this process's environment)
    haproxy: bool = False  # the front door the level ran through (HAProxy, or Serve's Python proxy)
    client_lag_ms_p99: float = 0.0  # the load client's own loop lag (in every receive time, so in the added latency)
    step_lag_ms_p99: float = 0.0  # the synthetic step clock's lateness (not in the added latency: emits are stamped)
    feed_transport: str = "ray"  # DSV4_TOKEN_FEED_TRANSPORT as the replicas read it (rows of older runs: ray)
    p99_runs: tuple = ()  # --repeat: each run's added p99 (the row holds medians: service.frontdoor_runs)
    prefill_feed: bool = False  # DSV4_PREFILL_FEED as the replicas read it (rows of older runs: the Ray call)
    link_prefills: int = 0  # the level's prefill calls that went over the prefill actor's link, not Ray
    link_places: int = 0  # the level's Place calls that went over a router's place link, not gRPC
    client: str = "aiohttp"  # the load client (service.frontdoor_load.CLIENTS; rows of older runs: aiohttp)
    error_kinds: dict = field(default_factory=dict)  # the 3 commonest error kinds (an error's text to its ':') -> count
    added_ms_p99_seen: float = 0.0  # the lean client: p99 as its loop read the tokens (added_ms_p99: the kernel's time)


CLIENT_TEXT = {
    "raw": "Load client: service.frontdoor_client (`--client raw`): a keep-alive HTTP/1.1 connection a stream, "
    "each read kept raw with the kernel's receive time of its last segment (SO_TIMESTAMPNS) and the client loop's "
    "time.time(), the SSE events parsed after the response; an event is received when the read holding its last byte "
    "is. The added latency uses the kernel's time (the bytes in the client's socket: free of the client's own "
    "scheduling); the client-seen p99 column uses the loop's.",
    "aiohttp": "Load client: aiohttp (`--client aiohttp`): each SSE line read by its line reader, stamped and parsed "
    "as it arrives (no client-seen column: the added latency is what the client saw).",
}


def _client(rows: list[LevelResult], args) -> str:
    return rows[-1].client if rows else args.client


def _client_text(client: str) -> str:
    if client == "raw" and not kernel_receive_times():
        return CLIENT_TEXT[client] + " This machine's kernel gave no receive times: both columns are the loop's."
    return CLIENT_TEXT[client]


def _feed_path(r: LevelResult | None) -> str:
    on, transport = (r.token_feed, r.feed_transport) if r else (settings().token_feed, settings().token_feed_transport)
    prefill = PREFILL_PATH[r.prefill_feed if r else settings().prefill_feed]
    return f"{FEED_PATH[transport if on else 'none']}; {prefill}"


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
    ramp = _ramp(args)
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


def _warmup_text(args) -> str:
    if args.warmup_seconds <= 0:
        return "no warm-up (`--warmup-seconds 0`): each replica count's first level starts right after its deploy; "
    return (
        f"after each deploy an untimed warm-up level ({args.warmup_seconds:g} s at {args.streams[0]} streams: the "
        "replicas' links to the routers and actors open, HAProxy reloads; frontdoor_load.warm_up), then "
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
        if args.warmup_seconds > 0:
            tag = (tag0 + len(rows)) * 100_000
            warm = (args.streams[0], args.warmup_seconds, args.max_tokens, letter_id, tag, _ramp(args), args.client)
            asyncio.run(warm_up(url, *warm))
        best = 0.0
        for streams in args.streams:
            if levels is not None and (replicas, streams) not in levels:
                continue
            tag = (tag0 + len(rows)) * 100_000
            row = run_one(handles, url, replicas, streams, args, letter_id, first_tag=tag)
            rows.append(row)
            print(_row_line(row), flush=True)
            if levels is None and row.delivered_tps < best * (1 + args.growth):
                break  # the ceiling: more offered load no longer raises throughput
            best = max(best, row.delivered_tps)
    return rows


def _row_line(r: LevelResult) -> str:
    top = sorted(((v, k) for k, v in r.cpu_by_component.items() if k in SERVICE), reverse=True)[:3]
    runs = f" {' / '.join(f'{x:.1f}' for x in r.p99_runs)} |" if r.p99_runs else ""
    return (
        f"| {r.replicas} | {r.streams} | {r.offered_tps:.0f} | {r.delivered_tps:.0f} | {r.added_ms_p50:.1f} | "
        f"{r.added_ms_p99:.1f} | {r.cpu_ms_per_1k:.0f} | {', '.join(f'{k} {v:.1f}' for v, k in top)} | "
        f"{r.client_lag_ms_p99:.1f} | {r.added_ms_p99_seen:.1f} | {r.step_lag_ms_p99:.1f} | "
        f"{r.requests} | {r.lost_tokens} | {r.out_of_order} | {r.errors} | {r.load_avg:.1f} |{runs}"
    )


def ceilings(rows: list[LevelResult]) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in rows:
        out[r.replicas] = max(out.get(r.replicas, 0.0), r.delivered_tps)
    return out


def at_half_ceiling(rows: list[LevelResult]) -> dict[int, LevelResult]:
    """Per replica count, the level whose delivered tok/s is nearest half that count's ceiling."""
    ceil = ceilings(rows)
    out: dict[int, LevelResult] = {}
    for k, top in ceil.items():
        mine = [r for r in rows if r.replicas == k]
        out[k] = min(mine, key=lambda r: abs(r.delivered_tps - top / 2))
    return out


def before_ceilings(text: str) -> dict[int, float]:
    """The ceilings of the BEFORE run (section frontdoor_before of BENCHMARKS.md: the router relayed every token)."""
    begin, end = markers("frontdoor_before")
    if begin not in text:
        return {}
    section = text.split(begin, 1)[1].split(end, 1)[0]
    line = next((x for x in section.splitlines() if x.startswith("Ceiling (max delivered tok/s):")), "")
    return {int(k): float(v) for k, v in re.findall(r"(\d+) replicas?: (\d+(?:\.\d+)?)", line)}


def comparison(rows: list[LevelResult], before: dict[int, float]) -> list[str]:
    ceil, half = ceilings(rows), at_half_ceiling(rows)
    lines = [
        "Added latency per token at half the ceiling (the level nearest it): "
        + ", ".join(
            f"{k} replica{'s' if k > 1 else ''}: p50 {r.added_ms_p50:.1f} ms, p99 {r.added_ms_p99:.1f} ms "
            f"({r.delivered_tps:.0f} tok/s)"
            for k, r in sorted(half.items())
        )
        + "."
    ]
    lines.append(
        "Added latency p99 at exactly half the ceiling (linear between the levels around it): "
        + ", ".join(
            f"{k} replica{'s' if k > 1 else ''}: {p99_at([r for r in rows if r.replicas == k], top / 2):.1f} ms"
            for k, top in sorted(ceil.items())
        )
        + "."
    )
    if before:
        lines.append(
            "After / before (ceiling, same command, the BEFORE table below): "
            + ", ".join(
                f"{k} replica{'s' if k > 1 else ''}: {v:.0f} / {before[k]:.0f} = {v / before[k]:.2f}x"
                for k, v in sorted(ceil.items())
                if before.get(k)
            )
            + "."
        )
    return lines


def _switches(rows: list[LevelResult]) -> str:
    seen = rows[-1].serve_env if rows else {}
    return (
        "; ".join(
            f"{comp} " + (", ".join(f"{k}={v}" for k, v in sorted(seen[comp].items())) or "none")
            for comp in ("proxy", "haproxy", "ingress")
            if comp in seen
        )
        or "not read"
    )


def _ramp(args) -> float:
    return args.max_tokens / args.token_rate if args.ramp_seconds is None else args.ramp_seconds


def ab_lines(rows: list[LevelResult], other: list[LevelResult]) -> list[str]:
    """The same command's run with the other feed transport (`--ab-json`: its rows, run just before in the same
    session): its ceilings and added latency at half its ceiling beside this run's."""
    if not other:
        return []
    ceil, half = ceilings(other), at_half_ceiling(other)
    mine = ceilings(rows)
    transport = other[-1].feed_transport if other[-1].token_feed else "none (one stream a request)"
    return [
        f"A/B, same session, the same command with the token feed carried by {transport} (run just before this one, "
        f"load avg {min(r.load_avg for r in other):.1f}-{max(r.load_avg for r in other):.1f}): ceilings "
        + ", ".join(
            f"{k} replica{'s' if k > 1 else ''}: {v:.0f} (this run {mine.get(k, 0):.0f})"
            for k, v in sorted(ceil.items())
        )
        + "; added latency at half its ceiling "
        + ", ".join(
            f"{k} replica{'s' if k > 1 else ''}: p50 {r.added_ms_p50:.1f} ms, p99 {r.added_ms_p99:.1f} ms "
            f"({r.delivered_tps:.0f} tok/s)"
            for k, r in sorted(half.items())
        )
        + "."
    ]


def report(rows: list[LevelResult], args, command: str, other: list[LevelResult] | None = None) -> str:
    ceil = ceilings(rows)
    repeated = any(r.p99_runs for r in rows)
    runs = max((len(r.p99_runs) for r in rows), default=1)
    lines = [
        "## Front door: streamed tokens through the ingress, router and front door (`dsv4 bench frontdoor`)",
        "",
        "### AFTER: the routers place, the ingress replicas stream from the decode workers",
        "",
        f"Command: `{command}`. Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; loopback; synthetic pool (1 prefill + {args.decode_workers} decode "
        f"actors, no model) at {args.token_rate:g} tokens/s a stream, {args.max_tokens} tokens a request, "
        f"{args.seconds:g} s a level, {args.routers} router replicas. Token path: {TOKEN_PATH} "
        f"{FRONT[rows[-1].haproxy if rows else settings().haproxy]}; "
        f"{_feed_path(rows[-1] if rows else None)}. {STEP_CLOCK} "
        f"Serve switches the processes ran with: {_switches(rows)}.",
        "",
        f"Method: {_warmup_text(args)}the clients start one by one over {_ramp(args):g} s (one request's duration) "
        "before each level's "
        f"window of {args.seconds:g} s (service.frontdoor_load.run_level says why: clients started at once stay in "
        "step, and their requests all arrive again together every request's duration); delivered tok/s counts the "
        "tokens received in the window, the latency columns the decode tokens emitted in it. Added latency: client "
        "receive time minus the synthetic worker's emit time (same host clock), raw: it includes the load client's "
        "own delay (its loop runs on the same 2 cores; its loop lag p99, how late a 2 ms sleep of its loop woke, is "
        f"the client lag column, an upper bound of its share in the tail). {_client_text(_client(rows, args))} "
        "Step lag: how late the synthetic workers' "
        "step clock ran against its due times (not in the added latency: a token's emit time is stamped as it "
        "leaves, but fewer steps then run). CPU: user + system of the service's processes (router, ingress replicas, "
        "Serve proxy or HAProxy and its manager, Serve controller, raylet + GCS) per 1K tokens received; the top "
        "three components in CPU seconds. Load avg: the machine's 1-minute load average at the level's end "
        "(anything above the CPU count is other work competing)."
        + (
            f" The levels were swept {runs} times back to back (`--repeat`): each row holds the medians over the "
            "runs (the counts of requests, lost and out-of-order tokens and errors summed), every run's p99 in the "
            "last column."
            if repeated
            else ""
        ),
        "",
        "| ingress replicas | streams | offered tok/s | delivered tok/s | added p50 ms | added p99 ms | "
        "CPU ms / 1K tok | top CPU (s) | client lag p99 ms | client-seen p99 ms | step lag p99 ms | requests | lost | "
        "out of order | errors | load avg |" + (" added p99 ms, each run |" if repeated else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if repeated else ""),
    ]
    lines += [_row_line(r) for r in rows]
    failed = [r for r in rows if r.error_kinds]
    if failed:
        lines += [
            "",
            "Errors by kind: "
            + "; ".join(
                f"{r.replicas} x {r.streams}: " + ", ".join(f"{k} ({n})" for k, n in r.error_kinds.items())
                for r in failed
            )
            + ".",
        ]
    lines += [
        "",
        "Ceiling (max delivered tok/s): "
        + ", ".join(f"{k} replica{'s' if k > 1 else ''}: {v:.0f}" for k, v in sorted(ceil.items()))
        + ".",
        "",
        *comparison(rows, before_ceilings(BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "")),
        *ab_lines(rows, other or []),
    ]
    return "\n".join(lines)


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
        help="after each deploy, an untimed level this long at the first level's streams (0: none; bench_frontdoor."
        "warm_up says why)",
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
