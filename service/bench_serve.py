"""`dsv4 bench serve`: N concurrent clients, a fixed request count, one table per topology.

Runs 1P1D, 2P2D (Ray actors, real KV transfer) and a colocated single engine (no transfer) in one run
(`--topologies` picks), each behind the same gRPC router, and reports TTFT p50/p99, inter-token latency
p50/p99, requests/s, output tokens/s and KV transfer GB/s. Writes the table to BENCHMARKS.md (section
`service`) unless `--no-write`; `--json-out` saves the rows. `--check-tokens N` also sends N of the prompts
one at a time (greedy) to every topology and compares each one's tokens with the colocated engine's.
On CUDA (`--device cuda`) `--worker-num-gpus 0.5` puts a prefill and a decode worker on one GPU.
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

from engine.execution.sampling_params import SamplingParams
from kv_transfer.registry import TRANSFER_CHOICES, TRANSFER_HELP
from service.benchmarks_md import write_section


@dataclass(frozen=True)
class RequestTiming:
    ttft: float
    itls: tuple
    tokens: int
    e2e: float
    index: int = -1  # position of the prompt in the list driven
    token_ids: tuple = ()


def pct(values, q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def drive(
    addr: str, prompts: list[list[int]], params: SamplingParams, concurrency: int, token: str | None = None
):
    from router.client import AsyncRouterClient

    client = AsyncRouterClient(addr, timeout_s=600, token=token)
    queue = list(enumerate(prompts))
    timings: list[RequestTiming] = []

    async def worker():
        while queue:
            index, prompt = queue.pop()
            start = time.perf_counter()
            last, first, itls, ids = start, None, [], []  # last: read only once first is set
            async for ev in client.generate(prompt, params):
                if ev.token_id is None:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    itls.append(now - last)
                last = now
                ids.append(ev.token_id)
            if first is None:  # max_new_tokens >= 1 with ignore_eos: every request streams a token
                raise RuntimeError(f"request {index} streamed no token")
            timings.append(RequestTiming(first, tuple(itls), len(ids), time.perf_counter() - start, index, tuple(ids)))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, time.perf_counter() - t0


def summarize(name: str, timings: list[RequestTiming], wall: float, transfer: dict | None) -> dict:
    itls = [x for t in timings for x in t.itls]

    def rate(key: str) -> float:  # GB/s over one of the decode workers' time totals (DecodeWorker.transfer_totals)
        return transfer["bytes"] / transfer[key] / 1e9 if transfer and transfer.get(key) else float("nan")

    def per_pull_ms(key: str) -> float:  # mean milliseconds a pull spent in one of those totals
        return 1e3 * transfer[key] / transfer["count"] if transfer and transfer.get("count") else float("nan")

    gbps = rate("seconds")
    return {
        "topology": name,
        "requests": len(timings),
        "ttft_p50_ms": 1e3 * pct([t.ttft for t in timings], 0.5),
        "ttft_p99_ms": 1e3 * pct([t.ttft for t in timings], 0.99),
        "itl_p50_ms": 1e3 * pct(itls, 0.5),
        "itl_p99_ms": 1e3 * pct(itls, 0.99),
        "req_per_s": len(timings) / wall,
        "tok_per_s": sum(t.tokens for t in timings) / wall,
        "kv_gb_per_s": gbps,
        "kv_mb": (transfer or {}).get("bytes", 0) / 1e6,
        "kv_transfers": (transfer or {}).get("count", 0),
        "kv_pull_gb_per_s": rate("pull_seconds"),
        "kv_wire_gb_per_s": rate("wire_seconds"),
        "kv_ms_per_pull": {k: per_pull_ms(k) for k in TRANSFER_KEYS if k not in ("bytes", "count")},
    }


# A decode worker's transfer_totals summed over a timed run (decode_worker.worker: what each part measures).
TRANSFER_KEYS = (
    "bytes",
    "count",
    "seconds",
    "pull_seconds",
    "wire_seconds",
    "scatter_seconds",
    "plan_seconds",
    "staging_wait_seconds",
    "pull_cpu_seconds",
    "scatter_index_seconds",
    "scatter_views_seconds",
    "scatter_copies_seconds",
    "scatter_record_seconds",
    "scatter_cpu_seconds",
    "join_seconds",
    "scatters_on_engine",
)


def tokens_by_prompt(timings: list[RequestTiming]) -> list[tuple]:
    """The generated token ids in prompt order."""
    return [t.token_ids for t in sorted(timings, key=lambda t: t.index)]


def compare_tokens(name: str, got: list[tuple], ref: list[tuple]) -> dict:
    """How many requests generated exactly the reference's tokens; the first differing (request, position)."""
    same = sum(a == b for a, b in zip(got, ref))
    first = next(
        (
            (i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
            for i, (a, b) in enumerate(zip(got, ref))
            if a != b
        ),
        None,
    )
    return {"topology": name, "requests": len(ref), "identical": same, "first_difference": first}


def run_ray_topology(cfg_kwargs: dict, prompts, params, concurrency, check_prompts=()) -> tuple:
    """-> (timings, wall seconds, transfer totals of the timed run, token ids of check_prompts sent one at a time)."""
    import ray

    from service.launcher import ServiceConfig, start_service, stop_service

    cfg = ServiceConfig(**cfg_kwargs)
    handles = start_service(cfg, http=False)
    try:
        asyncio.run(drive(handles["router_addr"], prompts[:4], params, 4, handles["token"]))  # warm-up
        base = ray.get([d.transfer_summary.remote() for d in handles["decode"].values()])
        timings, wall = asyncio.run(drive(handles["router_addr"], prompts, params, concurrency, handles["token"]))
        after = ray.get([d.transfer_summary.remote() for d in handles["decode"].values()])
        transfer = {k: sum(a.get(k, 0) - b.get(k, 0) for a, b in zip(after, base)) for k in TRANSFER_KEYS}
        checked = (
            tokens_by_prompt(
                asyncio.run(drive(handles["router_addr"], list(check_prompts), params, 1, handles["token"]))[0]
            )
            if check_prompts
            else []
        )
    finally:
        stop_service(handles, drain_s=0, shutdown_ray=False)  # also frees multi-rank workers' placement groups
    return timings, wall, transfer, checked


def run_colocated(model_dir: str, engine_options: dict, prompts, params, concurrency, check_prompts=()) -> tuple:
    from engine.loading.load import load_engine
    from router.local_dispatch import LocalDispatcher
    from router.server import RouterServer

    async def main():
        dispatcher = LocalDispatcher(1, lambda: load_engine(model_dir, **engine_options, warmup=True))
        server = RouterServer(dispatcher)
        port = await server.start("127.0.0.1", 0)
        try:
            await drive(f"127.0.0.1:{port}", prompts[:4], params, 4)
            timed = await drive(f"127.0.0.1:{port}", prompts, params, concurrency)
            checked = (await drive(f"127.0.0.1:{port}", list(check_prompts), params, 1))[0] if check_prompts else []
            return timed, tokens_by_prompt(checked)
        finally:
            await server.stop(1.0)
            dispatcher.close()

    (timings, wall), checked = asyncio.run(main())
    return timings, wall, None, checked


def write_markdown(rows: list[dict], command: str, header: str) -> str:
    lines = [
        "## Service",
        "",
        f"Command: `{command}`",
        "",
        header,
        "",
        "| topology | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | req/s | tok/s "
        "| KV GB/s | KV MB moved |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['topology']} | {r['requests']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
            f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | "
            f"{r['kv_gb_per_s']:.3f} | {r['kv_mb']:.1f} |"
        )
    return "\n".join(lines) + "\n"


TOPOLOGIES = {"1P1D": (1, 1), "2P2D": (2, 2), "colocated": None}


def parse_topologies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TOPOLOGIES]
    if bad or not names:
        raise ValueError(f"--topologies: unknown {bad or text!r}; choose from {', '.join(TOPOLOGIES)}")
    return names


