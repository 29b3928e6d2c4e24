#!/usr/bin/env python
"""GPU decode and prefill of a V4-Flash-shaped slice, against its rooflines and transformers (not a test).

The slice has V4-Flash's real widths (hidden 4096, 64 heads x 512, rope 64, q_lora 1024, o_groups 8 x 1024,
256 routed experts top-6 of width 2048 + 1 shared, 64 index heads x 128, index_topk 512, window 128, hc 4,
vocab 129280) and 4 layers mixing SWA / CSA / HCA (compress_ratios [0, 4, 128, 4], 1 hash-routed layer).
Weights are random and seeded: dense projections go through FP8 e4m3 128x128 UE8M0 block quantisation and
are dequantised to bf16, which is what the engine's loader does with a real checkpoint (engine/loading/weights.py).
The routed experts come in the formats --experts names (default both, in this order), one engine each,
freed before the next:
- mxfp4 (the production format): kept packed as `load_weights(..., keep_mxfp4_experts=True)` keeps them
  (uint8 e2m1 bytes + UE8M0 scale bytes, engine.model.moe.PackedExperts; random bytes, scale set for the same
  std as the bf16 experts) and run by the Triton MXFP4 MoE kernel (dsv4_kernels/triton_moe.py) on CUDA;
- bf16: MXFP4-rounded then dequantised to bf16, run by torch's grouped GEMM (engine.model.moe).
No checkpoint file is written; the weights dict is built on the GPU and handed to `EngineCore`, whose
decode mode is its default ("auto": CUDA graphs per (batch-slot, context) bucket on a 16-bit CUDA engine,
captured on a bucket's first step; the report names the mode each engine used).

Measured, in one process (CUDA-synchronised wall time of `EngineCore.step()`, median of the timed steps):
- decode, per experts format: B requests in decode at context C (B in 1/16/64/128, C in 4K/32K); the caches
  are filled synthetically: each request enters through the decode-side hand-off API (`reserve_import` +
  `commit_import`, pages allocated, num_computed = C) and the cache pool holds random rows, so the step
  sees a full context C without running a prefill of B x C tokens. Warm-up steps cover the graph capture;
  a timed step that still captured one (the context crossed a bucket edge) is replaced and reported;
- roofline of a decode step: the bytes the step must read / the device-to-device copy bandwidth measured
  in the same run ((read + write) / time of a 1 GiB copy). Two byte counts:
  * production format: dense FP8 (+ UE8M0 block scales) or bf16 where the release keeps bf16 (compressor,
    router, indexer weights_proj, embed rows, head), fp32 mHC/norm tensors, MXFP4 experts *actually
    touched by this step's routing* (counted from the engine's own routing, on either experts path and
    under CUDA graphs), caches as fp8_ds_mla (584 B a row) and MXFP4 indexer keys (68 B a row) per
    dsv4_kernels/geometry.py: per request and layer the SWA window (127 rows), on CSA layers all visible
    indexer keys + the top-512 entries, on HCA all entries;
  * engine format: the same rows and tensors as that engine stores them (bf16 dense weights, bf16 cache
    rows, touched experts as MXFP4 when kept packed, else bf16);
- prefill, per experts format: one request of --prefill-tokens (8K) prompt tokens in chunks of --prefill-chunk
  (8192) tokens, each step synchronised; tokens/s against the FLOP roofline (the matmul, attention and indexer
  FLOPs the prefill must do / a large bf16 matmul measured in the same run, and / DeepGEMM's FP8 GEMM at 8192^3
  where it runs), each timed run's seconds, each chunk's time as the prompt grows and the peak allocated memory;
- peer: transformers' `DeepseekV4ForCausalLM` on the same slice in bf16 (its own random init, hash table
  randomised; eager attention, the only one it supports), batch 16, context 4K, twice: with the experts
  implementation transformers picks by itself (`grouped_mm` on CUDA in 5.2x) and with `eager` experts (its
  Python loop over experts). Each gets its cache from a chunked prefill, then decode steps are timed the
  same way, and is compared with our best format at batch 16, context 4K (mxfp4 when it ran, else bf16).
  Skipped with a printed reason when transformers lacks the model or time is short.
- one decode step (batch 64, context 4K, first experts format) under torch.profiler: kernels launched and
  the GPU-busy share.

Every configuration runs under a time budget (--budget-s, default 540 s for the whole script, all formats
and the peer together) and is skipped with a printed reason when what is left would not cover it (shares
are kept back for the formats still to come and the peer). `--smoke` runs the same code on CPU with a tiny
config in seconds (eager decode, Triton off: packed MXFP4 experts take engine.model.moe's dequantise-on-the-fly
reference). The markdown section is printed, written to --out if given, and put into BENCHMARKS.md under
'## GPU decode and prefill (V4-Flash slice)' with --write (or --merge FILE inserts a section written
earlier, e.g. on the GPU machine, without running anything).

Code: benchmarks/slice/ (slice_model: config + weights per experts format + engine; benchmarks.timing: timing +
roofs; engine_bench: decode / profile / prefill runs and the expert-id recorder; roofline: bytes and
FLOPs; peer: transformers; report: the section and BENCHMARKS.md; suite: the run in order). This file
only parses the flags.

Usage: dsv4 bench slice [--experts mxfp4 bf16 fp8] [--out FILE] [--write] [--smoke] [--budget-s 540]
       [--prefill-tokens N] [--prefill-chunk 8192] [--prefill-runs 2] [--prefill-only]
       (= python -m benchmarks.slice; benchmarks/slice/run.sh wraps it and provides transformers' DeepseekV4 when
       the installed one lacks it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.slice.report import render, write_benchmarks
from benchmarks.slice.slice_model import ALL_EXPERT_FORMATS, EXPERT_FORMATS
from benchmarks.slice.suite import Suite, make_plan
from benchmarks.timing import Clock
from service.benchmarks_md import BENCHMARKS_MD


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dsv4 bench slice", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (or --device), seconds")
    ap.add_argument("--device", default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="wall budget of the whole script (default 540)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--prefill-tokens", type=int, default=None)
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=8192,
        help="the engine's max_batch_tokens: a longer prompt runs in chunks of this many tokens, as the "
        "service runs it (each chunk's time and the peak memory are reported)",
    )
    ap.add_argument("--prefill-runs", type=int, default=2, help="timed prefill runs after one untimed (median)")
    ap.add_argument(
        "--prefill-only",
        action="store_true",
        help="only the prefill rows (no decode rows, profiled decode step or sampled decode)",
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--experts",
        nargs="+",
        choices=ALL_EXPERT_FORMATS,
        default=list(EXPERT_FORMATS),
        help="routed-expert formats, one engine each, in this order: mxfp4 (packed, Triton MXFP4 MoE; "
        "the production format), bf16 (dequantised, torch grouped_mm), fp8 (mxfp4 plus the experts "
        "converted to FP8 for steps of >= 1024 tokens: DeepGEMM's grouped GEMM, as "
        "`dsv4 serve --prefill-expert-format fp8`); default mxfp4 bf16",
    )
    ap.add_argument(
        "--dense",
        choices=("auto", "fp8", "bf16"),
        default="auto",
        help="dense projections: fp8 (e4m3 + block scales through DeepGEMM, where it runs), bf16 "
        "(dequantised at load); auto = fp8 where DeepGEMM runs",
    )
    ap.add_argument(
        "--index-cache",
        choices=("auto", "mxfp4", "fp8"),
        default="auto",
        help="indexer keys of the fp8 cache (dsv4's --index-cache-dtype): auto = FP8 on Hopper, else MXFP4",
    )
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--profile-batch", type=int, default=None, help="batch of the profiled decode step (default 64)")
    ap.add_argument(
        "--profile-dump",
        default=None,
        help="write the profiled decode step's kernels, in launch order with device us, to this file",
    )
    ap.add_argument(
        "--prefill-dump",
        default=None,
        help="write the profiled prefill's kernels, in launch order with device us, to this file",
    )
    ap.add_argument("--out", default=None, help="also write the markdown section to this file")
    ap.add_argument("--write", action="store_true", help="put the section into BENCHMARKS.md")
    ap.add_argument("--merge", default=None, help="put this section file into BENCHMARKS.md and exit")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        write_benchmarks(BENCHMARKS_MD, Path(args.merge).read_text())
        print(f"merged {args.merge} into BENCHMARKS.md")
        return 0
    plan = make_plan(args)
    if torch.device(plan.device).type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --smoke for the CPU check)", file=sys.stderr)
        return 1
    clock = Clock(args.budget_s or (120 if plan.smoke else 540))
    section = render(Suite(plan, clock).run())
    print()
    print(section)
    if args.out:
        Path(args.out).write_text(section)
    if args.write:
        write_benchmarks(BENCHMARKS_MD, section)
        print("wrote BENCHMARKS.md", flush=True)
    return 0
