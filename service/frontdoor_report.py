"""The report of `dsv4 bench frontdoor` (service.bench_frontdoor runs the levels): a level's row (`LevelResult`), the
ceilings and the latency at half of them, the after/before ratios read from BENCHMARKS.md's baseline, and the
markdown section with the method, the token path the run took and the Serve switches its processes ran with."""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field

from dsv4_kernels.settings import settings
from service.benchmarks_md import BENCHMARKS_MD, markers
from service.frontdoor_client import kernel_receive_times
from service.frontdoor_load import SERVICE
from service.frontdoor_runs import p99_at

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


def _warmup_text(args) -> str:
    if args.warmup_seconds <= 0:
        return "no warm-up (`--warmup-seconds 0`): each replica count's first level starts right after its deploy; "
    return (
        f"after each deploy an untimed warm-up level ({args.warmup_seconds:g} s at {args.streams[0]} streams: the "
        "replicas' links to the routers and actors open, HAProxy reloads; frontdoor_load.WARMUP_TAG), then "
    )


def row_line(r: LevelResult) -> str:
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


def ramp_seconds(args) -> float:
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
        f"Method: {_warmup_text(args)}the clients start one by one over {ramp_seconds(args):g} s (one request's duration) "
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
    lines += [row_line(r) for r in rows]
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
