"""GPU engine check (run on a CUDA machine): greedy tokens of the GPU engine vs the CPU fp32 engine.

For each preset and GPU dtype, prints:
- free-running agreement: generated positions before the first divergence from the CPU run, over all
  generated positions (a divergence ends the count: the contexts differ after it);
- teacher-forced agreement: at every generated position, the GPU engine is given the CPU run's prefix
  (prompt + CPU tokens so far) and its greedy token is compared with the CPU's: the share of positions
  where the greedy choice is the same, which is what "greedy tokens on >= 95% of positions" asks;
- mean / max |logprob| difference over the positions before the first divergence.
The GPU engine runs with its defaults (Triton fast paths, CUDA-graph decode). Not a test: CI has no GPU.
"""

import argparse
import sys
import tempfile

import torch

from engine.llm import LLM
from engine.make_model import make_model
from engine.sampling_params import SamplingParams


def free_running(cpu, gpu) -> tuple[int, int, list[float]]:
    agree = total = 0
    diffs = []
    for c, g in zip(cpu, gpu):
        total += len(c.token_ids)
        for i, (a, b) in enumerate(zip(c.token_ids, g.token_ids)):
            if a != b:
                break
            agree += 1
            diffs.append(abs(c.logprobs[i] - g.logprobs[i]))
    return agree, total, diffs


def teacher_forced(llm: LLM, prompts, cpu) -> tuple[int, int]:
    """One 1-token request per (prompt, position), all in one batch."""
    seqs, want = [], []
    for p, c in zip(prompts, cpu):
        for i, t in enumerate(c.token_ids):
            seqs.append(list(p) + list(c.token_ids[:i]))
            want.append(t)
    outs = llm.generate(seqs, SamplingParams(max_new_tokens=1, ignore_eos=True))
    return sum(o.token_ids[0] == t for o, t in zip(outs, want)), len(want)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    g = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| preset | dtype | decode | free-running agreement | teacher-forced agreement | mean abs dlogprob "
          "| max abs dlogprob |")
    print("|---|---|---|---:|---:|---:|---:|")
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, logprobs=True)
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as d:
            make_model(preset, d, seed=1)
            cpu_llm = LLM(d, device="cpu", dtype="float32")
            vocab = cpu_llm.config.vocab_size
            prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 33, 130, 300)]
            cpu = cpu_llm.generate(prompts, params)
            del cpu_llm
            for dtype in ("float32", "bfloat16"):
                llm = LLM(d, device="cuda", dtype=dtype, max_num_seqs=256, max_cached_tokens=1 << 17)
                gpu = llm.generate(prompts, params)
                agree, total, diffs = free_running(cpu, gpu)
                forced, n = teacher_forced(llm, prompts, cpu)
                dl = torch.tensor(diffs or [0.0])
                print(f"| {preset} | {dtype} | {llm.engine.decode_mode} | {agree / total:.3f} | {forced / n:.3f} "
                      f"| {dl.mean().item():.2e} | {dl.max().item():.2e} |", flush=True)
                del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
