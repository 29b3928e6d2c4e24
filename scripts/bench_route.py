"""Routing policies on Mooncake-format traces through `dsv4 bench route`'s simulator (service/route_sim.py: the
router's real policy code, modelled worker caches and prefill): the generated kinds (service/route_traces.py) and
the public Mooncake FAST'25 synthetic trace when present; cache_aware at 64 workers on each of them (decision time,
load balance): section `route_policies` of BENCHMARKS.md. With --robustness instead, the same on an unseen seed and
at twice the arrival rate: section `route_robustness`.

    .venv/bin/python scripts/bench_route.py [--no-write] [--robustness] [--mooncake PATH] [--jobs N]

Targets, checked from the numbers: at 8 workers cache_aware's hit rate >= 90% of the pooled cache's, max/mean
prefill load <= 1.3, TTFT p99 below round_robin's and least_loaded's; at 64 workers decision p99 <= 0.5 ms CPU
(the prompt's block hashes given as the ingress gives them) and max/mean load <= 1.3.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service import route_traces  # noqa: E402
from service.bench_route import run  # noqa: E402
from service.benchmarks_md import write_section  # noqa: E402
from service.route_sim import ESTIMATE, SimConfig  # noqa: E402

POLICIES = ["round_robin", "least_loaded", "cache_aware", ESTIMATE]
WORKERS, CAPACITY = 8, 4096
WIDE = 64  # workers of the decision-time tables (the same total capacity)
MOONCAKE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces" / "synthetic_trace.jsonl"


def check(res: dict) -> list[str]:
    """The 8-worker targets as findings (empty = all met)."""
    p = res["policies"]
    ca, out = p["cache_aware"], []
    ratio = ca["hit_rate"] / ca["pooled_hit_rate"] if ca["pooled_hit_rate"] else 1.0
    if ratio < 0.9:
        out.append(f"hit rate {ca['hit_rate']:.1%} is {ratio:.0%} of pooled {ca['pooled_hit_rate']:.1%} (< 90%)")
    if ca["load_imbalance"] > 1.3:
        out.append(f"max/mean load {ca['load_imbalance']:.2f} > 1.3")
    for other in ("round_robin", "least_loaded"):
        if ca["ttft_p99_s"] >= p[other]["ttft_p99_s"]:
            out.append(f"TTFT p99 {ca['ttft_p99_s']:.3f} s not below {other}'s {p[other]['ttft_p99_s']:.3f} s")
    return out


def summary_row(name: str, res: dict, behind: bool = False) -> str:
    """behind: a column with cache_aware's `behind_prefill` (the share of prefix-sharing requests that arrived before
    any prefill of their deepest shared block had ended), before the targets."""
    p = res["policies"]
    ca = p["cache_aware"]
    findings = check(res)
    return (
        f"| {name} | {res['requests']} | {ca['hit_rate'] / ca['pooled_hit_rate']:.0%} | {ca['load_imbalance']:.2f} | "
        f"{ca['ttft_p99_s']:.3f} | {p['round_robin']['ttft_p99_s']:.3f} | {p['least_loaded']['ttft_p99_s']:.3f} | "
        f"{ca['decision_us_p99']:.0f} | "
        + (f"{ca['behind_prefill']:.0%} | " if behind else "")
        + f"{'met' if not findings else 'missed: ' + '; '.join(findings)} |"
    )


SUMMARY_HEAD = [
    "| trace | requests | cache_aware hit / pooled | max/mean load | TTFT p99 s | round_robin p99 | "
    "least_loaded p99 | decision p99 us | targets |",
    "|---|---|---|---|---|---|---|---|---|",
]


def policy_table(res: dict) -> list[str]:
    lines = [
        "| policy | hit rate | pooled | max/mean load | TTFT p50 s | TTFT p99 s | decision p50 us | decision p99 us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["policies"].items():
        lines.append(
            f"| {name} | {r['hit_rate']:.1%} | {r['pooled_hit_rate']:.1%} | {r['load_imbalance']:.2f} | "
            f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['decision_us_p50']:.0f} | {r['decision_us_p99']:.0f} |"
        )
    return lines


def section(results: dict, wide: dict, command: str, loads: tuple[float, float]) -> str:
    lines = [
        "## Routing policies on request traces (`dsv4 bench route`)",
        "",
        f"Command: `{command}`. Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, shared with other jobs (1-minute load average {loads[0]:.1f} at the start, "
        f"{loads[1]:.1f} at the end); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Router policy code (router/policy.py, router/locality.py, router/prompt_hashes.py) over a model of {WORKERS} "
        f"workers x {CAPACITY} cached 512-token blocks (LRU), FIFO prefill at {SimConfig.tokens_per_s:.0f} tokens/s + "
        f"{SimConfig.overhead_s * 1000:.0f} ms a request, its cached prefix looked up when its prefill starts (as the "
        "engine does at admission; service/route_sim.py). `cache_aware` routes on the "
        f"workers' published cache digests; `{ESTIMATE}` is the same policy name on the router's own estimate (no "
        "digests: SGLang-style longest-match + thresholds over what it sent where). Traces: `dsv4 bench make-trace "
        "--kind KIND` (seed 0) and `mooncake`, the Mooncake FAST'25 release's synthetic trace "
        "(`../shared/data/traces/synthetic_trace.jsonl`). " + DECISION_TIME,
        "",
        f"### Summary ({WORKERS} workers; targets: hit >= 90% of pooled, max/mean <= 1.3, TTFT p99 below both)",
        "",
        *SUMMARY_HEAD,
        *(summary_row(kind, res) for kind, res in results.items()),
        "",
    ]
    for kind, res in results.items():
        lines += [f"### {kind} ({res['requests']} requests)", "", *policy_table(res), ""]
    return "\n".join(lines + wide_table(wide))


DECISION_TIME = (
    "Decision time = CPU time of one `place` call with the prompt's block hashes given as the ingress gives them "
    "(`router.prompt_hashes.IngressHasher`, in the scheme the router's last answer named: the router only matches "
    "and scores; prompts as tuples, as the router gets them), so other jobs' preemptions do not count, but their "
    "cache and core sharing do. The digests the workers reported since the previous request are indexed before "
    "it, as the router's probe does when reports land (`RoutingPolicy.observe`): that CPU time is the `indexing` "
    "column, not on a request's path."
)


def wide_table(wide: dict) -> list[str]:
    lines = [
        "",
        f"### cache_aware at {WIDE} workers ({CAPACITY * WORKERS // WIDE} blocks a worker, the same total capacity; "
        "targets: decision p99 <= 500 us, max/mean <= 1.3)",
        "",
        "| trace | requests | decision p50 us | decision p99 us | wall p99 us | indexing p99 us | hit / pooled | "
        "max/mean load | level floor | TTFT p99 s | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, res in wide.items():
        ca = res["policies"]["cache_aware"]
        missed = [f"decision p99 {ca['decision_us_p99']:.0f} us > 500"] if ca["decision_us_p99"] > 500 else []
        if ca["load_imbalance"] > 1.3:
            below = " (the level floor is above 1.3 too)" if ca["load_floor"] > 1.3 else ""
            missed.append(f"max/mean {ca['load_imbalance']:.2f} > 1.3{below}")
        lines.append(
            f"| {kind} | {res['requests']} | {ca['decision_us_p50']:.0f} | {ca['decision_us_p99']:.0f} | "
            f"{ca['decision_wall_us_p99']:.0f} | {ca['indexing_us_p99']:.0f} | "
            f"{ca['hit_rate'] / ca['pooled_hit_rate']:.0%} | {ca['load_imbalance']:.2f} | {ca['load_floor']:.2f} | "
            f"{ca['ttft_p99_s']:.3f} | {'met' if not missed else 'missed: ' + '; '.join(missed)} |"
        )
    return lines + ["", LEVEL_FLOOR]


BEHIND = (
    "Behind a prefill: of cache_aware's requests that share a prefix with an earlier request, the share that arrived "
    "before any prefill computing their deepest shared block had ended (`behind_prefill`, service/route_sim.py: a "
    "session's next turn arriving while its previous turn still waits in a saturated pool's queue). A worker's digest "
    "shows only finished prefills, so the digests cannot show those blocks; the model looks a request's hit up when "
    "its prefill starts (the engine looks it up at admission), so such a turn resumes after its previous turn only "
    "on the worker computing it: cache_aware sends it there by counting the blocks it placed and the worker has not "
    "published yet as cached there (router/pending_prefixes.py, per router replica). The pooled reference, blind to "
    "timing, counts every such block as a hit."
)


LEVEL_FLOOR = (
    "Level floor: the largest, over requests, of (the prefill tokens computed per worker before its prefill started + its own "
    "uncached tokens) / the run's final mean per worker (`load_floor`, service/route_sim.py): where the worker that "
    "took it would end had every worker been exactly at the mean then and it taken nothing after. A placement that "
    "keeps the workers level ends at or above it; only a worker that happened to be well below the mean when a huge "
    "prompt came (the policy cannot know one is coming) ends lower, as some runs here do. Where the floor is above "
    "1.3, max/mean <= 1.3 needed such a worker: on heavy_tail (seed 0) an 82K-token document arrives when each worker has "
    "computed ~70K tokens and little work follows, so its worker ends near 1.6-1.8x the final mean."
)


def robustness_section(robust: dict, wide: dict, command: str, loads: tuple[float, float]) -> str:
    return "\n".join(
        [
            "## Routing on unseen traffic: other seeds and twice the arrival rate (`dsv4 bench route`)",
            "",
            f"Command: `{command}`. Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, shared (1-minute load average {loads[0]:.1f} at the start, {loads[1]:.1f} "
            f"at the end); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. The `route_policies` section's "
            f"model ({WORKERS} workers x {CAPACITY} blocks) on every generated kind with seeds the policy was not "
            f"tuned on, and on seed 0 with arrival times halved; then cache_aware on the same traces at {WIDE} workers. "
            + DECISION_TIME,
            "",
            "| trace | requests | cache_aware hit / pooled | max/mean load | TTFT p99 s | round_robin p99 | "
            "least_loaded p99 | decision p99 us | behind a prefill | targets |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *(summary_row(name, res, behind=True) for name, res in robust.items()),
            "",
            BEHIND,
            *wide_table(wide),
        ]
    )


def _job(job: tuple[str, str, str, str, SimConfig]) -> tuple[str, str, dict]:
    table, row, path, policy, cfg = job
    return table, row, run(path, [policy], cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing BENCHMARKS.md")
    ap.add_argument(
        "--robustness",
        action="store_true",
        help="instead: seed 1 and twice the rate, section route_robustness",
    )
    ap.add_argument("--mooncake", default=str(MOONCAKE), help="the Mooncake trace (skipped when absent)")
    ap.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    ap.add_argument("--no-estimate", action="store_true", help=f"leave out {ESTIMATE} (the slowest to simulate)")
    args = ap.parse_args()
    command = f"python scripts/bench_route.py --jobs {args.jobs}" + (" --robustness" if args.robustness else "")
    command += " --no-estimate" if args.no_estimate else ""
    command += f" --mooncake {args.mooncake}" if args.mooncake != str(MOONCAKE) else ""
    loads = os.getloadavg()[0]
    cfg = SimConfig(workers=WORKERS, capacity_blocks=CAPACITY)
    wide_cfg = SimConfig(workers=WIDE, capacity_blocks=WORKERS * CAPACITY // WIDE)
    jobs: list[tuple[str, str, str, str, SimConfig]] = []  # (table, row, path, policy, config)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            k: str(route_traces.write(route_traces.make(k), os.path.join(tmp, f"{k}.jsonl")))
            for k in route_traces.KINDS
        }
        if os.path.exists(args.mooncake):
            paths = {"mooncake": args.mooncake, **paths}
        if not args.robustness:
            policies = POLICIES[:3] if args.no_estimate else POLICIES
            jobs += [("main", kind, path, p, cfg) for kind, path in paths.items() for p in policies]
            jobs += [("wide", kind, path, "cache_aware", wide_cfg) for kind, path in paths.items()]
        else:
            for kind in route_traces.KINDS:
                for seed, scale in ((1, 1.0), (0, 2.0)):
                    path = str(
                        route_traces.write(route_traces.make(kind, seed), os.path.join(tmp, f"{kind}-{seed}.jsonl"))
                    )
                    name = f"{kind} seed {seed}" + (f", {scale:g}x rate" if scale != 1.0 else "")
                    sim = SimConfig(workers=WORKERS, capacity_blocks=CAPACITY, time_scale=scale)
                    jobs += [("robust", name, path, p, sim) for p in POLICIES[:3]]
                    wide_sim = SimConfig(workers=WIDE, capacity_blocks=WORKERS * CAPACITY // WIDE, time_scale=scale)
                    jobs.append(("robust_wide", name, path, "cache_aware", wide_sim))
        jobs.sort(key=lambda j: (not j[1].startswith("long_sessions"), j[1] != "mooncake"))  # the longest runs first
        # One policy of one trace a job, over --jobs processes (the decision time is each call's own CPU time).
        tables: dict[str, dict[str, dict]] = {"main": {}, "wide": {}, "robust": {}, "robust_wide": {}}
        with multiprocessing.Pool(args.jobs) as pool:
            for table, row, res in pool.imap_unordered(_job, jobs):
                got = tables[table].setdefault(row, res)
                got["policies"].update(res["policies"])
                print(table, row, *res["policies"], flush=True)
    order = {(table, row): k for k, (table, row, *_rest) in enumerate(jobs)}
    results, wide, robust, robust_wide = (
        {r: t[r] for r in sorted(t, key=lambda r: order[name, r])} for name, t in tables.items()
    )
    for res in (*results.values(), *robust.values()):
        res["policies"] = {p: res["policies"][p] for p in POLICIES if p in res["policies"]}
    end = os.getloadavg()[0]
    if args.robustness:
        text = robustness_section(robust, robust_wide, command, (loads, end))
        print(text if args.no_write else f"wrote {write_section('route_robustness', text)}")
    else:
        text = section(results, wide, command, (loads, end))
        print(text if args.no_write else f"wrote {write_section('route_policies', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
