"""The tensor-parallel engine's GPU path on ONE GPU: TP 2 (with and without expert parallelism) against TP 1.

NCCL refuses two ranks on one device, so the ranks here share the GPU over gloo with host-copied collectives
(DSV4_TP_BACKEND=gloo, engine.parallel): slow and without CUDA graphs, but every GPU kernel runs on the local
shapes a rank sees (wq_b / sink by head, wo_a by output group, row-parallel wo_b, vocab-parallel head; FlashMLA
over 32 local heads padded to 64; DeepGEMM on the cut FP8 weights; triton_kernels on E/2 experts with -1 ids).
Model: `mini_v4` (FP8 dense + MXFP4 experts on disk), bf16, default fp8 KV cache. Greedy tokens and logprobs
are compared with TP 1 up to the first differing token (bf16 sums in another order may flip a near-tie).

Usage: PYTHONPATH=. python3 scripts/check_gpu_tp.py [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(model_dir: str, prompts, n: int, tp: int, ep: bool) -> list:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    with LLM(model_dir=model_dir, device="cuda", dtype="bfloat16", max_cached_tokens=16384, tensor_parallel_size=tp,
             expert_parallel=ep) as llm:
        mode = llm.engine.decode_mode
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True))
        kv = "fp8" if llm.engine.pool.groups["swa"].quantised else "exact"
    print(f"tp {tp}{' + ep' if ep else ''}: decode {mode}, kv cache {kv}", flush=True)
    return outs


def compare(ref, got) -> tuple[int, int, float]:
    """-> (positions compared, outputs identical, max |dlogprob| up to the first differing token)."""
    pos, same, worst = 0, 0, 0.0
    for a, b in zip(ref, got):
        same += a.token_ids == b.token_ids
        for ta, tb, x, y in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            pos += 1
            worst = max(worst, abs(x - y))
            if ta != tb:
                break
    return pos, same, worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    os.environ["DSV4_TP_BACKEND"] = "gloo"  # read by the spawned ranks too
    from engine.make_model import make_model

    model_dir = make_model("mini_v4", tempfile.mkdtemp(prefix="dsv4-tp-"), quantize=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 4000, (k,), generator=g).tolist() for k in (9, 150, 700)]
    ref = run(model_dir, prompts, args.tokens, 1, False)
    status = 0
    for ep in (False, True):
        pos, same, worst = compare(ref, run(model_dir, prompts, args.tokens, 2, ep))
        ok = worst < 0.1 and pos >= args.tokens
        status |= not ok
        print(f"[gpu tp] tp 2{' + ep' if ep else ''} vs tp 1: {same}/{len(prompts)} outputs identical, {pos} positions "
              f"compared, max |dlogprob| {worst:.3e} -> {'ok' if ok else 'MISMATCH'}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
