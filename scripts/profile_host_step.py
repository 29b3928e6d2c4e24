"""Where a prefill step's host time goes: cProfile of `EngineCore.step()` on a model whose GPU work is small.

On the H200 the mini model's (4 layers, V4 attention geometry) prefill step of 256-2048 tokens took 44-56 ms
(scripts/check_gpu_warmup.py), far above its GPU work: the step is bound by the host issuing its kernels. This
runs a few prompts of each length once to compile (use the compile caches of `gpu_issue11.sh coldstart` to make
that quick), then profiles the first (prefill) step of `--repeats` more and prints the step's wall time and the
functions with the most host time (own and cumulative).

    python3 scripts/profile_host_step.py --model DIR [--device cuda] [--tokens 256 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prefill_step(core, n: int, gen, sync, prof: cProfile.Profile | None = None) -> float:
    """Add a request of n random tokens, run its first step (the prefill, under `prof` if given) -> that step's
    ms; then finish the request."""
    import torch

    from engine.execution.sampling_params import SamplingParams

    rid = core.add_request(torch.randint(2, core.cfg.vocab_size, (n,), generator=gen).tolist(),
                           SamplingParams(max_new_tokens=2, ignore_eos=True))
    sync()
    if prof is not None:
        prof.enable()
    t = time.perf_counter()
    core.step()
    sync()
    ms = (time.perf_counter() - t) * 1e3
    if prof is not None:
        prof.disable()
    while core.has_work:
        core.step()
    core.pop_finished(rid)
    return ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from engine.loading.load import load_engine

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    core = load_engine(args.model, device=args.device, dtype="bfloat16" if cuda else "float32",
                       max_batch_tokens=max(args.tokens), max_num_seqs=8, max_cached_tokens=65536, warmup=False)
    gen = torch.Generator().manual_seed(0)
    lines = []
    for n in args.tokens:
        for _ in range(2):  # compiles (cache hits after coldstart) and first-call setup
            prefill_step(core, n, gen, sync)
        prof = cProfile.Profile()
        times = []
        bare = [prefill_step(core, n, gen, sync) for _ in range(args.repeats)]
        times = [prefill_step(core, n, gen, sync, prof) for _ in range(args.repeats)]
        lines.append(f"prefill step of {n} tokens: {statistics.median(bare):.1f} ms median without the profiler, "
                     f"{statistics.median(times):.1f} ms with it")
        for key in ("tottime", "cumtime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
            lines.append(f"--- {n} tokens, by {key}\n" + "\n".join(buf.getvalue().splitlines()[4:]))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
