"""`dsv4 bench elastic`: elastic pools under a burst, on the real service (local Ray cluster, real workers, the
gRPC router, the PoolManager), with the pool sizes over time.

The requests are a `bursty` route trace's (service/route_traces.py: sessions over shared system prompts; token
ids from its block ids as in service/bench_trace.py), replayed in three phases: a quiet spell at
`--quiet-rate` requests/s, a burst at `--burst-rate`, then nothing while the pools drain back. The PoolManager's
`status` is sampled every `--sample-seconds`; the report is a table of each pool's ready / starting / draining
workers over time, the planner's changes, every request's outcome (a failed request is a failed run: the exit
status is 1), and TTFT / ITL percentiles per phase. `--write` puts the section `elastic_pools` in BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import platform
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from engine.execution.sampling_params import SamplingParams
from service.bench_trace import pct, trace_prompts
from service.planner import PlannerConfig
from service.ray_cluster import free_port


@dataclass(frozen=True)
class BurstPlan:
    quiet_s: float = 4.0  # before the burst, at quiet_rate
    burst_s: float = 20.0
    cool_s: float = 25.0  # after the burst: no requests, the pools drain back
    quiet_rate: float = 1.0  # requests/s
    burst_rate: float = 12.0
    max_new_tokens: int = 48
    block_tokens: int = 16  # tokens of one trace block (512 in the trace)
    max_prompt: int = 192
    sample_s: float = 0.5
    seed: int = 0

    def __post_init__(self):
        for name in ("quiet_s", "burst_s", "cool_s", "quiet_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("burst_rate", "sample_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_new_tokens < 1 or self.block_tokens < 1 or self.max_prompt < 1:
            raise ValueError(f"max_new_tokens, block_tokens and max_prompt must be >= 1, got {self}")

    def arrivals(self) -> list[tuple[float, str]]:
        """(seconds from the start, phase) of every request: Poisson arrivals at each phase's rate."""
        rng, out, t = random.Random(self.seed), [], 0.0
        for phase, length, rate in (("quiet", self.quiet_s, self.quiet_rate), ("burst", self.burst_s, self.burst_rate)):
            end = t + length
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= end:
                    break
                out.append((t, phase))
            t = end
        return out


def bench_prompts(plan: BurstPlan, n: int, vocab: int) -> list[list[int]]:
    from service.route_sim import TraceRequest
    from service.route_traces import make

    rows = make("bursty", seed=plan.seed, size=max(1, n))[:n]
    trace = [
        TraceRequest(
            timestamp_ms=r["timestamp"],
            input_length=r["input_length"],
            output_length=r["output_length"],
            hash_ids=tuple(r["hash_ids"]),
        )
        for r in rows
    ]
    return trace_prompts(trace, plan.block_tokens, vocab, plan.max_prompt)


async def _router_tokens(client, prompt: list[int], n_out: int):
    """The request's tokens through the gRPC router's Generate (the router relays them)."""
    async for ev in client.generate(prompt, SamplingParams(max_new_tokens=n_out, ignore_eos=True)):
        if ev.token_id is not None:
            yield ev.token_id


async def _http_tokens(client, prompt: list[int], n_out: int):
    """The request's tokens through the OpenAI endpoint (official client, streamed: the ingress runs the placement
    and reads the decode worker's stream itself); one count a streamed chunk with text."""
    stream = await client.completions.create(
        model="dsv4", prompt=prompt, max_tokens=n_out, stream=True, extra_body={"ignore_eos": True}
    )
    finish = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            yield chunk.choices[0].text
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    if finish != "length":
        raise RuntimeError(f"the stream ended with finish_reason {finish!r}, not 'length'")


