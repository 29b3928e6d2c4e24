"""`dsv4 bench kernels moe --gemv-sweep`: launch configurations of the MXFP4 GEMV (dsv4_kernels.triton_mxfp4_gemv
.GemvConfig) at the bench's shapes and token counts (V4-Flash: hidden 4096, moe_inter 2048, 256 experts top-6),
each the whole `gemv_moe` call's CUDA-graph device time after an L2 flush (benchmarks.timing.bench_graph).

Staged, so that one GPU call of ~2 minutes finds the fastest (Triton compiles two GEMV variants a config, ~0.3-1 s
each: the gate|up GEMV's X_DIV = top-k and the down GEMV's X_DIV = 1 specialise apart; a token count reuses them):
- A: block_sr x kc x num_warps at the default stages and split-K target, pruned to 4..16 fp32 elements a thread
  per accumulator (8 * block_sr * kc / num_warps): fewer cannot fill a 16-byte load a row; more hit registers
  (offline sm_90 compiles with Triton 3.9: at 32 8 of 10 sat at the 255-register cap and 2 spilled, at 64 all
  spilled; up to 16 none reached 170 registers);
- B: split-K targets around each token count's three fastest (`target_programs` is a launch argument: no compile);
- C: num_stages 1 and 4 on each token count's fastest (Triton 3.9 emitted the same PTX for stages 1-4 at sm_90: the
  loop has no dot to pipeline; this checks that on the device);
- then the finalists (three a token count and the default) are timed again; a config's time is its fastest run.
Every config's output is checked against the default config's on the same inputs (norm-relative error <= TOL:
only fp32 summation orders differ, then bf16 roundings); one that differs or fails is flagged and never picked.
Stages stop starting configs at fractions of --gemv-budget-s, so a cut run still ranks what it timed.

Output: progress lines, a markdown table per token count sorted by time (top rows printed, all in --gemv-out), the
triton_kernels (ogs_moe) graph time beside for reference (timed last, its compiles outside the budget; the
tables and JSON are printed and written once before it, then again with it), and one JSON line `GEMV_BEST {...}` (also written to
--gemv-best-out): per token count the fastest config, its time and the default's, and under "overall" the one
config with the least summed time over the token counts relative to each count's fastest (a single default).
Adopt one with `DEFAULT_CONFIG = GemvConfig(**best["overall"]["config"])` in dsv4_kernels/triton_mxfp4_gemv.py.

CPU smoke (Triton interpreter, a three-config grid, wall-clock medians): TRITON_INTERPRET=1 dsv4 bench kernels moe
--device cpu --hidden 64 --inter 32 --experts 8 --topk 2 --tokens 1 2 --gemv-sweep
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.timing import bench, try_bench_graph
from dsv4_kernels import moe as ref
from dsv4_kernels import triton_mxfp4_gemv as G

TOL = 2e-2  # |out - default| / |default|: a layout or indexing bug gives O(1); bf16 rounding flips < 4e-3
TARGETS = (256, 512, 2048, 4096)  # stage B's split-K targets (the default is 1024)
STAGES = (1, 4)  # stage C's num_stages (the default is 3)
TOP = 3  # per token count: stage B's bases and the re-timed finalists
SHARE = {"A": 0.55, "B": 0.78, "C": 0.88, "confirm": 0.97}  # a stage starts no config past this share of the budget
LIMIT = 10.0  # the SwiGLU clamp, as the bench's other rows


def stage_a(cuda: bool) -> list[G.GemvConfig]:
    """The default, then block_sr x kc x num_warps with 4..16 elements a thread (module docstring)."""
    d = G.DEFAULT_CONFIG
    if not cuda:  # interpreter smoke: num_warps means nothing there, the tiles still do
        return [d, G.GemvConfig(block_sr=1, kc=1, num_warps=2), G.GemvConfig(block_sr=4, kc=4, num_warps=8)]
    grid = [d]
    for bsr, kc, w in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (2, 4, 8, 16)):
        c = dataclasses.replace(d, block_sr=bsr, kc=kc, num_warps=w)
        if 4 <= 8 * bsr * kc / w <= 16 and c != d:
            grid.append(c)
    # Larger tiles first (more bytes in flight a program, the likelier gain): a budget cut drops the smallest.
    return [d] + sorted(grid[1:], key=lambda c: (-c.block_sr * c.kc, c.num_warps, c.block_sr))


def label(c: G.GemvConfig) -> str:
    return f"sr{c.block_sr} kc{c.kc} w{c.num_warps} st{c.num_stages} tp{c.target_programs}"


@dataclasses.dataclass
class Case:
    """One token count's inputs: x [T, H] bf16, weights / ids [T, k] from the bench's router, the default's out."""

    t: int
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    nbytes: float  # the distinct routed experts' MXFP4 bytes (3 matrices)
    want: torch.Tensor | None = None


