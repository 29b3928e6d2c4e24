"""`dsv4 bench serve`: N concurrent clients, a fixed request count, one table per topology.

Runs 1P1D, 2P2D (Ray actors, real KV transfer) and a colocated single engine (no transfer) in one run,
each behind the same gRPC router, and reports TTFT p50/p99, inter-token latency p50/p99, requests/s,
output tokens/s and KV transfer GB/s. Writes the table to BENCHMARKS.md (section `service`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import sys
import time
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from kv_transfer.registry import TRANSFER_CHOICES, TRANSFER_HELP
from service.benchmarks_md import write_section


@dataclass(frozen=True)
class RequestTiming:
    ttft: float
    itls: tuple
    tokens: int
    e2e: float


def pct(values, q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def drive(addr: str, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                token: str | None = None):
    from router.client import AsyncRouterClient

    client = AsyncRouterClient(addr, timeout_s=600, token=token)
    queue = list(enumerate(prompts))
    timings: list[RequestTiming] = []

    async def worker():
        while queue:
            _, prompt = queue.pop()
            start = time.perf_counter()
            last, first, itls, n = None, None, [], 0
            async for ev in client.generate(prompt, params):
                if ev.token_id is None:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    itls.append(now - last)
                last, n = now, n + 1
            timings.append(RequestTiming(first, tuple(itls), n, time.perf_counter() - start))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, time.perf_counter() - t0


def summarize(name: str, timings: list[RequestTiming], wall: float, transfer: dict | None) -> dict:
    itls = [x for t in timings for x in t.itls]
    gbps = (transfer["bytes"] / transfer["seconds"] / 1e9) if transfer and transfer["seconds"] else float("nan")
    return {"topology": name, "requests": len(timings),
            "ttft_p50_ms": 1e3 * pct([t.ttft for t in timings], 0.5),
            "ttft_p99_ms": 1e3 * pct([t.ttft for t in timings], 0.99),
            "itl_p50_ms": 1e3 * pct(itls, 0.5), "itl_p99_ms": 1e3 * pct(itls, 0.99),
            "req_per_s": len(timings) / wall, "tok_per_s": sum(t.tokens for t in timings) / wall,
            "kv_gb_per_s": gbps, "kv_mb": (transfer or {}).get("bytes", 0) / 1e6}


def run_ray_topology(cfg_kwargs: dict, prompts, params, concurrency) -> tuple:
    import ray

    from service.launcher import ServiceConfig, start_service

    cfg = ServiceConfig(**cfg_kwargs)
    handles = start_service(cfg, http=False)
    try:
        asyncio.run(drive(handles["router_addr"], prompts[:4], params, 4, handles["token"]))  # warm-up
        base = ray.get([d.transfer_summary.remote() for d in handles["decode"].values()])
        timings, wall = asyncio.run(drive(handles["router_addr"], prompts, params, concurrency, handles["token"]))
        after = ray.get([d.transfer_summary.remote() for d in handles["decode"].values()])
        transfer = {k: sum(a[k] - b[k] for a, b in zip(after, base)) for k in ("bytes", "seconds", "count")}
    finally:
        ray.get(handles["router"].stop.remote())
        for h in (*handles["prefill"].values(), *handles["decode"].values(), handles["router"]):
            ray.kill(h)
    return timings, wall, transfer


def run_colocated(model_dir: str, engine_options: dict, prompts, params, concurrency) -> tuple:
    from engine.llm import load_engine
    from router.local_dispatch import LocalDispatcher
    from router.server import RouterServer

    async def main():
        dispatcher = LocalDispatcher(1, lambda: load_engine(model_dir, **engine_options))
        server = RouterServer(dispatcher)
        port = await server.start("127.0.0.1", 0)
        try:
            await drive(f"127.0.0.1:{port}", prompts[:4], params, 4)
            return await drive(f"127.0.0.1:{port}", prompts, params, concurrency)
        finally:
            await server.stop(1.0)
            dispatcher.close()

    timings, wall = asyncio.run(main())
    return timings, wall, None


def write_markdown(rows: list[dict], command: str, header: str) -> str:
    lines = ["## Service", "", f"Command: `{command}`", "", header, "",
             "| topology | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | req/s | tok/s "
             "| KV GB/s | KV MB moved |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['topology']} | {r['requests']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                     f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | "
                     f"{r['kv_gb_per_s']:.3f} | {r['kv_mb']:.1f} |")
    return "\n".join(lines) + "\n"


def bench_serve_main(args: argparse.Namespace) -> int:
    if getattr(args, "trace", None):
        from service.bench_trace import bench_trace_main

        return bench_trace_main(args)
    from service.launcher import init_ray, prepare_metrics_dir
    from engine.config import ModelConfig
    from engine.make_model import default_model_dir

    model_dir = args.model or default_model_dir()
    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_requests)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engine_options = {"max_batch_tokens": args.max_batch_tokens}
    init_ray(prepare_metrics_dir())
    rows = []
    for name, p, d in (("1P1D", 1, 1), ("2P2D", 2, 2)):
        timings, wall, transfer = run_ray_topology(
            dict(model_dir=model_dir, prefill_workers=p, decode_workers=d, transfer=args.transfer,
                 engine_options=tuple(engine_options.items()), worker_num_cpus=0.1), prompts, params,
            args.concurrency)
        rows.append(summarize(f"{name} ({args.transfer})", timings, wall, transfer))
        print(rows[-1], flush=True)
    timings, wall, _ = run_colocated(model_dir, engine_options, prompts, params, args.concurrency)
    rows.append(summarize("colocated 1 engine", timings, wall, None))
    header = (f"Machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}; model "
              f"{os.path.basename(model_dir.rstrip('/'))}; {args.num_requests} requests, {args.concurrency} clients, "
              f"prompts {args.min_prompt}-{args.max_prompt} tokens, {args.max_new_tokens} new tokens; "
              f"date {time.strftime('%Y-%m-%d')}. Anchor: the colocated single engine.")
    section = write_markdown(rows, "dsv4 bench serve " + " ".join(sys.argv[3:]), header)
    print(section)
    write_section("service", section)
    return 0


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--transfer", default="auto", choices=TRANSFER_CHOICES, help=TRANSFER_HELP)
    from service.bench_trace import add_trace_args

    add_trace_args(parser)
