"""`dsv4 bench serve --trace FILE.jsonl`: replay a Mooncake-format trace against a live router + engines.

Per policy, a fresh gRPC router (router/server.py, the real policy) over `--workers` colocated engines with
their prefix caches (router/local_dispatch.py: one engine thread each, in this process), fed the trace's
requests at their timestamps (divided by `--time-scale`). Token ids come from `hash_ids`: block id h is the
same `--block-tokens` pseudo-random tokens wherever it appears (a 512-token trace block scaled to the model),
so shared ids are shared prefixes; output lengths are scaled the same way and capped by `--max-new-tokens`.
Reports, per policy: the real hit rate (prompt tokens the engines served from cache, summed from each
request's `cached_tokens`), TTFT and ITL p50/p99, and requests/s; writes BENCHMARKS.md section
`service_trace`.
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import sys
import time

from engine.execution.sampling_params import SamplingParams
from service.benchmarks_md import write_section
from service.route_traces import BLOCK, read


def pct(values, q: float) -> float:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def trace_prompts(trace, block_tokens: int, vocab: int, max_len: int) -> list[list[int]]:
    """Token ids per request: each hash id -> the same `block_tokens` tokens; length scaled, capped."""
    blocks: dict[int, list[int]] = {}
    out = []
    for req in trace:
        want = min(max(1, round(req.input_length * block_tokens / BLOCK)), max_len)
        ids: list[int] = []
        for h in req.hash_ids:
            if h not in blocks:
                rng = random.Random(h)
                blocks[h] = [rng.randrange(2, vocab) for _ in range(block_tokens)]
            ids.extend(blocks[h])
            if len(ids) >= want:
                break
        out.append(ids[:want])
    return out


async def _replay(addr: str, trace, prompts, args) -> tuple[list[dict], float]:
    from router.client import AsyncRouterClient

    client = AsyncRouterClient(addr, timeout_s=600)
    t0 = time.perf_counter()
    base = trace[0].timestamp_ms

    async def one(req, prompt):
        await asyncio.sleep(max(0.0, (req.timestamp_ms - base) / 1000.0 / args.time_scale - (time.perf_counter() - t0)))
        n_out = max(1, min(args.max_new_tokens, round(req.output_length * args.block_tokens / BLOCK)))
        params = SamplingParams(max_new_tokens=n_out, ignore_eos=True)
        start = time.perf_counter()
        last, first, itls, cached = start, None, [], 0  # last: read only once first is set
        async for ev in client.generate(prompt, params):
            if ev.token_id is None:
                continue
            now = time.perf_counter()
            if first is None:
                first, cached = now - start, ev.cached_tokens
            else:
                itls.append(now - last)
            last = now
        return {"ttft": first, "itls": itls, "cached": cached, "prompt": len(prompt)}

    try:
        rows = await asyncio.gather(*(one(r, p) for r, p in zip(trace, prompts)))
    finally:
        await client.close()
    return rows, time.perf_counter() - t0


def run_policy(policy: str, trace, prompts, args, engine_options: dict) -> dict:
    from engine.loading.load import load_engine
    from router.local_dispatch import LocalDispatcher
    from router.policy import PolicyConfig, RoutingPolicy
    from router.server import RouterServer

    async def main():
        dispatcher = LocalDispatcher(args.workers, lambda: load_engine(args.model, **engine_options, warmup=True))
        server = RouterServer(dispatcher, RoutingPolicy(PolicyConfig(policy)))
        port = await server.start("127.0.0.1", 0)
        try:
            return await _replay(f"127.0.0.1:{port}", trace, prompts, args)
        finally:
            await server.stop(1.0)
            dispatcher.close()

    rows, wall = asyncio.run(main())
    itls = [x for r in rows for x in r["itls"]]
    ttfts = [r["ttft"] for r in rows]
    return {
        "policy": policy,
        "requests": len(rows),
        "hit_rate": sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows)),
        "ttft_p50_ms": 1e3 * pct(ttfts, 0.5),
        "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
        "itl_p50_ms": 1e3 * pct(itls, 0.5),
        "itl_p99_ms": 1e3 * pct(itls, 0.99),
        "req_per_s": len(rows) / wall,
    }


def bench_trace_main(args) -> int:
    from engine.loading.make_model import default_model_dir
    from engine.model.config import ModelConfig

    args.model = args.model or default_model_dir()
    cfg = ModelConfig.from_model_dir(args.model)
    trace = sorted(read(args.trace), key=lambda r: r.timestamp_ms)[: args.num_requests]
    prompts = trace_prompts(trace, args.block_tokens, cfg.vocab_size, cfg.max_position_embeddings - args.max_new_tokens)
    engine_options = {"max_batch_tokens": args.max_batch_tokens, "page_tokens": args.page_tokens}
    results, loads = [], [os.getloadavg()[0]]
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        results.append(run_policy(policy, trace, prompts, args, engine_options))
        loads.append(os.getloadavg()[0])
        print(results[-1], flush=True)
    lines = [
        "## Live trace replay (`dsv4 bench serve --trace`)",
        "",
        f"Command: `dsv4 {' '.join(sys.argv[1:])}`" + (f" (trace: `{args.trace_origin}`)" if args.trace_origin else ""),
        "",
        f"Trace `{os.path.basename(args.trace)}`: first {len(trace)} requests, arrival times / "
        f"{args.time_scale:g}; 512-token blocks scaled to {args.block_tokens} tokens (prompts "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens), outputs <= {args.max_new_tokens} tokens. "
        f"{args.workers} colocated engines (built-in model unless --model; page_tokens {args.page_tokens}, "
        f"prefix cache on) behind the gRPC router, in one process on {platform.machine()} "
        f"{os.cpu_count()} CPUs (1-minute load average {min(loads):.1f}-{max(loads):.1f} during the run: the "
        f"machine is shared, so TTFT/ITL are contention-bound); date {time.strftime('%Y-%m-%d')}. Hit rate = "
        "prompt tokens the engines served from their prefix caches (each request's `cached_tokens`) / "
        "prompt tokens.",
        "",
        "| policy | requests | real hit rate | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | req/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['policy']} | {r['requests']} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['req_per_s']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("service_trace", text)
    return 0


def add_trace_args(parser) -> None:
    """The `--trace` mode's flags on `dsv4 bench serve` (the others there are its closed-loop mode's)."""
    parser.add_argument(
        "--trace", default=None, help="replay this Mooncake-format trace instead (see service/bench_trace.py)"
    )
    parser.add_argument("--policies", default="round_robin,least_loaded,cache_aware")
    parser.add_argument("--workers", type=int, default=2, help="--trace: colocated engines behind the router")
    parser.add_argument("--block-tokens", type=int, default=128, help="--trace: tokens per 512-token trace block")
    parser.add_argument(
        "--page-tokens",
        type=int,
        default=64,
        help="--trace: engine page_tokens (prefix block = lcm with the compress ratios)",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="--trace: divide arrival times by this")
    parser.add_argument("--write", action="store_true", help="--trace: write BENCHMARKS.md section service_trace")
    parser.add_argument("--trace-origin", default="", help="--trace: how the trace was made (recorded in the section)")