async def replay(
    addr: str, token: str, plan: BurstPlan, prompts: list[list[int]], http: str | None = None
) -> list[dict]:
    """Every request of the plan through the router (or the OpenAI endpoint at `http`); -> one row a request
    (phase, ok or the error, TTFT, ITLs). Over HTTP a request is whole when it ends with finish_reason "length"
    (its detokenised chunks need not be one a token)."""
    from router.client import AsyncRouterClient

    client: Any
    if http:
        import openai

        client = openai.AsyncOpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0, timeout=300)
        tokens_of = _http_tokens
    else:
        client, tokens_of = AsyncRouterClient(addr, timeout_s=300, token=token), _router_tokens
    t0 = time.perf_counter()
    rng = random.Random(plan.seed + 1)

    async def one(at: float, phase: str, prompt: list[int]) -> dict:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        n_out = rng.randint(max(1, plan.max_new_tokens // 2), plan.max_new_tokens)
        start, last, first, itls, tokens = time.perf_counter(), 0.0, None, [], 0
        try:
            async for _ in tokens_of(client, prompt, n_out):
                now, tokens = time.perf_counter(), tokens + 1
                if first is None:
                    first = now - start
                else:
                    itls.append(now - last)
                last = now
        except Exception as e:  # noqa: BLE001 - every failure is reported, and fails the run
            return {"phase": phase, "at": at, "error": f"{type(e).__name__}: {e}"}
        ok = tokens == n_out or (http is not None and tokens > 0)
        return {"phase": phase, "at": at, "ttft": first, "itls": itls, "error": None if ok else f"{tokens}/{n_out}"}

    try:
        arrivals = plan.arrivals()
        return list(await asyncio.gather(*(one(at, ph, p) for (at, ph), p in zip(arrivals, prompts))))
    finally:
        await client.close()


class PoolSampler:
    """Samples the PoolManager's `status` on a thread: (seconds since start, {pool: {state: n}}) rows, and its
    decisions (kept across a restart of the manager, whose history starts empty). kill_when_grown: once a pool
    has a worker the manager added (more ready than its minimum), kill the manager once (Ray restarts it: it must
    take that worker back and still drain it)."""

    def __init__(self, manager, every_s: float, kill_when_grown: dict | None = None):
        self.manager, self.every_s = manager, every_s
        self.rows: list[tuple[float, dict]] = []
        self._decisions: dict[tuple, dict] = {}
        self.kill_when_grown = kill_when_grown  # {pool: its minimum}
        self.killed_at: float | None = None  # seconds since start
        self.killed_wall: float | None = None  # time.time(), the clock of the decisions' "t"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-sampler", daemon=True)
        self.t0, self.t0_wall = time.perf_counter(), time.time()  # the table's zero (decisions carry time.time())

    def start(self) -> PoolSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                status = ray.get(self.manager.status.remote(), timeout=10)
                self.rows.append((time.perf_counter() - self.t0, status["sizes"]))
                self._decisions.update({(d["t"], d["pool"]): d for d in status["decisions"]})
            except Exception:  # noqa: BLE001 - a missed sample is a gap in the table, not a failure
                pass
            self._maybe_kill()
            self._stop.wait(self.every_s)

    def _maybe_kill(self) -> None:
        import ray

        grown = self.kill_when_grown
        if grown is None or self.killed_at is not None or not self.rows:
            return
        if any(self.rows[-1][1][pool]["ready"] > n for pool, n in grown.items()):
            ray.kill(self.manager, no_restart=False)
            self.killed_at, self.killed_wall = time.perf_counter() - self.t0, time.time()

    @property
    def decisions(self) -> list[dict]:
        return [self._decisions[k] for k in sorted(self._decisions)]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)

    def peak(self, pool: str) -> int:
        return max((s[pool]["ready"] for _, s in self.rows), default=0)

    def last(self, pool: str) -> dict:
        return self.rows[-1][1][pool] if self.rows else {}


def run(cfg, plan: BurstPlan, settle_s: float = 0.0, kill_planner: bool = False, http: bool = False) -> dict:
    """Start the service of `cfg` (elastic pools) on the connected Ray cluster, replay the plan, sample the pools,
    wait the cool-down (and up to settle_s more until both pools are back at their minimum); stop the service.
    kill_planner: kill the PoolManager once a pool has grown (Ray restarts it); http: requests through the OpenAI
    endpoint (Ray Serve ingress, the production path) instead of the router's Generate."""
    from engine.model.config import ModelConfig
    from service.launcher import start_service, stop_service

    load_before = os.getloadavg()[0]
    handles = start_service(cfg, http=http)
    try:
        grown = {role: cfg.pool_bounds(role).min for role in ("prefill", "decode")} if kill_planner else None
        sampler = PoolSampler(handles["pools"], plan.sample_s, grown).start()
        arrivals = plan.arrivals()
        prompts = bench_prompts(plan, len(arrivals), ModelConfig.from_model_dir(cfg.model_dir).vocab_size)
        url = handles["http"] if http else None
        rows = asyncio.run(replay(handles["router_addr"], handles["token"], plan, prompts, url))
        replay_end = time.perf_counter() - sampler.t0
        deadline = time.monotonic() + plan.cool_s + settle_s
        floor = {role: cfg.pool_bounds(role).min for role in ("prefill", "decode")}
        while time.monotonic() < deadline:
            at_min = all(sampler.last(r) == {"ready": floor[r], "starting": 0, "draining": 0} for r in floor)
            if at_min and time.monotonic() > deadline - settle_s:
                break
            time.sleep(plan.sample_s)
        sampler.stop()
        result_load = final_load(handles["pools"])
    finally:
        stop_service(handles, drain_s=0, shutdown_ray=False)
    return {
        "rows": rows,
        "samples": sampler.rows,
        "decisions": sampler.decisions,
        "replay_end_s": replay_end,
        "final_load": result_load,
        "loadavg": (load_before, os.getloadavg()[0]),
        "planner_killed_at": sampler.killed_at,
        "planner_killed_wall": sampler.killed_wall,
        "t0_wall": sampler.t0_wall,
        "path": "the OpenAI endpoint (official client, streamed; the ingress reads the decode worker's stream)"
        if http
        else "the gRPC router's Generate",
    }


def final_load(manager) -> dict:
    """{worker id: EngineLoad} of every worker left in the elastic pools (all idle after a clean run)."""
    import ray

    membership = ray.get(manager.membership.remote(), timeout=10)
    stats = ray.get([m.handle.stats.remote() for m in membership.members], timeout=30)
    return {s.worker_id: s.load for s in stats}


def summary(result: dict) -> dict:
    rows = result["rows"]
    out: dict = {"requests": len(rows), "failed": [r for r in rows if r["error"]]}
    for phase in ("quiet", "burst"):
        mine = [r for r in rows if r["phase"] == phase and not r["error"]]
        out[phase] = {
            "requests": len(mine),
            "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in mine], 0.5),
            "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in mine], 0.99),
            "itl_p99_ms": 1e3 * pct([x for r in mine for x in r["itls"]], 0.99),
        }
    return out


def size_table(samples: list[tuple[float, dict]], every_s: float = 2.0) -> list[str]:
    """Markdown rows: one a size change or every `every_s` seconds, whichever comes first."""
    lines = ["| t (s) | prefill ready / starting / draining | decode ready / starting / draining |", "|---|---|---|"]
    last_key, last_t = None, -1e9
    for t, sizes in samples:
        key = tuple(tuple(sizes[p][s] for s in ("ready", "starting", "draining")) for p in ("prefill", "decode"))
        if key != last_key or t - last_t >= every_s:
            cells = [" / ".join(str(n) for n in k) for k in key]
            lines.append(f"| {t:.1f} | {cells[0]} | {cells[1]} |")
            last_key, last_t = key, t
    return lines


def start_times(samples: list[tuple[float, dict]], pool: str) -> list[float]:
    """Seconds each new worker of the pool spent starting (from the decision to grow until it served), from the
    sampled counts (sample precision): a worker joining raises `ready` and lowers `starting`, so the workers that
    began starting are the rise of `starting` plus those that joined; a join closes the oldest open timer."""
    opened: list[float] = []
    out: list[float] = []
    ready = starting = None
    for t, sizes in samples:
        r, s = sizes[pool]["ready"], sizes[pool]["starting"]
        if ready is not None and starting is not None:
            joined = max(0, r - ready)
            began = s - starting + joined
            opened += [t] * max(0, began)
            del opened[: max(0, -began)]  # gave up on (never ready)
            for _ in range(min(joined, len(opened))):
                out.append(t - opened.pop(0))
        ready, starting = r, s
    return out


def report(cfg, plan: BurstPlan, result: dict) -> str:
    s = summary(result)
    changes = [d for d in result["decisions"] if d["current"] != d["desired"]]
    t0 = result["t0_wall"]  # the table's zero: times on one scale
    lines = [
        "## Elastic pools under a burst (`dsv4 bench elastic`)",
        "",
        f"{platform.machine()}, {os.cpu_count()} cores (load average {result['loadavg'][0]:.1f} before, "
        f"{result['loadavg'][1]:.1f} after: other work shared the machine), Python {platform.python_version()}; "
        "tiny random model on the "
        f"CPU, local Ray cluster; pools prefill {cfg.pool_bounds('prefill')}, decode {cfg.pool_bounds('decode')}; "
        f"planner every {cfg.planner.interval_s:g} s, cooldowns up {cfg.planner.up_cooldown_s:g} s / down "
        f"{cfg.planner.down_cooldown_s:g} s; targets: {cfg.planner.prefill_queue_tokens} queued prompt tokens and "
        f"TTFT {cfg.planner.ttft_target_s:g} s per prefill worker, {cfg.planner.decode_streams} streams, KV "
        f"{cfg.planner.kv_target:g} and ITL {cfg.planner.itl_target_s:g} s per decode worker.",
        f"Load: a `bursty` route trace's prompts, {plan.quiet_s:g} s at {plan.quiet_rate:g} req/s, then "
        f"{plan.burst_s:g} s at {plan.burst_rate:g} req/s, then none; up to {plan.max_new_tokens} new tokens each, "
        f"through {result.get('path', 'the router')}. "
        f"Requests: {s['requests']}, failed: {len(s['failed'])}.",
        "",
        "| phase | requests | TTFT p50 (ms) | TTFT p99 (ms) | ITL p99 (ms) |",
        "|---|---|---|---|---|",
        *[
            f"| {p} | {s[p]['requests']} | {s[p]['ttft_p50_ms']:.0f} | {s[p]['ttft_p99_ms']:.0f} | "
            f"{s[p]['itl_p99_ms']:.0f} |"
            for p in ("quiet", "burst")
        ],
        "",
        f"Pool sizes over time (the replay ended at {result['replay_end_s']:.1f} s"
        + (
            f"; the PoolManager was killed at {result['planner_killed_at']:.1f} s and restarted by Ray"
            if result.get("planner_killed_at") is not None
            else ""
        )
        + "):",
        "",
        *size_table(result["samples"]),
        "",
        "Time from a decision to grow until the new worker served (loading and warming up the model): "
        + "; ".join(
            f"{pool} " + ", ".join(f"{x:.1f} s" for x in start_times(result["samples"], pool))
            for pool in ("prefill", "decode")
        )
        + ". On one CPU machine every worker shares the same cores, so a bigger pool adds no compute here: the run "
        "shows the mechanics (growth on measured pressure, a worker placed on only once ready, drain and removal, "
        "no failed request), not capacity.",
        "",
        "Planner changes:",
        "",
        *[
            f"- {d['t'] - t0:.1f} s: {d['pool']} {d['current']} -> {d['desired']} ({d['reason']}, pressure "
            f"{d['pressure']:.2f})"
            for d in changes
        ],
    ]
    return "\n".join(lines) + "\n"


def bench_config(args, model_dir: str):
    from dsv4_kernels.settings import settings
    from service.service_config import ServiceConfig

    planner = dataclasses.replace(
        PlannerConfig(),
        interval_s=args.planner_interval_seconds,
        prefill_queue_tokens=args.prefill_queue_tokens,
        ttft_target_s=args.ttft_target_seconds,
        decode_streams=args.decode_streams,
        up_after=1,
        down_after=2,
        up_cooldown_s=args.scale_up_cooldown_seconds,
        down_cooldown_s=args.scale_down_cooldown_seconds,
        min_samples=2,
    )
    return ServiceConfig(
        model_dir=model_dir,
        port=free_port(),  # the OpenAI endpoint's (--http)
        metrics_port=free_port(),
        prefill_workers=args.prefill_workers.min,
        prefill_max_workers=args.prefill_workers.max,
        decode_workers=args.decode_workers.min,
        decode_max_workers=args.decode_workers.max,
        planner=planner,
        drain_timeout_s=args.drain_timeout_seconds,
        transfer=args.transfer or settings().test_transfer,
        worker_num_cpus=0.1,
        ready_timeout_s=300.0,
        engine_options=(("max_batch_tokens", 256),),
    )


def bench_elastic_main(args) -> int:
    from engine.loading.make_model import default_model_dir
    from service.benchmarks_md import write_section
    from service.launcher import init_ray, prepare_metrics_dir, remove_metrics_dir

    plan = BurstPlan(
        quiet_s=args.quiet_seconds,
        burst_s=args.burst_seconds,
        cool_s=args.cool_seconds,
        quiet_rate=args.quiet_rate,
        burst_rate=args.burst_rate,
        max_new_tokens=args.max_new_tokens,
    )
    cfg = bench_config(args, args.model or default_model_dir())
    import ray

    init_ray(prepare_metrics_dir())
    try:
        result = run(cfg, plan, kill_planner=args.kill_planner, http=args.http)
    finally:
        ray.shutdown()
        remove_metrics_dir()
    text = report(cfg, plan, result)
    print(text)
    for r in summary(result)["failed"]:
        print(f"FAILED at {r['at']:.1f} s ({r['phase']}): {r['error']}", file=sys.stderr)
    if args.write:
        print(f"wrote {write_section('elastic_pools', text)}")
    return 1 if summary(result)["failed"] else 0


def add_bench_elastic_args(parser) -> None:
    from service.serve_args import pool_spec_type

    parser.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    parser.add_argument("--prefill-workers", type=pool_spec_type("--prefill-workers"), default="1:2")
    parser.add_argument("--decode-workers", type=pool_spec_type("--decode-workers"), default="1:3")
    parser.add_argument("--transfer", default=None, help="KV transfer backend (default: tcp on the CPU)")
    parser.add_argument("--quiet-seconds", type=float, default=BurstPlan.quiet_s)
    parser.add_argument("--burst-seconds", type=float, default=BurstPlan.burst_s)
    parser.add_argument("--cool-seconds", type=float, default=BurstPlan.cool_s)
    parser.add_argument("--quiet-rate", type=float, default=BurstPlan.quiet_rate, help="requests/s before the burst")
    parser.add_argument("--burst-rate", type=float, default=BurstPlan.burst_rate, help="requests/s in the burst")
    parser.add_argument("--max-new-tokens", type=int, default=BurstPlan.max_new_tokens)
    parser.add_argument("--planner-interval-seconds", type=float, default=0.5)
    parser.add_argument("--prefill-queue-tokens", type=int, default=256)
    parser.add_argument("--ttft-target-seconds", type=float, default=0.25)
    parser.add_argument("--decode-streams", type=int, default=4)
    parser.add_argument("--scale-up-cooldown-seconds", type=float, default=2.0)
    parser.add_argument("--scale-down-cooldown-seconds", type=float, default=5.0)
    parser.add_argument("--drain-timeout-seconds", type=float, default=30.0)
    parser.add_argument(
        "--http",
        action="store_true",
        help="send the requests to the OpenAI endpoint (official client, streamed) instead of the router's Generate",
    )
    parser.add_argument(
        "--kill-planner", action="store_true", help="kill the PoolManager once a pool has grown (Ray restarts it)"
    )
    parser.add_argument("--write", action="store_true", help="put the section elastic_pools in BENCHMARKS.md")
