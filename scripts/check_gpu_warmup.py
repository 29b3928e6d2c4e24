"""GPU check of engine.warmup: per-request times of a cold engine against a warmed one, each in a fresh process
with empty DeepGEMM and Triton caches (so every compile shows).

    python3 scripts/check_gpu_warmup.py --model DIR [--requests 12] [--warmup 0|1]

Prints one line per request: prompt length, prefill step ms (its first step, the time to first token without
queueing), the slowest decode step ms; then the medians and maxima. Run once with --warmup 0 and once with 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--warmup", default="1", choices=["0", "1"])
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="dsv4-warm-")
    os.environ["DSV4_WARMUP"] = args.warmup
    os.environ.setdefault("DSV4_MXFP4_MOE", "1")
    os.environ["DG_JIT_CACHE_DIR"] = os.path.join(cache, "deep_gemm")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    import logging

    import torch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from engine.llm import load_engine
    from engine.sampling_params import SamplingParams

    t = time.perf_counter()
    core = load_engine(args.model, device="cuda", dtype="bfloat16", max_batch_tokens=args.max_batch_tokens,
                       max_num_seqs=16, max_cached_tokens=65536)
    print(f"load_engine (warm-up {args.warmup}): {time.perf_counter() - t:.1f} s", flush=True)
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
        print(f"request {i}: prompt {n}, first step {steps[0]:.1f} ms, slowest decode step {worst[-1]:.1f} ms",
              flush=True)
    print(f"warm-up {args.warmup}: first step median {statistics.median(firsts):.1f} ms, max {max(firsts):.1f} ms; "
          f"slowest decode step median {statistics.median(worst):.1f} ms, max {max(worst):.1f} ms")


if __name__ == "__main__":
    main()
