"""Where a slice prefill step's host time goes: every host-device synchronisation (with the Python line that caused
it) and the host functions by cumulative time, for one warm prefill of the V4-Flash slice.

A prefill step of 8K tokens runs ~57 ms of kernels in ~66 ms of wall time (BENCHMARKS prefill_formats): the rest is
host work the GPU waits for, before its first kernel and at every synchronisation (a blocking device-to-host copy:
`.item()`, `.tolist()`, a copy to pageable memory). This finds them: CUDA's sync debug mode reports every such call,
here with the Python stack that made it (deduplicated by the innermost project frame), and cProfile times the step's
host functions.

    python -m benchmarks.slice.prefill_host --tokens 8192 --experts mxfp4 [--layers 4]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time
import traceback
import warnings

import torch

from engine.execution.sampling_params import SamplingParams

from .slice_model import build_engine, flash_slice_config

PROJECT = ("engine/", "dsv4_kernels/", "kv_transfer/", "benchmarks/")


def prefill(core, cfg, tokens: int, seed: int) -> float:
    """One whole prefill of `tokens` random tokens -> wall seconds (synchronised at the end)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, cfg.vocab_size, (tokens,), generator=g).tolist()
    t = time.perf_counter()
    rid = core.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), request_id=f"p{seed}")
    while core.has_work:
        core.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    core.pop_finished(rid)
    return wall


def syncs(core, cfg, tokens: int, seed: int) -> collections.Counter:
    """The synchronisations of one prefill -> Counter of the project frames (file:line function) that made them."""
    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if any(p in f.filename for p in PROJECT)]
        where = " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
        seen[where or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            prefill(core, cfg, tokens, seed)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return seen


def _short(path: str) -> str:
    for p in PROJECT:
        if p in path:
            return p + path.split(p, 1)[1]
    return path


def host_profile(core, cfg, tokens: int, seed: int, top: int) -> str:
    """cProfile of one prefill -> the top functions by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    prefill(core, cfg, tokens, seed)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", default="mxfp4", help="routed experts' format (slice_model.EXPERT_FORMATS)")
    ap.add_argument("--dense", default="fp8")
    ap.add_argument("--top", type=int, default=45, help="host functions listed")
    args = ap.parse_args(argv)
    raw = flash_slice_config(args.layers)
    cfg, core = build_engine(
        raw, "cuda", torch.bfloat16, max_requests=4, max_tokens=4 * args.tokens, prefill_tokens=args.tokens,
        seed=0, expert_chunk=16, experts=args.experts, dense=args.dense,
    )  # fmt: skip
    walls = [prefill(core, cfg, args.tokens, seed) for seed in range(3)]  # warm-up: compiles, allocator
    print(f"prefill {args.tokens} tokens ({args.experts} experts): {', '.join(f'{w * 1e3:.1f}' for w in walls)} ms")
    found = syncs(core, cfg, args.tokens, 10)
    print(f"synchronisations in one prefill: {sum(found.values())} at {len(found)} places")
    for where, n in found.most_common():
        print(f"  {n:3d}x {where}")
    print(host_profile(core, cfg, args.tokens, 11, args.top))


if __name__ == "__main__":
    main()
