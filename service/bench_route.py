"""`dsv4 bench route`: replay a Mooncake-format trace against the router's real policy code and a model of
the workers' caches and prefill speed (service/route_sim.py); `dsv4 bench make-trace` writes the traces.

Per policy it prints: token hit rate, the hit rate of one pooled cache with all workers' capacity, max/mean
prefill load across workers, simulated TTFT p50/p99, and router decision time p50/p99. `--json` prints one
object: {"trace", "workers", "capacity_blocks", ..., "policies": {name: {hit_rate, pooled_hit_rate,
load_imbalance, ttft_p50_s, ttft_p99_s, decision_us_p50, decision_us_p99, ...}}}.
"""

from __future__ import annotations

import argparse
import json

from router.policy import POLICIES
from service import route_traces
from service.route_sim import ESTIMATE, SimConfig, simulate

BENCH_POLICIES = (*POLICIES, ESTIMATE)


def add_bench_route_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        required=True,
        help="Mooncake-format JSONL (timestamp, input_length, output_length, hash_ids of 512-token blocks)",
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity-blocks", type=int, default=4096, help="cache capacity of one worker, in blocks")
    p.add_argument(
        "--policies",
        default="round_robin,least_loaded,cache_aware",
        help=f"comma-separated, of {', '.join(BENCH_POLICIES)} ({ESTIMATE}: cache_aware on the "
        "router's own estimate instead of the workers' digests)",
    )
    p.add_argument("--tokens-per-s", type=float, default=SimConfig.tokens_per_s, help="prefill speed of a worker")
    p.add_argument("--overhead-s", type=float, default=SimConfig.overhead_s, help="fixed cost of one prefill")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide arrival times by this (load factor)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")


def add_make_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", required=True, choices=route_traces.KINDS)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=None, help="arrival rate, requests/s (default: the kind's)")
    p.add_argument("--size", type=int, default=None, help="chat: requests; system_prompts: groups; agentic: agents")


def run(trace_path: str, policies: list[str], cfg: SimConfig) -> dict:
    bad = [p for p in policies if p not in BENCH_POLICIES]
    if bad:
        raise ValueError(f"unknown policy {bad[0]!r}; choose from {BENCH_POLICIES}")
    if cfg.workers < 1 or cfg.capacity_blocks < 1 or cfg.tokens_per_s <= 0 or cfg.time_scale <= 0:
        raise ValueError(f"workers and capacity_blocks must be >= 1, tokens_per_s and time_scale > 0: {cfg}")
    trace = route_traces.read(trace_path)
    return {
        "trace": str(trace_path),
        "requests": len(trace),
        "workers": cfg.workers,
        "capacity_blocks": cfg.capacity_blocks,
        "block_tokens": cfg.block_tokens,
        "tokens_per_s": cfg.tokens_per_s,
        "overhead_s": cfg.overhead_s,
        "time_scale": cfg.time_scale,
        "policies": {p: simulate(trace, p, cfg) for p in policies},
    }


def table(result: dict) -> str:
    head = (
        f"{result['trace']}: {result['requests']} requests, {result['workers']} workers x "
        f"{result['capacity_blocks']} blocks"
    )
    rows = [
        f"{'policy':<22}{'hit':>7}{'pooled':>8}{'max/mean':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'dec p50 us':>12}{'dec p99 us':>12}"
    ]
    for name, r in result["policies"].items():
        rows.append(
            f"{name:<22}{r['hit_rate']:>7.1%}{r['pooled_hit_rate']:>8.1%}{r['load_imbalance']:>10.2f}"
            f"{r['ttft_p50_s']:>10.3f}{r['ttft_p99_s']:>10.3f}{r['decision_us_p50']:>12.1f}"
            f"{r['decision_us_p99']:>12.1f}"
        )
    return "\n".join([head, *rows])


def bench_route_main(args) -> int:
    cfg = SimConfig(
        workers=args.workers,
        capacity_blocks=args.capacity_blocks,
        tokens_per_s=args.tokens_per_s,
        overhead_s=args.overhead_s,
        time_scale=args.time_scale,
    )
    result = run(args.trace, [p.strip() for p in args.policies.split(",") if p.strip()], cfg)
    print(json.dumps(result) if args.json else table(result))
    return 0


def make_trace_main(args) -> int:
    path = route_traces.write(route_traces.make(args.kind, args.seed, args.rate, args.size), args.out)
    print(path)
    return 0
