"""Hopper fast paths end to end: a quantised `mini_v4` checkpoint loaded with the defaults keeps FP8 projections
(DeepGEMM) and MXFP4 experts (triton_kernels) and stays near the same checkpoint dequantised to bf16 and near the
defaults on an exact KV cache, teacher-forced on its own tokens (benchmarks/hopper_e2e.py measures; BENCHMARKS.md
section hopper_e2e). GPU only (CUDA + the `gpu` extra's DeepGEMM and triton_kernels).

Bound: the H200 run measured a mean |dlogprob| of 0.15 nats against the dequantised engine (FP8 activation rounding on
a random model); a wrongly cut or mis-scaled weight measures ~1 nat, so each reference must be within 0.3 on average.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.gpu import has_deep_gemm, has_triton_kernels

if not torch.cuda.is_available() or not has_deep_gemm() or not has_triton_kernels():
    pytest.skip(
        "GPU only: needs a CUDA device with deep_gemm and triton_kernels (pip install '.[gpu]')",
        allow_module_level=True,
    )

from benchmarks.hopper_e2e import measure  # noqa: E402

pytestmark = pytest.mark.gpu


def test_quantised_checkpoint_runs_the_hopper_paths_and_stays_close():
    got = measure("mini_v4", 16)
    print("\n".join(f"[gpu hopper e2e] {line}" for line in got["lines"]))
    assert "DeepGEMM" in got["fast_paths"], got["fast_paths"]
    assert got["ogs_layers"] == got["moe_layers"] > 0, got["lines"]
    assert got["gaps"], "no reference was compared"
    for label, (positions, _within, mean, _max) in got["gaps"].items():
        assert positions > 0 and mean <= 0.3, (label, got["gaps"][label])
