"""Cold start on a GPU (engine.execution.warmup): per-request times of a cold engine against a warmed one, each in a
fresh process with empty DeepGEMM and Triton caches (so every compile shows), or with the caches an earlier run
filled.

    python3 -m benchmarks.cold_start --model DIR [--requests 12] [--warmup 0|1] [--cache-dir D] > warmW.log
    python3 -m benchmarks.cold_start --report DIR --timeout-s S [--write]

Prints one line per request: prompt length, prefill step ms (its first step, the time to first token without
queueing), the slowest later step ms (a decode step, or the rest of a prompt the prefix cache cut), and what the
request compiled; then the medians and maxima. --report turns DIR/warm{0,1,1_nvrtc,1_hot}.log (warm-up off, on,
on with NVRTC, on with the caches of an earlier run) into the BENCHMARKS.md section gpu_cold_start.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

REQUEST = re.compile(
    r"^request (\d+): prompt (\d+), first step ([\d.]+) ms, "
    r"slowest (?:decode|later) step ([\d.]+) ms$",
    re.M,
)
LOADED = re.compile(r"^load_engine \(warm-up (\d)\): ([\d.]+) s$", re.M)
MACHINE = re.compile(r"^machine: (.*)$", re.M)
PHASES = re.compile(
    r"warm-up: \d+ prompts \([\d,]+ tokens\) ([\d.]+) s, (\d+) decode graphs captured ([\d.]+) s, "
    r"(\d+) FP8 GEMM shapes x \d+ M values ([\d.]+) s"
)
COMPILED = re.compile(r"^compile caches: (\d+) DeepGEMM files, (\d+) Triton files", re.M)
COMPILED_IN_REQUEST = re.compile(r"^  compiled during request \d+: (.*)$", re.M)
ERROR = re.compile(r"^(\w*Error: .*)$", re.M)
# DIR/warm{W}.log: W -> what the run was
VARIANTS = {
    "0": "off, empty caches",
    "1": "on, empty caches (DeepGEMM via nvcc)",
    "1_nvrtc": "on, empty caches (DeepGEMM via NVRTC)",
    "1_hot": "on, caches of an earlier run",
}


def report(run_dir: str, timeout_s: float, machine: str | None, extra_notes=()) -> str:
    """The section from DIR/warm{0,1,1_nvrtc,1_hot}.log (what each process printed before it ended)."""
    logs = {w: open(p).read() for w in VARIANTS if os.path.exists(p := os.path.join(run_dir, f"warm{w}.log"))}
    if machine is None:
        seen = [m.group(1) for t in logs.values() if (m := MACHINE.search(t))]
        machine = seen[0] if seen else "not recorded"
    lines = [
        "## Cold start on a GPU: per-request stalls without and with the engine warm-up",
        "",
        "- command: `timeout S python3 -m benchmarks.cold_start --model /tmp/mini --warmup W [--nvrtc] "
        "[--cache-dir D]` (`tools/gpu/stages.sh coldstart`: a fresh process each, on empty DeepGEMM and "
        "Triton caches unless a run names the caches an earlier run filled), then `python3 "
        f"-m benchmarks.cold_start --report DIR --timeout-s {timeout_s:.0f} --write`",
        "- model: `dsv4 make-model --preset mini_v4 --quantize` (4 layers, V4 attention geometry, FP8 dense / "
        "MXFP4 experts), bf16 engine, CUDA graphs, max_batch_tokens 4096, 64 sequences; requests one at a time, "
        "prompts 256-2048 tokens, 16 new tokens. A later step is a decode step or the rest of a prompt the "
        "prefix cache cut at a block boundary",
        f"- machine: {machine}",
        "",
        "| warm-up | run | engine ready after | its phases: ladder / graphs / GEMM sweep | requests done | "
        "requests that compiled | first step ms: median / max | slowest later step ms: median / max | "
        "compiled files: DeepGEMM / Triton |",
        "|---|---|---:|---|---:|---|---:|---:|---:|",
    ]
    notes = []
    for w, text in logs.items():
        loaded = LOADED.search(text)
        reqs = REQUEST.findall(text)
        ready = f"{float(loaded.group(2)):.1f} s" if loaded else f"not within {timeout_s:.0f} s"
        if reqs:
            firsts, worst = [float(r[2]) for r in reqs], [float(r[3]) for r in reqs]
            cells = (
                f"{statistics.median(firsts):.0f} / {max(firsts):.0f}",
                f"{statistics.median(worst):.0f} / {max(worst):.0f}",
            )
        else:
            cells = ("-", "-")
        ph = PHASES.search(text)
        phases = (
            f"{ph.group(1)} s / {ph.group(2)} in {ph.group(3)} s / {ph.group(4)} shapes in {ph.group(5)} s"
            if ph
            else "-"
        )
        comp = COMPILED.search(text)
        files = f"{comp.group(1)} / {comp.group(2)}" if comp else "-"
        compiled = COMPILED_IN_REQUEST.findall(text)
        names = (
            n.split(" x")[0].strip("_").removesuffix("_kernel")
            for c in compiled
            for n in c.split(": ", 1)[-1].split(", ")
        )
        kernels = dict.fromkeys("matmul_ogs" if n.startswith("matmul_") else n for n in names)  # (one per tile shape)
        which = f"{len(compiled)} ({', '.join(kernels)})" if compiled else "0"
        if not reqs:
            which = "-"
        elif not compiled and "Triton kernels compiled" not in text:
            which = "not recorded"  # (a log from before the per-request record)
        if not loaded and (err := ERROR.findall(text)):
            notes.append(f"- {VARIANTS[w]}: the process ended with `{err[-1][:200]}`")
        run = m.group(1).rsplit("; ", 1)[-1] if (m := MACHINE.search(text)) and "; " in m.group(1) else "-"
        lines.append(
            f"| {VARIANTS[w]} | {run} | {ready} | {phases} | {len(reqs)} | {which} | {cells[0]} | "
            f"{cells[1]} | {files} |"
        )
    notes += [f"- {n}" for n in extra_notes]
    return "\n".join(lines + ([""] + notes if notes else []))


def cache_files(cache: str) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(cache) for f in files}


def kernel_names(paths) -> str:
    """'name xN, ...' for the Triton kernels (their metadata .json files) and DeepGEMM kernels among paths."""
    import collections
    import json

    names = collections.Counter()
    for p in paths:
        if p.endswith(".json") and "__grp__" not in p and "/triton/" in p:
            try:
                names[json.load(open(p)).get("name", "?")] += 1
            except (OSError, ValueError):
                names["?"] += 1
        elif "/deep_gemm/" in p:
            names["DeepGEMM files"] += 1
    return ", ".join(f"{n} x{c}" for n, c in names.most_common())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", default=None, help="write the section from DIR/warm{0,1}.log instead of running")
    ap.add_argument("--timeout-s", type=float, default=0.0, help="the timeout each logged process ran under")
    ap.add_argument("--machine", default=None, help="machine and date line (default: the one the logs print)")
    ap.add_argument("--write", action="store_true", help="put the report into BENCHMARKS.md")
    ap.add_argument("--note", action="append", default=[], help="a line to add under the table (repeatable)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--warmup", default="1", choices=["0", "1"])
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="compile caches here (default: a fresh temporary directory); a later service run can load from it",
    )
    ap.add_argument("--nvrtc", action="store_true", help="DeepGEMM compiles with NVRTC (DG_JIT_USE_NVRTC=1), not nvcc")
    args = ap.parse_args()
    if args.report:
        section = report(args.report, args.timeout_s, args.machine, args.note)
        print(section)
        if args.write:
            from service.benchmarks_md import write_section

            write_section("gpu_cold_start", section)
        return
    if not args.model:
        ap.error("--model is required to run")
    cache = args.cache_dir or tempfile.mkdtemp(prefix="dsv4-warm-")
    if os.path.isdir(cache) and any(os.scandir(cache)):
        print(f"note: compile cache {cache} is not empty: this run is not cold", flush=True)
    os.environ["DSV4_WARMUP"] = args.warmup
    os.environ.setdefault("DSV4_MXFP4_MOE", "1")
    os.environ["DG_JIT_CACHE_DIR"] = os.path.join(cache, "deep_gemm")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    if args.nvrtc:
        os.environ["DG_JIT_USE_NVRTC"] = "1"
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(
        f"machine: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    from engine.execution.sampling_params import SamplingParams
    from engine.loading.load import load_engine

    t = time.perf_counter()
    core = load_engine(
        args.model,
        device="cuda",
        dtype="bfloat16",
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=64,
        max_cached_tokens=65536,
        warmup=True,
    )
    print(f"load_engine (warm-up {args.warmup}): {time.perf_counter() - t:.1f} s", flush=True)
    seen = cache_files(cache)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    firsts, worst = [], []
    for i in range(args.requests):
        n = int(torch.randint(256, 2049, (1,), generator=g))
        rid = core.add_request(torch.randint(2, core.cfg.vocab_size, (n,), generator=g).tolist(), params)
        steps = []
        while core.has_work:
            t = time.perf_counter()
            core.step()
            torch.cuda.synchronize()
            steps.append((time.perf_counter() - t) * 1e3)
        core.pop_finished(rid)
        firsts.append(steps[0])
        worst.append(max(steps[1:]))
        print(
            f"request {i}: prompt {n}, first step {steps[0]:.1f} ms, slowest later step {worst[-1]:.1f} ms", flush=True
        )
        now = cache_files(cache)
        if now - seen:  # what this request compiled (a warm-up that covers serving leaves nothing here)
            print(f"  compiled during request {i}: {len(now - seen)} files: {kernel_names(now - seen)}", flush=True)
        seen = now
    # (`seen` is the caches' file list after the last request)
    compiled = {name: sum(f"/{name}/" in f for f in seen) for name in ("deep_gemm", "triton")}
    print(
        f"compile caches: {compiled['deep_gemm']} DeepGEMM files, {compiled['triton']} Triton files "
        f"(nvrtc {int(args.nvrtc)})"
    )
    print("Triton kernels compiled, variants per kernel:", kernel_names(f for f in seen if "/triton/" in f))
    print(
        f"warm-up {args.warmup}: first step median {statistics.median(firsts):.1f} ms, max {max(firsts):.1f} ms; "
        f"slowest later step median {statistics.median(worst):.1f} ms, max {max(worst):.1f} ms"
    )


if __name__ == "__main__":
    main()
