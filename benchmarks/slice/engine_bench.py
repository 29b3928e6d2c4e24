"""The engine's timed runs: decode steps at batch x context, one profiled decode step, a long prefill.

Decode requests enter through the decode-side hand-off API (`reserve_import` + `commit_import`: pages
allocated, num_computed = C) over the random cache rows, so a step sees a full context C without running a
prefill of B x C tokens. A decode timing is the wall time of one `EngineCore.step()` in a run of steps (the
rate a serving loop sees: with overlapped decode the host's share hides behind the next step); a prefill timing
is CUDA-synchronised.

Decode steps run as the engine runs them (`core.decode_mode`; "graphs" on a 16-bit CUDA engine): a CUDA
graph is captured on the first step of each (batch-slot, context) bucket (engine/execution/cuda_graphs.py). A timed
step that captured one (the context crossed a bucket edge) is dropped and another step is run in its
place; the count is reported.
"""

from __future__ import annotations

import importlib
import sys
import time

import torch

from benchmarks.timing import Clock, median, sync
from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.model.config import ModelConfig
from engine.model.fast_paths import use_mxfp4_moe


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ExpertRecorder:
    """Keeps the routed expert ids of each MoE call while `on`, whichever route the engine takes.

    Wraps `route` where engine.model.moe looks it up: `engine.model.moe.route` (dense experts) and the attribute
    `dsv4_kernels.triton_moe.route` (packed MXFP4 on the Triton path; engine.model.moe imports the module inside
    the call). Under CUDA graphs route runs only at capture: the ids tensors of the capture forward are
    kept per bucket (so their memory stays theirs) and read after each replay. Padding rows of a
    fixed-shape step are dropped (real requests come first).
    """

    def __init__(self, core: EngineCore):
        self.ids: list[torch.Tensor] = []
        self.on = False
        self._graph_ids: dict = {}  # DecodeShape -> ids tensors of its capture forward, layer order
        self._run_ids: list[torch.Tensor] | None = None  # route outputs inside DecodeRunner.run
        self._patched: list[tuple[object, str, object]] = []
        self._patch(sys.modules[type(core.model.moe[0]).__module__], "route")
        packed = any(m.mxfp4 for m in core.model.moe)
        if (packed and use_mxfp4_moe(core.device)) or "dsv4_kernels.triton_moe" in sys.modules:
            self._patch(importlib.import_module("dsv4_kernels.triton_moe"), "route")
        runner = core.decode_runner
        if runner is not None:
            orig_run = runner.run

            def run(request_ids, token_ids, positions, tables, token_source=None):
                shape = runner.shape_for(len(token_ids), max(positions) + 1)
                self._run_ids, captured = [], shape is not None and shape not in runner.graphs
                try:
                    out = orig_run(request_ids, token_ids, positions, tables, token_source=token_source)
                finally:
                    got, self._run_ids = self._run_ids, None
                n = len(token_ids)
                if out is not None and runner.mode == "graphs":
                    if captured:
                        self._graph_ids[shape] = [ids for ids, cap in got if cap]
                    got = [(ids, False) for ids in self._graph_ids.get(shape, [])]
                if out is not None and self.on:
                    self.ids.extend(ids[:n].clone() for ids, cap in got if not cap)
                return out

            runner.run = run
            self._patched.append((runner, "run", None))

    def _patch(self, module, attr: str) -> None:
        orig = getattr(module, attr)

        def route(*args, **kwargs):
            weights, ids = orig(*args, **kwargs)
            if self._run_ids is not None:  # inside DecodeRunner.run: sorted out there
                self._run_ids.append((ids, _capturing()))
            elif self.on:
                self.ids.append(ids)
            return weights, ids

        setattr(module, attr, route)
        self._patched.append((module, attr, orig))

    def touched_per_layer(self, num_layers: int) -> list[float]:
        """Mean distinct experts per layer over the recorded steps."""
        per = [[] for _ in range(num_layers)]
        for j, ids in enumerate(self.ids):
            per[j % num_layers].append(int(ids.unique().numel()))
        self.ids.clear()
        return [sum(p) / len(p) if p else 0.0 for p in per]

    def restore(self) -> None:
        """Undo the patches (before another engine or the peer runs in this process)."""
        for obj, attr, orig in reversed(self._patched):
            if orig is None:
                delattr(obj, attr)  # the instance attribute shadowing DecodeRunner.run
            else:
                setattr(obj, attr, orig)
        self._patched.clear()
        self._graph_ids.clear()


def _graphs(core: EngineCore) -> int:
    runner = core.decode_runner
    return len(runner.graphs) if runner is not None and runner.mode == "graphs" else 0


