"""Long context on bounded workspace (issue 35 item 2): the chunked, query-blocked engine agrees with the
unchunked one on a prompt that wraps every cache many times, and a long step's index tensors stay per request.

- Greedy agreement: a 2000-token prompt over a small config (window 8: the SWA ring wraps 250 times; ratios 4 and
  16 with 64-token pages: 125 kv16 / 500 kv4 and index entries over 32 pages each; compressor state rings wrap
  every 4 / 16 tokens) run in 192-token chunks with the indexer's score budget forced down to 32 queries a block,
  against the same prompt in one step at the default budget: every greedy token equal, prompt log-probs close.
- Workspace: build_step of an 8K-token chunk at the end of a 1M-token context (tiny preset with 1M positions) holds
  visible entries as [B, E] rows and [T] counts (the old [T, E] lists were 16 GiB per group there), and the
  memory plan's step workspace at 1M context fits a fixed budget.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.support.oracle import make_hf_checkpoint

PROMPT, N_GEN, CHUNK = 2000, 8, 192
LP_TOL, MIN_SHARE = 2e-3, 0.99


def _generate(model_dir: str, prompt: list[int], max_batch_tokens: int):
    from engine.execution.sampling_params import SamplingParams
    from engine.llm import LLM

    llm = LLM(
        model_dir=model_dir,
        device="cpu",
        dtype="float32",
        max_batch_tokens=max_batch_tokens,
        max_num_seqs=2,
        page_tokens=64,
        prefix_cache=False,
    )
    try:
        params = SamplingParams(
            max_new_tokens=N_GEN, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=True
        )
        return llm.generate([prompt], [params])[0]
    finally:
        llm.close()


def test_long_prompt_chunked_and_blocked_matches_one_step(tmp_path, monkeypatch):
    import engine.model.attention as attention

    model_dir = make_hf_checkpoint(
        tmp_path / "ckpt",
        seed=21,
        compress_ratios=[4, 16, 0, 4],
        sliding_window=8,
        index_topk=4,
        index_n_heads=16,
        num_hash_layers=1,
        yarn=None,
        max_position_embeddings=4096,
    )
    prompt = torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(7)).tolist()
    whole = _generate(model_dir, prompt, 4096)
    blocked = []
    real = attention.visible_topk
    # 32 queries a block at the 500 index entries of the prompt's end: a 192-token chunk is 6 blocks
    monkeypatch.setattr(attention, "SCORES_BUDGET", 4 * (PROMPT // 4) * 32)
    monkeypatch.setattr(attention, "visible_topk", lambda *a, **kw: blocked.append(a[0].shape[0]) or real(*a, **kw))
    chunked = _generate(model_dir, prompt, CHUNK)
    assert max(blocked) == CHUNK  # the chunked run really ran chunks (and decode steps of one token)
    assert chunked.token_ids == whole.token_ids
    pairs = [
        (a, b)
        for a, b in zip(chunked.prompt_logprobs[1:] + chunked.logprobs, whole.prompt_logprobs[1:] + whole.logprobs)
    ]
    diffs = [abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf for a, b in pairs]
    share = sum(d <= LP_TOL for d in diffs) / len(diffs)
    assert share >= MIN_SHARE, (share, max(diffs))


def test_long_step_visible_entries_are_per_request():
    from engine.loading.make_model import preset_config
    from engine.model.batch import build_step
    from engine.model.cache import CacheConfig, CachePool
    from engine.model.config import ModelConfig

    context, chunk = 1 << 20, 8192
    raw = preset_config("tiny")
    raw["max_position_embeddings"] = context
    cfg = ModelConfig.from_dict(raw)
    pool = CachePool(cfg, CacheConfig(max_requests=1, max_tokens=context), torch.float32, "cpu")
    pages: dict = {}
    pool.grow(pages, context)
    start = context - chunk
    batch = build_step(pool, [[1] * chunk], [start], [pages], [chunk - 1], "cpu")
    for name, ratio in (("index", 4), ("kv128", 128)):
        vis = batch.visible[name]
        assert vis.rows.shape == (1, context // ratio) and vis.count.shape == (chunk,), name
        assert vis.count[0] == (start + 1) // ratio and vis.count[-1] == context // ratio, name

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif hasattr(obj, "__dataclass_fields__"):
            for f in obj.__dataclass_fields__:
                yield from tensors(getattr(obj, f))

    largest = max(t.numel() * t.element_size() for t in tensors(batch))
    assert largest <= 8 * context // 4, largest  # the index group's [1, 262144] rows; [T, E] would be 16 GiB


def test_step_workspace_is_bounded_at_1m_context():
    from dsv4_kernels.indexer import SCORES_BUDGET, query_blocks
    from engine.loading.make_model import preset_config
    from engine.loading.memory_plan import GIB, step_workspace
    from engine.model.config import ModelConfig

    raw = preset_config("tiny")
    raw["max_position_embeddings"] = 1 << 20
    cfg = ModelConfig.from_dict(raw)
    ws = step_workspace(cfg, 8192, 16)
    assert ws.scores <= SCORES_BUDGET + 8 * 8192 * cfg.index_topk
    assert ws.visible == 8 * 16 * ((1 << 18) + (1 << 13))
    assert ws.hca_lists == 25 * 8192 * (1 << 13)  # the fp8 prefill path's per-token HCA lists (not yet per request)
    assert ws.total - ws.hca_lists < GIB, ws.describe()
    assert len(query_blocks(8192, 1 << 18)) == 32  # 256 queries a block at 1M context
    assert np.all(np.diff([a for a, _ in query_blocks(8192, 1 << 18)]) == 256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: peak memory of a 1M-context indexer step")
def test_indexer_step_at_1m_context_peak_memory_is_bounded():
    """An 8K-query chunk at the end of a 1M context (V4-Flash's 64 x 128 index heads, FP8 paged keys, one
    request): what the call allocates beyond its inputs is one query block's fp32 scores (SCORES_BUDGET: 256
    queries x 262144 entries = 256 MiB), the int64 picks [T, 512] (32 MiB) and torch.topk's per-block outputs and
    radix-select scratch (values + indices [256, 512]: 1.5 MiB; its scratch a few MiB), bounded here by 32 MiB
    (the old [T, S] path needed 16 GiB of candidate rows and 8 GiB of scores). The H200 measured 545 MiB when
    the loop kept the previous block's scores alive while the next was scored (2 x 256 + 32 + 1): memory_plan's
    step_workspace counts one block + the picks."""
    from dsv4_kernels import geometry as g
    from dsv4_kernels.indexer import SCORES_BUDGET
    from dsv4_kernels.triton_indexer import indexer_topk

    dev, t, s, hi, di = torch.device("cuda"), 8192, 1 << 18, 64, 128
    layout = g.IndexerKeyLayout(index_head_dim=di, fmt="fp8", block_size=64)
    store = torch.randint(0, 120, (s // layout.block_size, layout.block_bytes()), dtype=torch.uint8, device=dev)
    rows = torch.randperm(s, device=dev).unsqueeze(0)
    count = torch.arange((1 << 20) - t, 1 << 20, device=dev) // 4 + 1
    q = torch.randn(t, hi, di, device=dev, dtype=torch.bfloat16)
    w = torch.randn(t, hi, device=dev) * hi**-0.5
    cu = torch.tensor([0, t], device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    picked = indexer_topk(
        q,
        store,
        rows,
        w,
        512,
        layout,
        cu_seqlens=cu,
        ordered=False,
        seg=torch.zeros(t, dtype=torch.long, device=dev),
        count=count,
    )
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert picked.shape == (t, 512) and bool((picked >= 0).all())
    assert peak <= SCORES_BUDGET + t * 512 * 8 + (32 << 20), peak / 2**20
