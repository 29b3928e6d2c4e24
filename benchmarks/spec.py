"""`dsv4 bench spec`: MTP speculative decoding on the V4-Flash slice (benchmarks/slice/slice_model.py + 1 MTP layer).

At batch 1, 16 and 64 (requests prefilled to --context tokens, greedy), one engine with speculative_tokens K and
decode_mode graphs on CUDA (eager bucketed on the CPU: the same fixed shapes), its drafting policy set to draft at
every batch measured (engine.execution.spec_policy: what these numbers set its default from):
- the one-token step, three ways, with the Speculator set aside: eager (EngineCore's plain varlen step), under CUDA
  graphs, and under graphs with overlapped decode (the production non-speculative path: the baseline of "x non-spec");
- speculative steps with drafts forced to a per-draft acceptance rate (Speculator.force_acceptance: after the verify
  forward each draft counts as the target's pick with probability `rate`, else as another token, so the step's
  cost is the real one: verify of K+1 tokens a request, rollback of the rejected rows, the MTP pass and the K-1
  chained MTP steps); rate 0 is the bare verify-step time.
Tokens/s per user = tokens a request emits / wall time, against the production one-token step. Verify steps of
decode-only batches run as fixed-shape steps with one host wait (engine.execution.spec_fixed): the verify step under
CUDA graphs (engine.execution.verify_graphs), acceptance and rollback on the device, the MTP pass and the chained
MTP steps under graphs (engine.execution.mtp_graphs), greedy steps launched before the previous one is read on CUDA
(engine.execution.spec_overlap).
`--tiny` runs the tiny preset on the CPU in seconds (tests/test_bench_spec.py) so a GPU run does not die on a typo.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.slice.slice_model import build_weights, fill_caches, fill_experts, flash_slice_config, smoke_config
from benchmarks.timing import sync
from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import SchedulerConfig
from engine.execution.spec_policy import SpecPolicy
from engine.loading.make_model import with_mtp_layers
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from service.benchmarks_md import write_section

EAGER, GRAPHS, PRODUCTION = "one-token step, eager", "one-token step, graphs", "one-token step, graphs + overlap"


@dataclass(frozen=True)
class Point:
    batch: int
    mode: str  # one of the one-token modes above, or "verify K+1, acceptance r"
    rate: float | None  # None: a one-token step
    step_ms: float
    tokens_per_step: float  # a request's, on average
    accepted: float  # measured accepted / drafted (None-rate: 0)

    @property
    def user_tps(self) -> float:
        return 1000.0 * self.tokens_per_step / self.step_ms


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dsv4 bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny preset on the CPU (seconds): a smoke run")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    ap.add_argument("--k", type=int, default=1, help="draft tokens a step (1 on H200, see shared/docs/mtp.md 4)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.6, 0.8, 0.9])
    ap.add_argument("--context", type=int, default=None, help="prompt tokens a request (default 1024; tiny 32)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps a point (default 20; tiny 3)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4")
    ap.add_argument("--out", default=None, help="also write the markdown section to this file")
    ap.add_argument("--write", action="store_true", help="put the section into BENCHMARKS.md")
    return ap.parse_args(argv)


def build(args) -> EngineCore:
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    raw = with_mtp_layers(smoke_config() if args.tiny else flash_slice_config(args.layers), 1)
    cfg = ModelConfig.from_dict(raw)
    gen = torch.Generator(device=device).manual_seed(0)
    experts = "bf16" if device.type == "cpu" else args.experts
    weights = build_weights(cfg, device, dtype, gen, experts, mtp=True)
    need = max(args.batches) * (args.context + (args.steps + 4) * (args.k + 1) * 5 + 64)
    core = EngineCore(
        cfg,
        weights,
        device=device,
        dtype=dtype,
        cache_config=CacheConfig(
            max_requests=max(args.batches), max_tokens=need, page_tokens=256, kv_cache_dtype="exact"
        ),
        scheduler_config=SchedulerConfig(max_batch_tokens=max(2048, args.context), max_num_seqs=max(args.batches)),
        decode_mode="graphs" if device.type == "cuda" else "bucketed",
        prefix_cache=False,
        speculative_tokens=args.k,
        speculative_policy=SpecPolicy(max_batch=max(args.batches)),
    )
    del weights
    fill_experts(core, gen, 16)
    fill_experts(SimpleNamespace(model=SimpleNamespace(moe=[m.moe for m in core.speculator.layers])), gen, 16)
    fill_caches(core, gen)
    sync(device)
    return core


def timed(core: EngineCore, steps: int, batch: int) -> tuple[float, float]:
    """-> (ms a step, tokens a request emits a step) over `steps` steps after 2 untimed ones."""
    for _ in range(2):
        core.step()
    sync(core.device)
    t0, emitted = time.perf_counter(), 0
    for _ in range(steps):
        emitted += sum(e.token_id is not None for e in core.step())
    sync(core.device)
    return 1000 * (time.perf_counter() - t0) / steps, emitted / (steps * batch)


def start_requests(core: EngineCore, batch: int, args) -> list[str]:
    """`batch` greedy requests of --context random tokens, prefilled until each decodes -> their ids."""
    g = random.Random(batch)
    budget = (args.steps + 4) * (args.k + 1) * 5
    ids = [
        core.add_request(
            [g.randrange(2, core.cfg.vocab_size) for _ in range(args.context)],
            SamplingParams(max_new_tokens=budget, ignore_eos=True),
        )
        for _ in range(batch)
    ]
    while any(not core.requests[i].output for i in ids):  # prefill, then every request decodes
        core.step()
    return ids


def drain(spec, core: EngineCore) -> None:
    """Read the speculative step still in flight (overlapped) before the Speculator is set aside."""
    overlap, spec.overlap = spec.overlap, False
    while spec.launched is not None:
        core.step()
    spec.overlap = overlap


def measure(core: EngineCore, batch: int, args) -> list[Point]:
    spec = core.speculator
    ids = start_requests(core, batch, args)
    points = []
    for rate in [0.0] + list(args.rates):
        spec.force_acceptance(rate, batch)
        before = dict(spec.stats)
        ms, per = timed(core, args.steps, batch)
        drafted = spec.stats["drafted"] - before["drafted"]
        points.append(
            Point(
                batch,
                f"verify K+1, acceptance {rate:.1f}",
                rate,
                ms,
                per,
                (spec.stats["accepted"] - before["accepted"]) / max(drafted, 1),
            )
        )
    spec.force_acceptance(None)
    drain(spec, core)
    points += one_token_steps(core, batch, args)
    for i in ids:
        core.abort(i)
    while core.has_work or core._launched is not None:  # the overlapped step still in flight
        core.step()
    core.speculator, core.overlap_decode = spec, False
    return points


def one_token_steps(core: EngineCore, batch: int, args) -> list[Point]:
    """The one-token step with the Speculator set aside: eager, graphs (eager bucketed on the CPU), graphs + overlap
    (production; left on: the caller aborts the requests and drains the step in flight)."""
    runner, core.speculator, out = core.decode_runner, None, []
    for mode, bucketed, overlap in ((EAGER, False, False), (GRAPHS, True, False), (PRODUCTION, True, True)):
        core.decode_runner, core.overlap_decode = (runner if bucketed else None), overlap
        ms, per = timed(core, args.steps, batch)
        out.append(Point(batch, mode, None, ms, per, 0.0))
    return out


def render(points: list[Point], args, core: EngineCore) -> str:
    cfg = core.cfg
    lines = [
        f"## Speculative decoding (MTP, K={args.k}) on the {'tiny preset (smoke)' if args.tiny else 'V4-Flash slice'}",
        "",
        f"`dsv4 bench spec{' --tiny' if args.tiny else ''} --k {args.k}`: {cfg.num_layers} layers + 1 MTP layer, "
        f"context {args.context} tokens, {args.steps} timed steps a point, device {core.device}, greedy; drafts "
        "forced to the per-draft acceptance rate after the verify forward (benchmarks/spec.py). Decode-only steps "
        "run on fixed shapes with one host wait a step (verify, acceptance and rollback on the device, MTP pass "
        f"and chain) {'under CUDA graphs' if core.device.type == 'cuda' else 'eager bucketed (CPU)'}, "
        f"{'each launched before the previous one is read' if core.speculator.overlap else 'not overlapped'}; "
        "x non-spec is against the production one-token step (graphs + overlapped decode).",
        "",
        "| batch | mode | step ms | x production step | tokens/step/user | accepted | tok/s/user | x non-spec |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in args.batches:
        rows = [p for p in points if p.batch == batch]
        base = next(p for p in rows if p.mode == PRODUCTION)
        rows = [p for p in rows if p.rate is None] + [p for p in rows if p.rate is not None]
        for p in rows:
            lines.append(
                f"| {batch} | {p.mode} | {p.step_ms:.2f} | {p.step_ms / base.step_ms:.2f} | "
                f"{p.tokens_per_step:.2f} | {p.accepted:.2f} | {p.user_tps:.1f} | "
                f"{p.user_tps / base.user_tps:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.context = args.context or (32 if args.tiny else 1024)
    args.steps = args.steps or (3 if args.tiny else 20)
    if not args.tiny and (args.device or "cuda").startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device (use --tiny for the CPU check)", file=sys.stderr)
        return 1
    core = build(args)
    points = []
    for batch in args.batches:
        points += measure(core, batch, args)
        print(
            f"batch {batch}: "
            + ", ".join(
                f"{p.mode}: {p.step_ms:.2f} ms {p.user_tps:.1f} tok/s/user" for p in points if p.batch == batch
            ),
            flush=True,
        )
    section = render(points, args, core)
    print(section)
    if args.out:
        Path(args.out).write_text(section)
    if args.write:
        write_section("bench_spec", section)
        print("wrote BENCHMARKS.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
