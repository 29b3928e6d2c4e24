"""Where a speculative step's time goes (`python -m benchmarks.spec_profile`; `tools/gpu/stages.sh specprof`).

The engine of `dsv4 bench spec` (benchmarks/spec.py: the V4-Flash slice + 1 MTP layer, requests prefilled to
--context, drafts forced to --rate acceptance) at each batch: a few speculative steps and a few production
one-token steps (graphs + overlapped decode) under torch.profiler. Per step it reports wall time, GPU kernel time
(the sum over kernels: a busy GPU's share of the wall), and the host-side phases of the speculative step
(Speculator's plan building, the fixed step's verify launch, acceptance, rollback, MTP pass, chain, the one wait
for the acceptance, the host's apply) with their CPU time, then the kernels that take the most GPU time in each kind of step, with
their counts a step. What it answers: is a speculative step slow for kernels (which ones: the q > 1 attention and
indexer paths, the MTP layer, the logits), for launches between replays, or for host work while the GPU idles?
A diagnostic: it writes --out (markdown), never BENCHMARKS.md. `--tiny` runs on the CPU (the phases only).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks import spec as spec_bench
from benchmarks.timing import sync
from engine.execution import spec_fixed, spec_rollback, speculative

PHASES = [  # (owner, method name, label): wrapped in record_function ranges for the profile only
    (speculative.Speculator, "step", "spec: whole step"),
    (spec_fixed.FixedSpecStep, "launch", "spec: fixed step launches"),
    (speculative.Speculator, "_launch_next", "spec: overlapped launch of the next step"),
    (spec_rollback, "save_requests", "spec: rollback save"),
    (spec_rollback, "save_requests_at", "spec: rollback save (overlapped step)"),  # in OVERLAP_ONLY
    (spec_fixed.FixedSpecStep, "_accept", "spec: acceptance"),
    (spec_rollback, "restore_rejected", "spec: rollback restore"),
    (spec_fixed.FixedSpecStep, "_mtp_pass", "spec: MTP pass"),
    (spec_fixed.FixedSpecStep, "_draft", "spec: drafts (chain)"),
    (spec_fixed.LaunchedSpec, "read", "spec: wait for the acceptance (host)"),
    (speculative.Speculator, "_apply", "spec: apply (host)"),
]
OVERLAP_ONLY = {"spec: rollback save (overlapped step)"}  # phases of overlapped steps only (CUDA graphs by default)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.spec_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="profiled steps a kind (default 10; tiny 2)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", choices=("mxfp4", "bf16"), default="mxfp4")
    ap.add_argument("--top", type=int, default=15, help="kernels listed a kind")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


@contextlib.contextmanager
def phases():
    """Wrap PHASES in record_function ranges while profiling."""
    saved = []
    for owner, name, label in PHASES:
        raw, fn = inspect.getattr_static(owner, name), getattr(owner, name)
        saved.append((owner, name, raw))

        def wrapped(*a, __fn=fn, __label=label, **kw):
            with record_function(__label):
                return __fn(*a, **kw)

        setattr(owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def profiled(core, steps: int):
    """-> (profiler, wall ms a step) over `steps` engine steps after 2 untimed ones."""
    for _ in range(2):
        core.step()
    sync(core.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if core.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function("step"):
            for _ in range(steps):
                core.step()
            sync(core.device)
    total = next(e for e in prof.key_averages() if e.key == "step")
    return prof, total.cpu_time_total / 1000 / steps


def _device_us(e) -> float:
    return float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0) or 0.0)


def kernel_table(prof, steps: int, top: int) -> tuple[float, list[str]]:
    """-> (GPU kernel ms a step, markdown rows of the top kernels)."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:90]]
            k[0] += e.device_time if hasattr(e, "device_time") else e.cuda_time
            k[1] += 1
    total = sum(v[0] for v in kernels.values())
    rows = [
        f"| {name} | {us / steps / 1000:.3f} | {n / steps:.1f} | {100 * us / max(total, 1e-9):.1f}% |"
        for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    return total / steps / 1000, rows


def phase_rows(prof, steps: int) -> list[str]:
    by = {e.key: e for e in prof.key_averages()}
    out = []
    for _, _, label in PHASES:
        e = by.get(label)
        if e is not None:
            out.append(f"| {label} | {e.cpu_time_total / 1000 / steps:.3f} | {_device_us(e) / 1000 / steps:.3f} |")
    return out


def measure(core, batch: int, args) -> list[str]:
    spec = core.speculator
    ids = spec_bench.start_requests(core, batch, args)
    lines = [f"### batch {batch}", ""]
    spec.force_acceptance(args.rate, batch)
    with phases():
        prof, wall = profiled(core, args.steps)
    gpu, top = kernel_table(prof, args.steps, args.top)
    lines += [
        f"Speculative step (K={args.k}, acceptance forced to {args.rate}): wall {wall:.3f} ms a step, GPU kernels "
        f"{gpu:.3f} ms a step ({100 * gpu / wall:.0f}% of the wall).",
        "",
        "| phase | CPU ms a step | GPU ms a step (kernels it launched) |",
        "|---|---:|---:|",
        *phase_rows(prof, args.steps),
        "",
        "| kernel (speculative step) | GPU ms a step | launches a step | share |",
        "|---|---:|---:|---:|",
        *top,
        "",
    ]
    spec.force_acceptance(None)
    spec_bench.drain(spec, core)
    runner, core.speculator = core.decode_runner, None
    core.overlap_decode = True
    prof, wall = profiled(core, args.steps)
    gpu, top = kernel_table(prof, args.steps, args.top)
    lines += [
        f"Production one-token step (graphs + overlap): wall {wall:.3f} ms a step, GPU kernels {gpu:.3f} ms a step.",
        "",
        "| kernel (one-token step) | GPU ms a step | launches a step | share |",
        "|---|---:|---:|---:|",
        *top,
        "",
    ]
    for i in ids:
        core.abort(i)
    while core.has_work or core._launched is not None:
        core.step()
    core.speculator, core.overlap_decode, core.decode_runner = spec, False, runner
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    args.context = args.context or (32 if args.tiny else 1024)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.rates = [args.rate]
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device (use --tiny for the CPU check)", file=sys.stderr)
        return 1
    core = spec_bench.build(args)
    lines = [
        f"## Speculative step profile ({'tiny, CPU' if args.tiny else 'V4-Flash slice'}, context {args.context})",
        "",
    ]
    for batch in args.batches:
        lines += measure(core, batch, args)
        print("\n".join(lines[-40:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