class Sweep:
    def __init__(self, cases: list[Case], ex: G.GemvExperts, copy: float, cuda: bool, budget_s: float):
        self.cases, self.ex, self.copy, self.cuda = cases, ex, copy, cuda
        self.t0, self.budget = time.monotonic(), budget_s
        self.us: dict[tuple[G.GemvConfig, int], list[float]] = {}
        self.err: dict[tuple[G.GemvConfig, int], float] = {}
        self.bad: dict[G.GemvConfig, str] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over(self, stage: str) -> bool:
        return self.elapsed() > SHARE[stage] * self.budget

    def _time(self, fn, reps: int) -> float | None:
        return try_bench_graph(fn, reps) if self.cuda else bench(fn, "cpu")

    def run(self, cfg: G.GemvConfig, tag: str, cases: list[Case] | None = None, reps: int = 10) -> None:
        """Check and time cfg at each case (the first call compiles); a failure or mismatch flags cfg."""
        if cfg in self.bad:
            return
        parts = []
        for c in cases or self.cases:
            fn = lambda c=c: G.gemv_moe(c.x, c.weights, c.ids, self.ex, LIMIT, config=cfg)  # noqa: E731
            try:
                out = fn()
                if c.want is None:  # the default config, first: every other config is held to its output
                    c.want = out.clone()
                err = float((out.float() - c.want.float()).norm() / c.want.float().norm().clamp_min(1e-30))
                if not math.isfinite(err) or err > TOL:
                    self.bad[cfg] = f"output differs from the default's at {c.t} tokens: rel err {err:.1e}"
                    break
                us = self._time(fn, reps)
            except Exception as exc:  # noqa: BLE001 - a config that cannot compile or run: flag it, go on
                self.bad[cfg] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                break
            if us is None:
                self.bad[cfg] = "graph capture failed"
                break
            self.us.setdefault((cfg, c.t), []).append(us)
            self.err[(cfg, c.t)] = err
            parts.append(f"t{c.t} {us:7.1f} us ({self.pct(c, us):3.0f}%)")
        msg = self.bad.get(cfg, "  ".join(parts))
        print(f"[{self.elapsed():6.1f}s] {tag:<8} {label(cfg):<28} {msg}", flush=True)

    def pct(self, c: Case, us: float) -> float:
        return 100 * c.nbytes / us / 1e3 / self.copy

    def time_of(self, cfg: G.GemvConfig, t: int) -> float | None:
        xs = self.us.get((cfg, t))
        return min(xs) if xs and cfg not in self.bad else None

    def ranked(self, t: int) -> list[tuple[float, G.GemvConfig]]:
        seen = {cfg for cfg, tt in self.us if tt == t}
        timed = ((self.time_of(c, t), c) for c in seen if self.time_of(c, t) is not None)
        return sorted(timed, key=lambda r: (r[0], label(r[1])))  # ties by label: configs do not order

    def search(self) -> None:
        grid = stage_a(self.cuda)
        print(f"stage A: {len(grid)} configs (block_sr x kc x num_warps), budget {self.budget:.0f} s", flush=True)
        for i, cfg in enumerate(grid):
            if i and self.over("A"):
                print(f"stage A cut at {i}/{len(grid)} by the budget", flush=True)
                break
            self.run(cfg, f"A {i + 1}/{len(grid)}")
        targets = TARGETS if self.cuda else (64,)
        bases = dict.fromkeys(cfg for c in self.cases for _, cfg in self.ranked(c.t)[:TOP])
        self.variants((dataclasses.replace(b, target_programs=tp) for b in bases for tp in targets), "B", "split")
        stages = STAGES if self.cuda else (1,)
        bests = dict.fromkeys(r[0][1] for c in self.cases if (r := self.ranked(c.t)))
        self.variants((dataclasses.replace(b, num_stages=s) for b in bests for s in stages), "C", "stages")
        for c in self.cases:  # the finalists again (the noise of one graph timing), one token count each
            for cfg in dict.fromkeys([G.DEFAULT_CONFIG] + [cfg for _, cfg in self.ranked(c.t)[:TOP]]):
                if self.over("confirm"):
                    break
                self.run(cfg, "confirm", [c], reps=20)

    def variants(self, configs, stage: str, what: str) -> None:
        """Time each config not timed yet (stages B and C: one knob varied around the best), within the budget."""
        for cfg in configs:
            if self.over(stage):
                print(f"stage {stage} cut by the budget", flush=True)
                break
            if not any((cfg, c.t) in self.us for c in self.cases):
                self.run(cfg, f"{stage} {what}")

    def splits(self, cfg: G.GemvConfig, t: int, k: int) -> str:
        ex = self.ex
        return f"{G.splits_for(2 * ex.inter, ex.hidden, t * k, cfg)}/{G.splits_for(ex.hidden, ex.inter, t * k, cfg)}"

    def table(self, c: Case, k: int, ogs_us: float | None, rows: int | None = None) -> list[str]:
        base = self.time_of(G.DEFAULT_CONFIG, c.t)
        head = [
            f"### {c.t} token(s): {c.nbytes / 1e6:.1f} MB of experts; default {label(G.DEFAULT_CONFIG)} "
            + (f"{base:.1f} us" if base else "n/a")
            + (f"; triton_kernels ogs_moe {ogs_us:.1f} us ({self.pct(c, ogs_us):.0f}%)" if ogs_us else ""),
            "",
            "| block_sr | kc | warps | stages | target | splits 13/2 | graph us | GB/s | % copy | vs default | err |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        body = []
        for us, cfg in self.ranked(c.t)[:rows]:
            vs = f"{base / us:.2f}x" if base else "n/a"
            body.append(
                f"| {cfg.block_sr} | {cfg.kc} | {cfg.num_warps} | {cfg.num_stages} | {cfg.target_programs} | "
                f"{self.splits(cfg, c.t, k)} | {us:.1f} | {c.nbytes / us / 1e3:.0f} | {self.pct(c, us):.0f}% | {vs} | "
                f"{self.err[(cfg, c.t)]:.1e} |"
            )
        return head + body

    def best(self, ogs: dict[int, float | None]) -> dict:
        out = {}
        for c in self.cases:
            r = self.ranked(c.t)
            if r:
                us, cfg = r[0]
                out[str(c.t)] = {
                    "config": dataclasses.asdict(cfg),
                    "us": round(us, 2),
                    "pct_copy": round(self.pct(c, us), 1),
                    "default_us": _round(self.time_of(G.DEFAULT_CONFIG, c.t)),
                    "ogs_us": _round(ogs.get(c.t)),
                }
        # One config for every token count: the least sum of time / that count's fastest, over configs timed at all.
        fastest = {c.t: self.ranked(c.t)[0][0] for c in self.cases if self.ranked(c.t)}
        scored = []
        for cfg in {cfg for cfg, _ in self.us}:
            ts = [self.time_of(cfg, t) for t in fastest]
            if fastest and all(ts):
                scored.append((sum(u / fastest[t] for u, t in zip(ts, fastest, strict=True)) / len(ts), cfg, ts))
        if scored:
            score, cfg, ts = min(scored, key=lambda s: s[0])
            out["overall"] = {
                "config": dataclasses.asdict(cfg),
                "us": {str(t): round(u, 2) for t, u in zip(fastest, ts, strict=True)},
                "mean_over_fastest": round(score, 3),
            }
        return out


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def main(args, packed: dict, gate: torch.Tensor, bias: torch.Tensor, copy: float, device_name: str) -> int:
    """Run the sweep for args.tokens on args.device; print and write (args.gemv_out, args.gemv_best_out)."""
    dev, cuda = args.device, args.device == "cuda"
    from dsv4_kernels.gpu import has_triton_kernels, why_not

    ogs = None
    if cuda and has_triton_kernels():  # the engine's case: views of triton_kernels' storage
        from dsv4_kernels import mxfp4_ogs

        ogs = mxfp4_ogs.prepare(packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"], packed["s3"])
        ex = G.from_ogs(ogs)
    else:  # the same layouts from the torch swizzles
        if cuda:
            print(f"(no triton_kernels: {why_not('triton_kernels.matmul')}; torch swizzles, no ogs reference)")
        ex = G.from_checkpoint(*(packed[n] for n in ("w1", "s1", "w2", "s2", "w3", "s3")))
    cases = []
    for t in args.tokens:
        if t * args.topk > G.MAX_ROUTES:
            print(f"({t} tokens: over the GEMV's {G.MAX_ROUTES} routes, skipped)")
            continue
        gen = torch.Generator(device=dev).manual_seed(t)  # the inputs run_tokens makes at t tokens
        x = torch.randn(t, args.hidden, device=dev, generator=gen).to(torch.bfloat16)
        weights, ids = ref.route(x, gate, args.topk, 1.5, bias=bias)
        nbytes = int(ids.unique().numel()) * 3 * args.inter * args.hidden * (0.5 + 1 / 32)
        cases.append(Case(t, x, weights, ids, nbytes))
    sweep = Sweep(cases, ex, copy, cuda, args.gemv_budget_s)
    sweep.search()
    best = report(sweep, args, {}, copy, device_name, tables=True)  # before the reference: a timeout keeps this
    if ogs is not None and not args.gemv_no_ogs:  # last: its compiles must not eat the sweep's budget
        from dsv4_kernels import mxfp4_ogs

        ogs_us: dict[int, float | None] = {}
        for c in cases:
            ogs_us[c.t] = us = try_bench_graph(lambda c=c: mxfp4_ogs.ogs_moe(c.x, c.weights, c.ids, ogs, LIMIT))
            gemv = best.get(str(c.t), {}).get("us")
            print(
                f"[{sweep.elapsed():6.1f}s] triton_kernels ogs_moe t{c.t}: "
                + (f"{us:.1f} us ({sweep.pct(c, us):.0f}%)" if us else "n/a")
                + (f"; best gemv {gemv:.1f} us" if gemv else ""),
                flush=True,
            )
        best = report(sweep, args, ogs_us, copy, device_name, tables=False)
    return 0 if best else 1


def report(sweep: Sweep, args, ogs_us: dict, copy: float, device_name: str, tables: bool) -> dict:
    """Print (the top rows if `tables`) and write the tables and the GEMV_BEST line -> the best dict."""
    full, short = [], []
    for c in sweep.cases:
        full += sweep.table(c, args.topk, ogs_us.get(c.t)) + [""]
        short += sweep.table(c, args.topk, ogs_us.get(c.t), rows=12) + [""]
    flagged = [f"- {label(cfg)}: {why}" for cfg, why in sweep.bad.items()]
    if flagged:
        full += ["flagged (never picked):", *flagged, ""]
    if tables:
        print("\n" + "\n".join(short + (["flagged (never picked):", *flagged] if flagged else [])))
    best = sweep.best(ogs_us)
    line = json.dumps(best, separators=(",", ":"))
    print(f"GEMV_BEST {line}", flush=True)
    header = [
        f"## MXFP4 GEMV launch sweep: `{args.command}`",
        "",
        f"- {device_name}; copy {copy:.0f} GB/s; hidden {args.hidden}, moe_inter {args.inter}, {args.experts} "
        f"experts top-{args.topk}; {len(sweep.us)} (config, tokens) timings in {sweep.elapsed():.0f} s; times = "
        "CUDA-graph device time of the whole gemv_moe call after an L2 flush (fastest of its runs); err = "
        "norm-relative vs the default config",
        "",
    ]
    if args.gemv_out:
        Path(args.gemv_out).write_text("\n".join(header + full))
    if args.gemv_best_out:
        Path(args.gemv_best_out).write_text(line + "\n")
    return best
