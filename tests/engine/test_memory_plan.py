"""KV-pool sizing (engine.loading.memory_plan): the override, the CPU default and the GPU-memory arithmetic.

The CUDA branch's arithmetic is checked here with `torch.cuda.mem_get_info` answering fixed numbers; on a GPU the
real call runs in tests/engine/test_gpu_engine.py-style loads (every LLM on CUDA logs its plan)."""

import dataclasses

import pytest
import torch

from engine.loading.make_model import preset_config
from engine.loading.memory_plan import GIB, activation_reserve, plan_kv_tokens, pool_bytes
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig

CFG = ModelConfig.from_dict(preset_config("small"))
CACHE = CacheConfig(max_requests=8, max_tokens=1, page_tokens=256)


def test_pool_bytes_affine_in_tokens():
    b = [pool_bytes(CFG, dataclasses.replace(CACHE, max_tokens=t), torch.bfloat16) for t in (0, 256 * 64, 256 * 128)]
    assert b[0] > 0 and b[2] - b[1] == b[1] - b[0] > 0


def test_override_and_cpu_default():
    plan = plan_kv_tokens(CFG, CACHE, torch.float32, "cpu", 2048, None, 12345)
    assert plan.tokens == 12345 and "max-cached-tokens" in plan.source
    plan = plan_kv_tokens(CFG, CACHE, torch.float32, "cpu", 2048)
    assert plan.tokens == 1 << 16 and "CPU" in plan.source


def test_gpu_budget_arithmetic(monkeypatch):
    total, used = 80 * GIB, 30 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - used, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: used)
    cfg = dataclasses.replace(CFG, max_position_embeddings=1 << 24)  # so the memory, not the cap, binds
    plan = plan_kv_tokens(cfg, CACHE, torch.bfloat16, "cuda", 2048, 0.5)
    budget = 0.5 * total - used - activation_reserve(cfg, 2048, CACHE.max_requests)
    assert plan.tokens % CACHE.page_tokens == 0
    assert plan.pool_bytes <= budget
    bigger = pool_bytes(cfg, dataclasses.replace(CACHE, max_tokens=plan.tokens + CACHE.page_tokens), torch.bfloat16)
    assert bigger > budget - 2 * len(CFG.ratios) * 1e6  # within a page or two of the budget
    assert "--gpu-memory-utilization 0.50" in plan.source and "requests" in plan.describe(cfg, 8)
    capped = plan_kv_tokens(CFG, CACHE, torch.bfloat16, "cuda", 2048, 0.9)
    assert capped.tokens == CACHE.max_requests * CFG.max_position_embeddings and "capped" in capped.source
    with pytest.raises(ValueError, match="leaves no room"):
        plan_kv_tokens(cfg, CACHE, torch.bfloat16, "cuda", 2048, 0.3)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_tokens(cfg, CACHE, torch.bfloat16, "cuda", 2048, 1.5)


def test_speculation_reserves_its_verify_steps_and_buffers():
    """With K drafts a decode step is a verify step of K + 1 rows a request, and speculation keeps its verify / MTP
    graphs' outputs and sampled drafts' distributions: the reserve grows by at least those buffers, and by nothing
    without speculation."""
    from engine.loading.memory_plan import speculative_buffers

    cfg, seqs = CFG, 64
    assert speculative_buffers(cfg, seqs, 0) == 0
    base = activation_reserve(cfg, 256, seqs)
    for k in (1, 3):
        extra = activation_reserve(cfg, 256, seqs, speculative_tokens=k) - base
        assert extra >= speculative_buffers(cfg, seqs, k) > speculative_buffers(cfg, seqs, k - 1)
        assert speculative_buffers(cfg, seqs, k) >= seqs * (k + 1) * cfg.vocab_size * 4  # fp32 verify logits


def test_prefill_graphs_reserve_their_pool(monkeypatch):
    """Prefill steps under CUDA graphs keep one bucket's activations in the graphs' own pool: the reserve grows by
    `prefill_graph_pool` with them ($DSV4_PREFILL_GRAPHS or the argument), by nothing without."""
    from dsv4_kernels.settings import PREFILL_GRAPHS, reload
    from engine.loading.memory_plan import prefill_graph_pool

    base = activation_reserve(CFG, 2048, 8, prefill_graphs=False)
    pool = prefill_graph_pool(CFG, 2048, 8)
    assert pool > 2048 * CFG.vocab_size * 4 // 16  # at least the activations of the largest bucket's tokens
    assert activation_reserve(CFG, 2048, 8, prefill_graphs=True) - base == pool
    assert activation_reserve(CFG, 2048, 8, True, prefill_graphs=True) - activation_reserve(CFG, 2048, 8, True) > pool
    monkeypatch.setenv(PREFILL_GRAPHS, "1")
    reload()
    try:
        assert activation_reserve(CFG, 2048, 8) - base == pool
    finally:
        monkeypatch.delenv(PREFILL_GRAPHS)
        reload()
    assert activation_reserve(CFG, 2048, 8) == base
