"""The CUDA engine with its routed MXFP4 experts through Marlin (DSV4_MXFP4_MOE_BACKEND=marlin) against the same
engine through triton_kernels (the default), on one quantised checkpoint (FP8 dense, MXFP4 experts, mini_v4).

Both are judged, teacher-forced on their own tokens (prompt log-probs: prefill-sized MoE calls; generated ones:
decode-sized calls under CUDA graphs), against one reference: the same checkpoint with the experts dequantised
to bf16 (grouped GEMM) and the same FP8 dense path, so only the expert GEMMs' rounding differs. These random
models amplify rounding (BENCHMARKS.md, "Hopper fast paths end to end": FP8 activations alone move the mean by
0.15 nats), so the check is relative, as tests/engine/test_gpu_fp8_engine.py's: Marlin's mean |dlogprob| is at
most 1.5x (+0.02) the default backend's. The kernel itself is checked against the reference experts in
tests/kernels/test_marlin_moe.py (bf16 tolerance).
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.gpu import has_marlin_moe, has_triton_kernels, why_not, why_not_marlin_moe

if not torch.cuda.is_available() or not has_marlin_moe() or not has_triton_kernels():
    pytest.skip(
        "GPU only: needs a CUDA device, the Marlin MoE wheel (tools/device_wheels/marlin_wheel.py) and "
        "triton_kernels: " + (why_not_marlin_moe() or why_not("triton_kernels.matmul") or "no CUDA device"),
        allow_module_level=True,
    )

from engine.execution.sampling_params import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.make_model import make_model  # noqa: E402
from engine.model.fast_paths import MOE_BACKEND_ENV  # noqa: E402

pytestmark = pytest.mark.gpu


def _run(monkeypatch, model_dir, backend: str, prompts):
    monkeypatch.setenv(MOE_BACKEND_ENV, backend)
    llm = LLM(model_dir=model_dir, device="cuda", dtype="bfloat16")
    assert f"routed experts: packed MXFP4, {backend}" in llm.engine.model.fast_paths, llm.engine.model.fast_paths
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    outs = llm.generate(prompts, params)
    took = [m.marlin is not None for m in llm.engine.model.moe if m.mxfp4]
    assert took and all(took) == (backend == "marlin")  # Marlin's tiles were built: its kernel ran
    assert llm.engine.decode_mode == "graphs" and llm.engine.decode_runner.graphs
    return outs


def _diffs(reference: LLM, outs) -> list[float]:
    """|dlogprob| of each prompt and generated position against `reference`, teacher-forced on outs' tokens."""
    seqs = [list(o.prompt_token_ids) + list(o.token_ids[:-1]) for o in outs]
    refs = reference.generate(seqs, SamplingParams(max_new_tokens=1, prompt_logprobs=True))
    diffs = []
    for o, r in zip(outs, refs):
        got = list(o.prompt_logprobs[1:]) + list(o.logprobs)
        diffs += [abs(a - b) for a, b in zip(got, r.prompt_logprobs[1 : len(got) + 1])]
    return diffs


def test_marlin_engine_adds_no_error_beyond_the_default_backend(tmp_path, monkeypatch):
    model_dir = make_model("mini_v4", str(tmp_path), seed=0, quantize=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 4096, (n,), generator=g).tolist() for n in (5, 40, 200)]
    runs = {backend: _run(monkeypatch, model_dir, backend, prompts) for backend in ("triton_kernels", "marlin")}
    monkeypatch.delenv(MOE_BACKEND_ENV)
    reference = LLM(model_dir=model_dir, device="cuda", dtype="bfloat16", keep_mxfp4_experts=False)
    assert "routed experts: dequantised" in reference.engine.model.fast_paths
    mean = {}
    for backend, outs in runs.items():
        diffs = _diffs(reference, outs)
        mean[backend] = sum(min(d, 10.0) for d in diffs) / len(diffs)
        print(
            f"[gpu marlin] {backend} vs dequantised experts, teacher-forced: {len(diffs)} positions, "
            f"{sum(d <= 0.1 for d in diffs) / len(diffs):.4f} within 0.1, mean {mean[backend]:.2e}, "
            f"max {max(diffs):.2e}"
        )
    assert mean["marlin"] <= 1.5 * mean["triton_kernels"] + 0.02, mean
