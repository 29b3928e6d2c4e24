"""The sync-free grouped-GEMM MoE equals the per-expert reference, alone and inside the engine."""

import pytest
import torch

from dsv4_kernels.moe import has_grouped_mm, moe_experts, moe_experts_grouped

pytestmark = pytest.mark.skipif(not has_grouped_mm(), reason="torch._grouped_mm is not available")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32])
def test_grouped_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 37, 64, 32, 8, 3
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w1, w3 = (torch.randn(e, i, h, generator=g).mul(0.2).to(DEVICE, dtype) for _ in range(2))
    w2 = torch.randn(e, h, i, generator=g).mul(0.2).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(e - 2, generator=g)[:k] for _ in range(t)]).to(DEVICE)  # 2 experts unused
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    ref = moe_experts(x, weights, ids, w1, w2, w3, 1.5)
    out = moe_experts_grouped(x, weights, ids, w1, w2, w3, 1.5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_engine_with_grouped_moe_matches_reference(monkeypatch):
    from engine.execution.sampling_params import SamplingParams
    from engine.llm import LLM

    prompts = [list(range(3, 40)), [5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True)
    monkeypatch.setenv("DSV4_GROUPED_MOE", "0")
    want = LLM().generate(prompts, params)
    monkeypatch.setenv("DSV4_GROUPED_MOE", "1")
    got = LLM().generate(prompts, params)
    for w, o in zip(want, got):
        assert o.token_ids == w.token_ids
        assert o.logprobs == pytest.approx(w.logprobs, abs=1e-4)
