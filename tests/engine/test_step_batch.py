"""engine.batch.build_step's host inputs: one packed host-to-device copy (pinned and non-blocking on CUDA, so the
host never waits for the device there), unpacked into the step's small tensors and every group's page table."""

from __future__ import annotations

import torch

from engine.batch import PART_ALIGN, build_step
from engine.cache import CacheConfig, CachePool
from engine.config import ModelConfig
from engine.make_model import PRESETS


def _pool():
    cfg = ModelConfig.from_dict(PRESETS["tiny"])
    return CachePool(cfg, CacheConfig(max_requests=4, max_tokens=2048, page_tokens=64), torch.float32, "cpu")


def test_build_step_unpacks_tokens_and_padded_page_tables():
    pool = _pool()
    lengths = [(0, 130), (40, 3), (7, 1)]  # (start, tokens): a long prefill chunk, a short one, a decode token
    tables = []
    for start, n in lengths:
        t: dict = {}
        pool.grow(t, start + n)
        tables.append(t)
    g = torch.Generator().manual_seed(0)
    token_ids = [torch.randint(2, 400, (n,), generator=g).tolist() for _, n in lengths]
    batch = build_step(pool, token_ids, [s for s, _ in lengths], tables, [129, 132, 133], "cpu")
    assert batch.token_ids.tolist() == [t for ids in token_ids for t in ids]
    assert batch.cu.tolist() == [0, 130, 133, 134] and batch.logit_rows.tolist() == [129, 132, 133]
    assert batch.starts.tolist() == [0, 40, 7] and batch.ends.tolist() == [130, 43, 8]
    assert batch.positions.tolist() == list(range(130)) + [40, 41, 42, 7]
    assert set(batch.tables) == set(pool.groups)
    base = batch.token_ids.untyped_storage().data_ptr()
    for name, table in batch.tables.items():
        rows = [t.get(name, []) for t in tables]
        width = max(1, max(len(r) for r in rows))
        want = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        assert torch.equal(table, want), name
        assert table.is_contiguous() and (table.data_ptr() - base) % (8 * PART_ALIGN) == 0, name
