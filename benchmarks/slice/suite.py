"""One benchmark run, in order: roofs; then per routed-experts format (--experts, mxfp4 first) an engine
built, its decode rows, one profiled step (first format only), a prefill and the long-context decode rows,
the engine freed before the next; then the transformers peer; -> the context `report.render` turns into
the section.

Every configuration runs under the run's time budget and is skipped with a printed reason when what is
left would not cover it. Shares are kept back for the peer and for the formats still to come (each later
format gets the weight 1, the current one 1.5, of what is left after the peer's share).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import shlex
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.timing import Clock, measure_roofs
from dsv4_kernels.settings import TRITON, reload, settings
from engine.model.config import ModelConfig
from engine.model.fast_paths import use_triton

from .engine_bench import ExpertRecorder, bench_decode, bench_prefill, profile_decode, profile_prefill
from .peer import bench_transformers, transformers_info
from .report import environment, fmt_k, verdicts
from .roofline import check_geometry, decode_figures, prefill_figures
from .slice_model import (
    ALL_EXPERT_FORMATS,
    EXPERT_FORMATS,
    build_engine,
    dense_path,
    experts_path,
    flash_slice_config,
    slice_description,
    smoke_config,
)

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Plan:
    """What one run measures, resolved from the flags (--smoke: the tiny config, on CPU by default)."""

    smoke: bool
    device: str
    raw: dict
    batches: list[int]
    contexts: list[int]
    prefill_tokens: int
    steps: int
    warmup: int
    hf_batch: int
    hf_ctx: int
    hf_chunk: int
    expert_chunk: int
    no_peer: bool
    experts: tuple[str, ...] = EXPERT_FORMATS  # routed-expert formats, one engine each, in this order
    dense: str = "auto"  # dense projections: "fp8" (DeepGEMM, where it runs), "bf16", or "auto" (fp8 if it runs)
    index_cache: str = "auto"  # indexer keys of an fp8 cache: "mxfp4", "fp8" or "auto" (FP8 on Hopper)
    profile_batch: int | None = None  # the profiled decode step's batch (default 64, or the largest batch)
    profile_dump: str | None = None  # also write the profiled step's kernels, in launch order, to this file
    prefill_dump: str | None = None  # the same for the profiled prefill
    prefill_chunk: int = 8192  # the engine's max_batch_tokens: a longer prompt runs in chunks, as the service runs it
    prefill_runs: int = 2  # timed prefill runs (after one untimed)
    prefill_only: bool = False  # skip the decode rows, the profiled decode step and the sampled decode

    @property
    def mm_n(self) -> int:  # the matmul size measure_roofs uses
        return 256 if self.smoke else 8192

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def make_plan(args: argparse.Namespace) -> Plan:
    device = args.device or ("cpu" if args.smoke else "cuda")
    experts = tuple(dict.fromkeys(getattr(args, "experts", None) or EXPERT_FORMATS))
    bad = [f for f in experts if f not in ALL_EXPERT_FORMATS]
    if bad:
        raise ValueError(f"--experts takes {ALL_EXPERT_FORMATS}, got {bad}")
    return dataclasses.replace(
        _plan(args, device),
        experts=experts,
        dense=getattr(args, "dense", None) or "auto",
        index_cache=getattr(args, "index_cache", None) or "auto",
        profile_batch=getattr(args, "profile_batch", None),
        profile_dump=getattr(args, "profile_dump", None),
        prefill_dump=getattr(args, "prefill_dump", None),
        prefill_chunk=getattr(args, "prefill_chunk", None) or 8192,
        prefill_runs=getattr(args, "prefill_runs", None) or 2,
        prefill_only=bool(getattr(args, "prefill_only", False)),
    )


def _plan(args: argparse.Namespace, device: str) -> Plan:
    if args.smoke:
        return Plan(
            smoke=True,
            device=device,
            raw=smoke_config(),
            batches=args.batches or [1, 4],
            contexts=args.contexts or [64, 300],
            prefill_tokens=args.prefill_tokens or 256,
            steps=args.steps or 3,
            warmup=min(args.warmup, 1),
            hf_batch=4,
            hf_ctx=64,
            hf_chunk=32,
            expert_chunk=4,
            no_peer=args.no_peer,
        )
    return Plan(
        smoke=False,
        device=device,
        raw=flash_slice_config(args.layers, args.vocab),
        batches=args.batches or [1, 16, 64, 128],
        contexts=args.contexts or [4096, 32768],
        prefill_tokens=args.prefill_tokens or 8192,
        steps=args.steps or 8,
        warmup=args.warmup,
        hf_batch=16,
        hf_ctx=4096,
        hf_chunk=512,
        expert_chunk=16,
        no_peer=args.no_peer,
    )


def fp8_roof(p: Plan) -> float | None:
    """DeepGEMM's dense FP8 GEMM rate at 8192^3 (TFLOP/s), the FP8 FLOP roof issue 35 counts prefill against; None
    off CUDA or without DeepGEMM."""
    from dsv4_kernels.gpu import has_deep_gemm

    if not p.cuda or p.smoke or not has_deep_gemm():
        return None
    from benchmarks.kernels.moe_fp8 import fp8_roof_tflops

    return fp8_roof_tflops()


def prefill_line(out: dict) -> str:
    """The log line of one measured prefill (Suite.prefill's figures)."""
    fp8 = f"; {100 * out['share_fp8']:.1f}% of the FP8 roof" if "share_fp8" in out else ""
    runs = ", ".join(f"{t * 1e3:.1f}" for t in out["runs_s"])
    chunks = ", ".join(f"{t * 1e3:.0f}" for t in out["chunk_s"])
    return (
        f"prefill {out['experts']} {out['tokens']}: {out['s']:.2f} s ({out['tok_s']:.0f} tok/s), roof "
        f"{out['roof_tok_s']:.0f} tok/s ({100 * out['share']:.1f}% of the bf16 matmul roof{fp8}); runs {runs} ms; "
        f"{out['steps']} chunk(s) of <= {out['chunk']} tokens: {chunks} ms; peak {out['peak_gib']:.2f} GiB "
        f"allocated ({out['base_gib']:.2f} before)"
    )


def free_device_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


class Suite:
    def __init__(self, plan: Plan, clock: Clock):
        self.plan, self.clock = plan, clock
        self.cfg = ModelConfig.from_dict(plan.raw)
        self.engines: list[dict] = []  # per experts format: path, decode_mode, build_s, graphs (or skip)
        self.decode: list[dict] = []
        self.prefills: list[dict] = []
        self.profile_info: dict | None = None
        self.notes: list[str] = []
        self.est_step: dict[int, tuple[int, float]] = {}  # context -> last measured (batch, step s)
        self.core, self.rec, self.engine = None, None, {}
        self.reserve = 0.0  # seconds kept back for the formats to come and the peer
        self.fp8_tflops: float | None = None  # the FP8 GEMM roof (CUDA with DeepGEMM)

    def run(self) -> dict:
        p = self.plan
        if not p.smoke:
            check_geometry(self.cfg)
        env = environment(p.device)
        print(
            f"# {env['gpu']} driver {env['driver']} torch {env['torch']} triton {env['triton']} "
            f"transformers {env['transformers']}",
            flush=True,
        )
        self.copy_gbs, self.tflops = measure_roofs(p.device, p.smoke)
        self.fp8_tflops = fp8_roof(p)
        fp8 = f", FP8 GEMM {self.fp8_tflops:.3g} TFLOP/s" if self.fp8_tflops else ""
        print(f"roofs: copy {self.copy_gbs:.0f} GB/s, bf16 matmul {self.tflops:.3g} TFLOP/s{fp8}", flush=True)
        peer_ok = not p.no_peer and transformers_info()[1]
        # the peer (both experts paths) took 20-40 s on an H200; 90 s kept back skipped an 8K prefill with 115 s left
        self.hf_reserve = (20 if p.smoke else 50) if peer_ok else 5
        triton_at_start = use_triton(p.device)
        for i, fmt in enumerate(p.experts):
            later = len(p.experts) - 1 - i
            self.reserve = self.hf_reserve + max(0.0, self.clock.left() - self.hf_reserve) * later / (later + 1.5)
            self.run_format(fmt)
        self.reserve = self.hf_reserve
        hf = self.peer(peer_ok)
        return self.context(env, triton_at_start, hf)

    def run_format(self, fmt: str) -> None:
        """Build the `fmt` engine, run its rows, free it (before the next engine or the peer loads)."""
        p = self.plan
        dense = dense_path(p.device, DTYPE, p.dense)
        self.engine = {
            "format": fmt,
            "dense": dense,
            "experts": experts_path(fmt, p.device, DTYPE)
            + ("; dense fp8 DeepGEMM" if dense == "fp8" else "; dense bf16"),
        }
        self.engines.append(self.engine)
        need = 5 if p.smoke else 60
        if self.clock.left() - self.reserve < need:
            self.engine["skip"] = f"time budget ({self.clock.left():.0f} s left, {self.reserve:.0f} s kept back)"
        else:
            try:
                self._build(fmt)
            except Exception as e:  # noqa: BLE001  (OOM and friends: report, carry on)
                self.engine["skip"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                self.core = None
        if "skip" in self.engine:
            print(f"experts {fmt}: SKIPPED ({self.engine['skip']})", flush=True)
            self.decode.append(
                {"batch": None, "ctx": None, "experts": self.engine["experts"], "skip": self.engine["skip"]}
            )
            free_device_memory(p.device)
            return
        try:
            for c in (c for c in p.contexts if c <= 8192 and not p.prefill_only):
                self.run_decode(c)
            if self.profile_info is None and not p.prefill_only:
                self.profile_info = self.profile()  # one profiled decode step, first format only
                self.sampled_decode()  # first format only too
            self.prefills.append(self.prefill())  # one long prompt, in chunks of p.prefill_chunk tokens
            for c in (c for c in p.contexts if c > 8192 and not p.prefill_only):
                self.run_decode(c)
            runner = self.core.decode_runner
            self.engine["graphs"] = len(runner.graphs) if runner is not None and runner.mode == "graphs" else 0
        finally:
            if self.rec is not None:
                self.rec.restore()
            self.core = self.rec = None
            free_device_memory(p.device)

    def _build(self, fmt: str) -> None:
        p = self.plan
        max_b, max_c = max(p.batches), max(p.contexts)
        steps_total = p.warmup + p.steps + 8
        max_tokens = max_b * (max_c + steps_total) + p.prefill_tokens + 1024
        t = time.perf_counter()
        self.cfg, self.core = build_engine(
            p.raw,
            p.device,
            DTYPE,
            max_requests=max(max_b, 1),
            max_tokens=max_tokens,
            prefill_tokens=p.prefill_tokens,
            seed=0,
            expert_chunk=p.expert_chunk,
            experts=fmt,
            dense=self.engine["dense"],
            index_cache=p.index_cache,
            prefill_chunk=p.prefill_chunk,
        )
        self.rec = ExpertRecorder(self.core)
        self.engine.update(
            build_s=time.perf_counter() - t,
            decode_mode=self.core.decode_mode,
            packed=self.core.model.moe[0].mxfp4,
            fp8_cache=self.core.pool.groups["swa"].quantised,
            index_fmt=self.core.cache_config.index_cache_dtype,
            overlap=self.core.overlap_decode,
            # $DSV4_PREFILL_GRAPHS: prefill steps replayed from CUDA graphs by token-count bucket (the A/B's switch)
            prefill_mode=self.core.prefill_runner.mode if self.core.prefill_runner is not None else "eager",
        )
        mem = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated" if p.cuda else ""
        print(
            f"engine (experts {self.engine['experts']}, decode {self.core.decode_mode}, prefill "
            f"{self.engine['prefill_mode']}) built in "
            f"{self.engine['build_s']:.1f} s{mem}",
            flush=True,
        )

    # ---- decode ----------------------------------------------------------------------------------
    def run_decode(self, ctx_len: int) -> None:
        for b in self.plan.batches:
            self.decode.append(self._decode_row(b, ctx_len))

    def _decode_row(self, b: int, ctx_len: int) -> dict:
        p, clock, label = self.plan, self.clock, self.engine["experts"]
        row = {"batch": b, "ctx": ctx_len, "experts": label, "format": self.engine["format"]}
        prev = self.est_step.get(ctx_len)
        guess = (prev[1] * max(1.0, b / prev[0]) ** 0.5) if prev else (0.5 if p.smoke else 3.0)
        need = guess * (p.warmup + 2) + b * ctx_len * 2e-7 + 2
        if clock.left() - self.reserve < need:
            row["skip"] = f"time budget ({clock.left():.0f} s left, ~{need:.0f} s needed)"
            print(f"decode {label} b={b} ctx={ctx_len}: SKIPPED ({row['skip']})", flush=True)
            return row
        try:
            r = self._bench_decode(b, ctx_len)
        except Exception as e:  # noqa: BLE001  (OOM and friends: report, carry on)
            row["skip"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            print(f"decode {label} b={b} ctx={ctx_len}: FAILED {row['skip']}", flush=True)
            free_device_memory(p.device)
            return row
        self.est_step[ctx_len] = (b, r["step_s"])
        row.update(
            decode_figures(
                self.cfg,
                b,
                ctx_len,
                r["step_s"],
                r["touched"],
                self.copy_gbs,
                self.engine["packed"],
                self.engine["dense"] == "fp8",
                self.engine["fp8_cache"],
                self.engine.get("index_fmt", "mxfp4"),
            ),
            n=r["n"],
            captured_timed=r["captured_timed"],
        )
        print(
            f"decode {label} b={b} ctx={ctx_len}: {row['step_ms']:.1f} ms/step (n={r['n']}, setup "
            f"{r['setup_s']:.1f} s, graphs {r['graphs']}, timed captures replaced {r['captured_timed']}), "
            f"experts/layer {row['touched']:.0f}, prod roof {row['prod_roof_ms']:.2f} ms ({row['x_prod']:.1f}x), "
            f"engine roof {row['eng_roof_ms']:.2f} ms ({row['x_eng']:.1f}x)",
            flush=True,
        )
        return row

    def _bench_decode(self, b: int, ctx_len: int) -> dict:
        """bench_decode; when the Triton attention path fails, say so and measure the reference path."""
        p = self.plan
        args = (self.core, self.cfg, self.rec, b, ctx_len, p.warmup, p.steps, self.clock, self.reserve)
        try:
            return bench_decode(*args, seed=b * 7 + ctx_len)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            if not use_triton(p.device):
                raise
            self.notes.append(
                f"The Triton path failed at batch {b}, context {ctx_len}, experts "
                f"{self.engine['experts']} ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:120] if str(e) else ''}); this and the following rows "
                "ran with DSV4_TRITON=0 (reference ops)."
            )
            print(f"decode b={b} ctx={ctx_len}: Triton path failed ({e!r}); retrying with DSV4_TRITON=0", flush=True)
            os.environ[TRITON] = "0"  # this process's settings, and any process it starts
            reload()
            return bench_decode(*args, seed=b * 7 + ctx_len)

    def sampled_decode(self) -> None:
        """Batch 64 (or the largest batch) at the smallest context with temperature 1 (the OpenAI default): its
        step next to the greedy row's, as a note. Sampled steps neither overlap nor pick inside the graph."""
        p = self.plan
        b, c = (64 if 64 in p.batches else max(p.batches)), min(p.contexts)
        greedy = next((r for r in self.decode if r.get("batch") == b and r.get("ctx") == c and "skip" not in r), None)
        if greedy is None or self.clock.left() - self.reserve < 4 * greedy["step_ms"] / 1e3 * (p.warmup + p.steps) + 5:
            return
        try:
            r = bench_decode(
                self.core,
                self.cfg,
                self.rec,
                b,
                c,
                p.warmup,
                p.steps,
                self.clock,
                self.reserve,
                seed=b * 7 + c,
                temperature=1.0,
            )
        except Exception as e:  # noqa: BLE001
            print(f"sampled decode: FAILED {type(e).__name__}: {e}", flush=True)
            return
        ms = r["step_s"] * 1e3
        print(
            f"decode sampled (temperature 1) b={b} ctx={c}: {ms:.1f} ms/step vs greedy {greedy['step_ms']:.1f}",
            flush=True,
        )
        self.notes.append(
            f"Sampled decode (temperature 1, top_p 1, seeded; experts {self.engine['experts']}), batch "
            f"{b}, context {fmt_k(c)}: {ms:.1f} ms a step against greedy's {greedy['step_ms']:.1f} "
            f"({ms / greedy['step_ms']:.2f}x; decode mode `{self.core.decode_mode}`, overlapped "
            f"{'on' if self.core.overlap_decode else 'off'}: a sampled step draws on the device after "
            "the graph, and since 2026-12-02 14:40 overlaps like a greedy one)."
        )

    # ---- profile, prefill, peer -------------------------------------------------------------------
    def profile(self) -> dict | None:
        """Batch 64 (or --profile-batch, or the largest batch) at the smallest context; None when not run."""
        p = self.plan
        pb, pc = p.profile_batch or (64 if 64 in p.batches else max(p.batches)), min(p.contexts)
        if not (p.cuda or p.smoke) or self.clock.left() - self.reserve <= (5 if p.smoke else 25):
            return None
        try:
            info = profile_decode(self.core, self.cfg, pb, pc, seed=99, dump=p.profile_dump)
            info.update(batch=pb, ctx=pc, experts=self.engine["experts"], decode_mode=self.core.decode_mode)
            print(
                f"profile b={pb} ctx={pc}: {info['kernels']} kernels, busy {info['busy_ms']:.1f} ms "
                f"of {info['wall_ms']:.1f} ms",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            info = {"skip": f"{type(e).__name__}: {e}"}
            print(f"profile: FAILED {info['skip']}", flush=True)
        return info

    def prefill(self) -> dict:
        p, clock = self.plan, self.clock
        out = {"experts": self.engine["experts"], "tokens": p.prefill_tokens}
        # A prefill is a few seconds: it competes only with the peer's reserve, not with the formats to come (the
        # H200 run of 2026-12-01 07:54 skipped the MXFP4 engine's prefill to keep time for the bf16 engine's rows).
        if clock.left() - self.hf_reserve < (5 if p.smoke else 30):
            return {**out, "skip": f"time budget ({clock.left():.0f} s left)"}
        try:
            r = bench_prefill(self.core, self.cfg, p.prefill_tokens, p.prefill_runs, clock, self.reserve, seed=5)
            out.update(
                prefill_figures(self.cfg, p.prefill_tokens, r["s"], self.tflops),
                n=r["n"],
                steps=r["steps"],
                runs_s=r["runs_s"],
                chunk_s=r["chunk_s"],
                chunk_end=r["chunk_end"],
                peak_gib=r["peak_gib"],
                base_gib=r["base_gib"],
                chunk=p.prefill_chunk,
            )
            if self.fp8_tflops:
                out["share_fp8"] = out["tflop"] / self.fp8_tflops / r["s"]
            print(prefill_line(out), flush=True)
            if p.cuda and clock.left() - self.reserve > 3 * r["s"] + 10:
                prof = profile_prefill(self.core, self.cfg, p.prefill_tokens, seed=6, dump=p.prefill_dump)
                out["profile"] = prof
                print(
                    f"prefill profile: {prof['kernels']} kernels, busy {prof['busy_ms']:.1f} ms of "
                    f"{prof['wall_ms']:.1f} ms; top: "
                    + "; ".join(f"{k} {t / 1e3:.1f} ms ({c}x)" for t, k, c in prof["top"]),
                    flush=True,
                )
        except Exception as e:  # noqa: BLE001
            out["skip"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            print(f"prefill: FAILED {out['skip']}", flush=True)
            free_device_memory(p.device)
        return out

    def peer(self, peer_ok: bool) -> list[dict]:
        p, clock = self.plan, self.clock
        if p.no_peer:
            return [{"skip": "--no-peer"}]
        if not peer_ok:
            return [{"skip": f"transformers {transformers_info()[0]}"}]
        if clock.left() < (10 if p.smoke else 45):
            return [{"skip": f"time budget ({clock.left():.0f} s left)"}]
        try:
            hf = bench_transformers(
                p.raw, p.device, DTYPE, p.hf_batch, p.hf_ctx, p.hf_chunk, 1, min(p.steps, 5), clock, seed=3
            )
        except Exception as e:  # noqa: BLE001
            hf = [{"skip": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}]
            print(f"transformers: FAILED {hf[0]['skip']}", flush=True)
        free_device_memory(p.device)
        return hf

    # ---- report context ---------------------------------------------------------------------------
    def context(self, env: dict, triton_at_start: bool, hf: list[dict]) -> dict:
        p, clock = self.plan, self.clock
        command = settings().bench_command or (
            "python -m benchmarks.slice " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        )
        ctx = {
            "env": env,
            "cfg": self.cfg,
            "copy_gbs": self.copy_gbs,
            "tflops": self.tflops,
            "mm_n": p.mm_n,
            "command": command,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "budget_s": clock.deadline - clock.t0,
            "slice_desc": slice_description(self.cfg, dense_path(p.device, DTYPE, p.dense)),
            "triton_path": triton_at_start,
            "engines": self.engines,
            "steps": p.steps,
            "warmup": p.warmup,
            "decode": self.decode,
            "prefill": self.prefills,
            "prefill_tokens": p.prefill_tokens,
            "hf": hf,
            "hf_batch": p.hf_batch,
            "hf_ctx": p.hf_ctx,
            "hf_chunk": p.hf_chunk,
            "profile": self.profile_info,
            "fp8_tflops": self.fp8_tflops,
        }
        ctx["verdicts"] = self.notes + ([""] if self.notes else []) + verdicts(ctx)
        ctx["total_s"] = clock.elapsed()
        return ctx
