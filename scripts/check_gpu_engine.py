"""GPU engine check (run on a CUDA machine): greedy tokens of the GPU engine vs the CPU fp32 engine.

Prints the share of greedy positions where the GPU run (bf16 and fp32) agrees with CPU fp32 and the
mean/max |logprob| difference on the agreeing prefix. Not a test: CI has no GPU.
"""

import argparse
import sys
import tempfile

import torch

from engine.llm import LLM
from engine.make_model import make_model
from engine.sampling_params import SamplingParams


def compare(model_dir: str, dtype: str, prompts, n: int) -> tuple[float, float, float]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True)
    cpu = LLM(model_dir, device="cpu", dtype="float32").generate(prompts, params)
    gpu = LLM(model_dir, device="cuda", dtype=dtype).generate(prompts, params)
    agree = total = 0
    diffs = []
    for c, g in zip(cpu, gpu):
        for i, (a, b) in enumerate(zip(c.token_ids, g.token_ids)):
            total += 1
            if a != b:
                break  # after a divergence the contexts differ; count the rest as disagreeing
            agree += 1
            diffs.append(abs(c.logprobs[i] - g.logprobs[i]))
    d = torch.tensor(diffs or [0.0])
    return agree / total, d.mean().item(), d.max().item()


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
    print("| preset | dtype | greedy agreement vs CPU fp32 | mean abs dlogprob | max abs dlogprob |")
    print("|---|---|---|---|---|")
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as d:
            make_model(preset, d, seed=1)
            vocab = LLM(d).config.vocab_size
            prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 33, 130, 300)]
            for dtype in ("float32", "bfloat16"):
                share, mean, mx = compare(d, dtype, prompts, args.tokens)
                print(f"| {preset} | {dtype} | {share:.3f} | {mean:.2e} | {mx:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