def bench_decode(
    core: EngineCore,
    cfg: ModelConfig,
    rec: ExpertRecorder,
    batch: int,
    ctx: int,
    warmup: int,
    steps: int,
    clock: Clock,
    reserve_s: float,
    seed: int,
    temperature: float = 0.0,
) -> dict:
    """Median step time of `batch` requests decoding at context `ctx` (caches synthetic, see module doc).
    temperature > 0: seeded sampling (top_p 1, no top-k: the OpenAI default), not greedy: no overlapped steps."""
    device = core.device
    g = torch.Generator().manual_seed(seed)
    extra = 4  # timed steps that captured a graph are dropped and replaced, up to this many
    params = SamplingParams(max_new_tokens=warmup + steps + extra + 2, ignore_eos=True, temperature=temperature)
    prompt = torch.randint(2, cfg.vocab_size, (ctx,), generator=g).tolist()
    first = torch.randint(2, cfg.vocab_size, (batch,), generator=g).tolist()
    rids = [f"dec-b{batch}-c{ctx}-{b}" for b in range(batch)]
    t_setup = time.perf_counter()
    times: list[float] = []
    captured_timed = 0
    try:
        for b, rid in enumerate(rids):
            core.reserve_import(prompt, params, rid, seed=b, first_token=first[b], first_logprob=0.0)
            core.commit_import(rid)
        setup_s = time.perf_counter() - t_setup
        sync(device)
        for _ in range(warmup + steps + extra):
            if len(times) >= warmup + steps:
                break
            if len(times) >= warmup + 1 and clock.left() - reserve_s < 2 * median(times):
                break  # out of time: keep what was measured
            rec.on = len(times) >= warmup
            graphs = _graphs(core)
            # No device sync around a step: a synchronous step reads its tokens back anyway, and an overlapped one
            # (engine.execution.decode_overlap) returns step N while N + 1 runs, so the time between returns is its rate.
            t = time.perf_counter()
            core.step()
            dt = time.perf_counter() - t
            rec.on = False
            if len(times) >= warmup and _graphs(core) > graphs:
                captured_timed += 1  # a capture, not a step: time another (its routing is real, kept)
                continue
            times.append(dt)
    finally:
        rec.on = False
        for rid in rids:
            core.abort(rid)
    timed = times[warmup:] or times[-1:]
    return {
        "step_s": median(timed),
        "n": len(timed),
        "setup_s": setup_s,
        "captured_timed": captured_timed,
        "graphs": _graphs(core),
        "touched": rec.touched_per_layer(cfg.num_layers),
    }


def profile_decode(
    core: EngineCore, cfg: ModelConfig, batch: int, ctx: int, seed: int, dump: str | None = None
) -> dict:
    """One decode step under torch.profiler: kernels launched, summed kernel time, top kernels by device time
    (grouped by kernel name: under CUDA graphs the kernels are not attributed to torch ops).

    The step runs synchronously (overlapped decode off for it): an overlapped step() completes one step and
    launches the next, so its window held two steps' kernels (the H200 run of 2026-12-02 09:56 counted 567, 142
    a layer, for a step of ~71 a layer)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = torch.randint(2, cfg.vocab_size, (ctx,), generator=g).tolist()
    rids = [f"prof-{b}" for b in range(batch)]
    overlap, core.overlap_decode = core.overlap_decode, False
    try:
        for _ in range(4):  # (none expected: an earlier run's step still in flight)
            if core._launched is None:
                break
            core.step()
        for b, rid in enumerate(rids):
            core.reserve_import(prompt, params, rid, seed=b, first_token=2 + b, first_logprob=0.0)
            core.commit_import(rid)
        core.step()
        sync(core.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            core.step()
            sync(core.device)
            wall = time.perf_counter() - t
    finally:
        core.overlap_decode = overlap
        for rid in rids:
            core.abort(rid)
    if dump:
        _dump_kernels(prof, dump)
    return {
        **_kernel_table(prof, 8),
        "wall_ms": wall * 1e3,
        "per_layer": _kernel_table(prof, 0)["kernels"] / cfg.num_layers,
    }


def _dump_kernels(prof, path: str) -> None:
    """Every kernel of a profiled run in launch order: start us (from the first), device us, name. Under CUDA
    graphs the kernels carry no torch op, so the order is what ties each to the model code."""
    evs = sorted(
        (ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda ev: ev.time_range.start,
    )
    t0 = evs[0].time_range.start if evs else 0.0
    with open(path, "w") as f:
        for ev in evs:
            start, us = ev.time_range.start - t0, ev.time_range.end - ev.time_range.start
            f.write(f"{start:9.1f} {us:7.1f}  {ev.name[:140]}\n")


def _kernel_table(prof, top: int) -> dict:
    """Kernels of a torch.profiler run: count, summed device time, the `top` names by device time."""
    kernels, busy_us = 0, 0.0
    by_name: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            busy_us += t
            acc = by_name.setdefault(ev.name[:60], [0.0, 0])
            acc[0] += t
            acc[1] += 1
    ops = sorted(((t, k, c) for k, (t, c) in by_name.items()), reverse=True)
    cats: dict[str, int] = {}
    for name, (_, c) in by_name.items():
        cats[kernel_category(name)] = cats.get(kernel_category(name), 0) + c
    return {
        "kernels": kernels,
        "busy_ms": busy_us / 1e3,
        "top": ops[:top],
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
    }


# (category, name fragments) in match order: the profile line's kernels-per-layer split.
KERNEL_CATEGORIES = (
    ("MoE matmul (triton_kernels)", ("_matmul_",)),
    ("DeepGEMM", ("deep_gemm",)),
    ("FlashMLA", ("flash_fwd", "flashmla", "flash_mla", "sparse_attn_fwd")),
    ("cuBLAS/GEMM", ("nvjet", "gemm", "cutlass", "xmma", "splitKreduce")),
    ("torch elementwise/reduce/index", ("at::native", "at_cuda_detail", "cub::")),
    ("copies/memsets", ("Memcpy", "Memset", "memcpy", "memset")),
    ("engine Triton", ("_kernel",)),
)


def kernel_category(name: str) -> str:
    for cat, frags in KERNEL_CATEGORIES:
        if any(f in name for f in frags):
            return cat
    return "other Triton/other"


def profile_prefill(core: EngineCore, cfg: ModelConfig, tokens: int, seed: int, dump: str | None = None) -> dict:
    """One whole prefill of `tokens` under torch.profiler -> kernels, busy ms, wall ms, top 12 kernels; dump: also
    write every kernel in launch order to this file (with the GPU's idle gaps between them, where the host was
    behind)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, cfg.vocab_size, (tokens,), generator=g).tolist()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        rid = core.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), request_id="prefill-prof")
        while core.has_work:
            core.step()
        sync(core.device)
        wall = time.perf_counter() - t
    core.pop_finished(rid)
    if dump:
        _dump_kernels(prof, dump)
    return {**_kernel_table(prof, 12), **_host_table(prof), "wall_ms": wall * 1e3}


