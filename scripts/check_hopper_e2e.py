"""Hopper fast paths end to end (run on a CUDA machine with the `gpu` extra): a quantised checkpoint (FP8 dense +
MXFP4 experts on disk) loaded with the defaults keeps its formats and runs DeepGEMM / triton_kernels; its
logprobs are compared, teacher-forced on its own tokens, with the same checkpoint dequantised to bf16.

Prints the lines and writes BENCHMARKS.md section `hopper_e2e` (`--no-write` to only print). Not a test: CI
has no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.llm import LLM  # noqa: E402
from engine.make_model import make_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from service.benchmarks_md import write_section  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    d = make_model(args.preset, tempfile.mkdtemp(), seed=0, quantize=True)
    g = torch.Generator().manual_seed(0)
    lens = (5, 40, 200)
    prompts = [torch.randint(4, 4096, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, prompt_logprobs=True, logprobs=True)
    fast = LLM(d, device="cuda", dtype="bfloat16")
    out = [f"fast: {fast.engine.model.fast_paths}"]
    a = fast.generate(prompts, params)
    moe = fast.engine.model.moe
    out.append(f"MoE layers on triton_kernels: {sum(m.ogs is not None for m in moe)} of {len(moe)}")
    ref = LLM(d, device="cuda", dtype="bfloat16", keep_mxfp4_experts=False, keep_fp8_weights=False)
    b = ref.generate([p + o.token_ids for p, o in zip(prompts, a)],
                     SamplingParams(max_new_tokens=1, prompt_logprobs=True))
    diffs = []
    for x, y in zip(a, b):
        fl = list(x.prompt_logprobs[1:]) + list(x.logprobs)
        diffs += [abs(u - v) for u, v in zip(fl, y.prompt_logprobs[1:len(fl) + 1])]
    within = sum(x <= 0.1 for x in diffs) / len(diffs)
    out.append(f"fast vs bf16-dequantised engine, teacher-forced on the fast tokens: {len(diffs)} positions, "
               f"{within:.3f} within 0.1, mean {sum(diffs) / len(diffs):.3e}, max {max(diffs):.3e}")
    print("\n".join(out))
    if not args.no_write:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        write_section("hopper_e2e", "\n".join([
            "## Hopper fast paths end to end: `scripts/check_hopper_e2e.py`", "",
            f"- `python scripts/check_hopper_e2e.py {' '.join(sys.argv[1:])}`, {when}, {torch.cuda.get_device_name()} "
            f"(torch {torch.__version__}); model `make_model({args.preset!r}, quantize=True)` (FP8 dense + MXFP4 "
            f"experts on disk, random weights); prompts of {'/'.join(map(str, lens))} tokens + {args.tokens} greedy "
            "tokens; the default load vs the same checkpoint dequantised to bf16, teacher-forced on the fast tokens. "
            "The gap is the FP8 rounding of activations, which the dequantised engine does not do.", "",
            "```", *out, "```"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
