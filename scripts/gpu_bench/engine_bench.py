"""The engine's timed runs: decode steps at batch x context, one profiled decode step, a long prefill.

Decode requests enter through the decode-side hand-off API (`reserve_import` + `commit_import`: pages
allocated, num_computed = C) over the random cache rows, so a step sees a full context C without running a
prefill of B x C tokens. Every timing is CUDA-synchronised wall time of `EngineCore.step()`.
"""

from __future__ import annotations

import sys
import time

import torch

import engine.model as engine_model
from engine.config import ModelConfig
from engine.runner import EngineCore
from engine.sampling_params import SamplingParams

from .measure import Clock, median, sync


class ExpertRecorder:
    """Wraps `route` where MoEBlock looks it up (engine.model) to keep each call's expert ids while on."""

    def __init__(self):
        self.ids: list[torch.Tensor] = []
        self.on = False
        self._module = sys.modules[engine_model.MoEBlock.__module__]
        self._orig = self._module.route

        def route(*args, **kwargs):
            weights, ids = self._orig(*args, **kwargs)
            if self.on:
                self.ids.append(ids)
            return weights, ids

        self._module.route = route

    def touched_per_layer(self, num_layers: int) -> list[float]:
        """Mean distinct experts per layer over the recorded steps."""
        per = [[] for _ in range(num_layers)]
        for j, ids in enumerate(self.ids):
            per[j % num_layers].append(int(ids.unique().numel()))
        self.ids.clear()
        return [sum(p) / len(p) if p else 0.0 for p in per]

    def restore(self) -> None:
        """Put the original route back (before another model, e.g. the peer, runs in this process)."""
        self._module.route = self._orig


def bench_decode(core: EngineCore, cfg: ModelConfig, rec: ExpertRecorder, batch: int, ctx: int, warmup: int,
                 steps: int, clock: Clock, reserve_s: float, seed: int) -> dict:
    """Median step time of `batch` requests decoding at context `ctx` (caches synthetic, see module doc)."""
    device = core.device
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=warmup + steps + 2, ignore_eos=True)
    prompt = torch.randint(2, cfg.vocab_size, (ctx,), generator=g).tolist()
    first = torch.randint(2, cfg.vocab_size, (batch,), generator=g).tolist()
    rids = [f"dec-b{batch}-c{ctx}-{b}" for b in range(batch)]
    t_setup = time.perf_counter()
    times: list[float] = []
    try:
        for b, rid in enumerate(rids):
            core.reserve_import(prompt, params, rid, seed=b, first_token=first[b], first_logprob=0.0)
            core.commit_import(rid)
        setup_s = time.perf_counter() - t_setup
        for s in range(warmup + steps):
            if s >= warmup + 1 and clock.left() - reserve_s < 2 * median(times):
                break  # out of time: keep what was measured
            rec.on = s >= warmup
            sync(device)
            t = time.perf_counter()
            core.step()
            sync(device)
            times.append(time.perf_counter() - t)
            rec.on = False
    finally:
        rec.on = False
        for rid in rids:
            core.abort(rid)
    timed = times[warmup:] or times[-1:]
    return {"step_s": median(timed), "n": len(timed), "setup_s": setup_s,
            "touched": rec.touched_per_layer(cfg.num_layers)}


def profile_decode(core: EngineCore, cfg: ModelConfig, batch: int, ctx: int, seed: int) -> dict:
    """One decode step under torch.profiler: kernels launched, summed kernel time, top ops by device time."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = torch.randint(2, cfg.vocab_size, (ctx,), generator=g).tolist()
    rids = [f"prof-{b}" for b in range(batch)]
    try:
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
        for rid in rids:
            core.abort(rid)
    kernels, busy_us = 0, 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            busy_us += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    ops = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if t > 0 and ev.device_type != torch.autograd.DeviceType.CUDA:
            ops.append((t, ev.key, ev.count))
    ops.sort(reverse=True)
    return {"kernels": kernels, "busy_ms": busy_us / 1e3, "wall_ms": wall * 1e3, "top": ops[:6]}


def bench_prefill(core: EngineCore, cfg: ModelConfig, tokens: int, repeats: int, clock: Clock, reserve_s: float,
                  seed: int) -> dict:
    device = core.device
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    times, steps = [], 0
    for r in range(1 + repeats):
        if r >= 2 and clock.left() - reserve_s < 2 * max(times):
            break
        prompt = torch.randint(2, cfg.vocab_size, (tokens,), generator=g).tolist()
        rid = core.add_request(prompt, params, request_id=f"prefill-{r}")
        sync(device)
        t = time.perf_counter()
        n = 0
        while core.has_work:
            core.step()
            n += 1
        sync(device)
        times.append(time.perf_counter() - t)
        core.pop_finished(rid)
        steps = n
    timed = times[1:] or times
    return {"s": median(timed), "n": len(timed), "steps": steps}