def _host_table(prof, top: int = 6) -> dict:
    """Where a host-bound run's time goes: the CUDA API calls by host time (launches, synchronisations,
    blocking copies: a copy from pageable memory without non_blocking waits for the stream) and the GPU's idle
    time between its first and last kernel (the span minus the union of kernel intervals), with the longest
    gaps. -> {"api": [(ms, name, calls)], "idle_ms", "gaps_ms": [..], "span_ms"}."""
    api: dict[str, list] = {}
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((ev.time_range.start, ev.time_range.end))
        elif ev.name.startswith(("cuda", "cu")) and not ev.name.startswith("cudnn"):
            acc = api.setdefault(ev.name, [0.0, 0])
            acc[0] += ev.cpu_time_total
            acc[1] += 1
    spans.sort()
    gaps, end = [], None
    for a, b in spans:
        if end is not None and a > end:
            gaps.append(a - end)
        end = b if end is None else max(end, b)
    span = (end - spans[0][0]) if spans else 0.0
    return {
        "api": sorted(((t / 1e3, n, c) for n, (t, c) in api.items()), reverse=True)[:top],
        "idle_ms": sum(gaps) / 1e3,
        "gaps_ms": [g / 1e3 for g in sorted(gaps, reverse=True)[:3]],
        "span_ms": span / 1e3,
    }


def bench_prefill(
    core: EngineCore, cfg: ModelConfig, tokens: int, repeats: int, clock: Clock, reserve_s: float, seed: int
) -> dict:
    """One `tokens`-token prompt, 1 + repeats times (the first untimed unless it is the only one), each in as many
    steps as the engine's max_batch_tokens makes (chunks), synchronised after each step. -> {"s": median prefill
    seconds, "n", "steps", "runs_s": each timed run, "chunk_s": the last run's step seconds in order, "chunk_end":
    the prompt tokens computed after each of those steps (chunks may end early at prefix-cache blocks), "peak_gib":
    the largest allocated GiB during a run, "base_gib": allocated before it (CUDA; 0 elsewhere)}."""
    device = core.device
    cuda = torch.device(device).type == "cuda"
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    times, steps, chunk_s, chunk_end, peak, base = [], 0, [], [], 0.0, 0.0
    for r in range(1 + repeats):
        if r >= 2 and clock.left() - reserve_s < 2 * max(times):
            break
        prompt = torch.randint(2, cfg.vocab_size, (tokens,), generator=g).tolist()
        rid = core.add_request(prompt, params, request_id=f"prefill-{r}")
        sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) / 2**30
        t = time.perf_counter()
        chunk_s, chunk_end = [], []
        request = core.requests[rid]
        while core.has_work:
            ts = time.perf_counter()
            core.step()
            sync(device)  # per step: the time of each chunk as the prompt grows
            chunk_s.append(time.perf_counter() - ts)
            chunk_end.append(min(request.num_computed, tokens))
        times.append(time.perf_counter() - t)
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated(device) / 2**30)
        core.pop_finished(rid)
        steps = len(chunk_s)
    timed = times[1:] or times
    return {
        "s": median(timed),
        "n": len(timed),
        "steps": steps,
        "runs_s": timed,
        "chunk_s": chunk_s,
        "chunk_end": chunk_end,
        "peak_gib": peak,
        "base_gib": base,
    }
