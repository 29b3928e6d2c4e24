"""The CUDA bf16 engine on FP8 projections through DeepGEMM (dsv4_kernels.deepgemm_linear) against transformers.

The oracle runs the same FP8-rounded weights with exact fp32 activations (tests.support.fp8_oracle), so the
engine's error is its bf16 arithmetic plus the 1x128 FP8 activation quantisation (e4m3 keeps 3 mantissa bits,
16x bf16's step; see tests.support.fp8_oracle for how sensitive badly conditioned random models are to it).
Asserted:
- the bf16 engine on the dequantised weights and the FP8 engine (DeepGEMM, CUDA graphs) both stay within the
  bf16 tolerances of test_gpu_engine (share within 0.1 nats, mean |dlogprob|);
- the FP8 engine adds no error beyond the reference FP8 function: its mean |dlogprob| against the oracle is at
  most 1.5x (+0.02) that of the CPU fp32 engine on dsv4_kernels.fp8_linear's reference.
The three figures are printed ("[gpu fp8 oracle]") for BENCHMARKS.md.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.gpu import has_deep_gemm, why_not

if not torch.cuda.is_available() or not has_deep_gemm():
    pytest.skip(
        "GPU only: the FP8 GEMM path needs a CUDA device with deep_gemm (pip install '.[gpu]'): "
        + (why_not("deep_gemm") or "no CUDA device"),
        allow_module_level=True,
    )

from dsv4_kernels.fp8_linear import Fp8Weight  # noqa: E402
from engine.execution.sampling_params import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from tests.support.fp8_oracle import make_fp8_pair, oracle_diffs, prompts  # noqa: E402

pytestmark = pytest.mark.gpu
TOL, SHARE_MIN, MEAN_MAX = 0.1, 0.95, 0.03  # bf16 engine tolerances (test_gpu_engine.ORACLE_TOL)


def test_fp8_engine_matches_oracle(tmp_path):
    oracle_dir, fp8_dir = make_fp8_pair(tmp_path)
    prompt_list = prompts()
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    stats = {}
    runs = (
        ("bf16 engine, bf16 weights", oracle_dir, "cuda", "bfloat16"),
        ("bf16 engine, fp8 DeepGEMM", fp8_dir, "cuda", "bfloat16"),
        ("fp32 CPU engine, fp8 reference", fp8_dir, "cpu", "float32"),
    )
    for label, model_dir, device, dtype in runs:
        llm = LLM(model_dir=model_dir, device=device, dtype=dtype, keep_fp8_weights=model_dir == fp8_dir)
        fp8 = isinstance(llm.engine.model.attn[0].w["wq_a.weight"], Fp8Weight)
        assert fp8 == (model_dir == fp8_dir), llm.engine.model.fast_paths
        diffs = oracle_diffs(oracle_dir, prompt_list, llm.generate(prompt_list, params))
        if device == "cuda":
            assert llm.engine.decode_mode == "graphs" and llm.engine.decode_runner.graphs
        share = sum(d <= TOL for d in diffs) / len(diffs)
        mean = sum(min(d, 10.0) for d in diffs) / len(diffs)
        stats[label] = (share, mean)
        print(
            f"[gpu fp8 oracle] {label}: {len(diffs)} positions, {share:.4f} within {TOL}, mean {mean:.2e}, "
            f"max {max(diffs):.2e}; {llm.engine.model.fast_paths}"
        )
    for label in ("bf16 engine, bf16 weights", "bf16 engine, fp8 DeepGEMM"):
        share, mean = stats[label]
        assert share >= SHARE_MIN and mean <= MEAN_MAX, (label, share, mean)
    ref_mean = stats["fp32 CPU engine, fp8 reference"][1]
    assert stats["bf16 engine, fp8 DeepGEMM"][1] <= 1.5 * ref_mean + 0.02, stats