def _engine_options(args: argparse.Namespace) -> dict:
    opts = {
        "max_batch_tokens": args.max_batch_tokens,
        "device": args.device,
        "dtype": args.dtype,
        "max_cached_tokens": args.max_cached_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    return {k: v for k, v in opts.items() if v is not None}


def bench_serve_main(args: argparse.Namespace) -> int:
    if getattr(args, "trace", None):
        from service.bench_trace import bench_trace_main

        return bench_trace_main(args)
    from engine.loading.make_model import default_model_dir
    from engine.model.config import ModelConfig
    from service.launcher import init_ray, prepare_metrics_dir

    topologies = parse_topologies(args.topologies)
    model_dir = args.model or default_model_dir()
    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(2, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.num_requests)
    ]
    # Fresh prompts for the token check, none of them served before: a prefix-cache hit would resume from pages a
    # batched prefill wrote, and on a GPU bf16 results depend on the batch a row ran in (the check would then
    # compare two batch histories, not the two topologies).
    check_rng = random.Random(1)
    check_prompts = [
        [check_rng.randrange(2, vocab) for _ in range(check_rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.check_tokens)
    ]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engine_options = _engine_options(args)
    if any(TOPOLOGIES[t] for t in topologies):
        init_ray(prepare_metrics_dir())
    rows, checked, failures = [], {}, []
    for name in topologies:
        try:
            topology = TOPOLOGIES[name]
            if topology is None:
                timings, wall, transfer, checked[name] = run_colocated(
                    model_dir, engine_options, prompts, params, args.concurrency, check_prompts
                )
                rows.append(summarize("colocated 1 engine", timings, wall, None))
            else:
                p, d = topology
                timings, wall, transfer, checked[name] = run_ray_topology(
                    dict(
                        model_dir=model_dir,
                        prefill_workers=p,
                        decode_workers=d,
                        transfer=args.transfer,
                        engine_options=tuple(engine_options.items()),
                        worker_num_cpus=0.1,
                        worker_num_gpus=args.worker_num_gpus,
                    ),
                    prompts,
                    params,
                    args.concurrency,
                    check_prompts,
                )
                rows.append(summarize(f"{name} ({args.transfer})", timings, wall, transfer))
        except Exception as e:  # noqa: BLE001 - the other topologies still run; reported and exit status 1
            import traceback

            traceback.print_exc()
            failures.append({"topology": name, "error": f"{type(e).__name__}: {str(e).strip()[:3000]}"})
            print(f"{name} failed: {failures[-1]['error']}", flush=True)
            continue
        print(rows[-1], flush=True)
    tokens = (
        [compare_tokens(n, checked[n], checked["colocated"]) for n in topologies if n != "colocated"]
        if check_prompts and "colocated" in checked
        else []
    )
    for t in tokens:
        print(
            f"tokens {t['topology']} vs colocated: {t['identical']}/{t['requests']} identical"
            + (f", first difference at (request, position) {t['first_difference']}" if t["first_difference"] else ""),
            flush=True,
        )
    header = (
        f"Machine: {platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}, device "
        f"{args.device or 'cpu'}; model {os.path.basename(model_dir.rstrip('/'))}; {args.num_requests} requests, "
        f"{args.concurrency} clients, prompts {args.min_prompt}-{args.max_prompt} tokens, {args.max_new_tokens} "
        f"new tokens; date {time.strftime('%Y-%m-%d')}. Anchor: the colocated single engine."
    )
    section = write_markdown(rows, "dsv4 bench serve " + " ".join(sys.argv[3:]), header)
    print(section)
    if failures and not args.json_out:
        raise RuntimeError("; ".join(f"{f['topology']}: {f['error']}" for f in failures))
    if args.json_out:
        import json

        with open(args.json_out, "w") as fh:
            json.dump(
                {
                    "rows": rows,
                    "tokens": tokens,
                    "failures": failures,
                    "header": header,
                    "model": model_dir,
                    "engine_options": engine_options,
                    "worker_num_gpus": args.worker_num_gpus,
                    "transfer": args.transfer,
                    "check_prompts": len(check_prompts),
                    "max_new_tokens": args.max_new_tokens,
                },
                fh,
                indent=1,
            )
    if not args.no_write:
        write_section("service", section)
    return 0 if not failures and all(t["identical"] == t["requests"] for t in tokens) else 1


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--transfer", default="auto", choices=TRANSFER_CHOICES, help=TRANSFER_HELP)
    parser.add_argument(
        "--topologies", default="1P1D,2P2D,colocated", help="comma-separated, run in this order: 1P1D, 2P2D, colocated"
    )
    parser.add_argument("--device", default=None, help="the engines' device (default cpu)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--max-cached-tokens", type=int, default=None, help="KV pool of every engine, in tokens")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument(
        "--worker-num-gpus",
        type=float,
        default=None,
        help="GPUs each Ray worker reserves on cuda (0.5: prefill and decode share one GPU)",
    )
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=0,
        metavar="N",
        help="also send N fresh prompts (not among the benchmark's) one at a time to each topology "
        "and compare their greedy tokens with the colocated engine's (exit 1 when any differs)",
    )
    parser.add_argument("--json-out", default=None, help="write the rows and the token comparison as JSON here")
    parser.add_argument("--no-write", action="store_true", help="do not write BENCHMARKS.md")
    from service.bench_trace import add_trace_args

    add_trace_args(parser)
