"""engine.model.batch.build_step's host inputs: one packed host-to-device copy (pinned and non-blocking on CUDA, so the
host never waits for the device there), unpacked into the step's small tensors and every group's page table."""

from __future__ import annotations

import torch

from engine.loading.make_model import PRESETS
from engine.model.batch import PART_ALIGN, build_step
from engine.model.cache import CacheConfig, CachePool
from engine.model.config import ModelConfig


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


def _paged(table_row: list[int], page_rows: int, entry: int) -> int:
    page = min(entry // page_rows, max(len(table_row), 1) - 1)
    return (table_row[page] if table_row else 0) * page_rows + entry % page_rows


def _expected_sources(pos, start, cu_b, page, page_rows, ring_rows, total):
    """One SourceRows element by its definition: (from_chunk, chunk_row, ring_row, valid, row)."""
    from_chunk = pos >= start
    chunk_row = cu_b + pos - start if from_chunk else 0
    ring_row = page * page_rows + max(pos, 0) % ring_rows
    return from_chunk, chunk_row, ring_row, pos >= 0, total + chunk_row if from_chunk else ring_row


def _as_lists(src):
    return [
        src.from_chunk.tolist(),
        src.chunk_row.tolist(),
        src.ring_row.tolist(),
        src.valid.tolist(),
        src.row.tolist(),
    ]


def test_build_step_index_sets_match_their_definitions():
    """Every index set of a mixed step (a prompt from 0, a chunk deep into a sequence, short chunks, a decode token),
    element by element against Python loops over its definition (the host-built numpy parts and the device-built
    SWA / visible sets alike)."""
    pool = _pool()
    cfg = pool.cfg
    lengths = [(0, 130), (256, 21), (40, 3), (7, 1)]
    tables = []
    for start, n in lengths:
        t: dict = {}
        pool.grow(t, start + n)
        tables.append(t)
    token_ids = [[5] * n for _, n in lengths]
    batch = build_step(pool, token_ids, [s for s, _ in lengths], tables, [0], "cpu")
    cu = [0]
    for _, n in lengths:
        cu.append(cu[-1] + n)
    spec = {name: g.spec for name, g in pool.groups.items()}
    total = {name: s.num_pages * s.page_rows for name, s in spec.items()}

    # SWA sources [T, window] and the ring write
    window, swa = cfg.sliding_window, spec["swa"]
    want = [[], [], [], [], []]
    writes = ([], [])
    for b, (start, n) in enumerate(lengths):
        page = tables[b]["swa"][0]
        for p in range(start, start + n):
            row = [
                _expected_sources(p - window + 1 + j, start, cu[b], page, swa.page_rows, window, total["swa"])
                for j in range(window)
            ]
            for f in range(5):
                want[f].append([r[f] for r in row])
        for p in range(max(start, start + n - window), start + n):
            writes[0].append(cu[b] + p - start)
            writes[1].append(page * swa.page_rows + p % window)
    assert _as_lists(batch.swa) == want
    assert (batch.swa_write.chunk_row.tolist(), batch.swa_write.ring_row.tolist()) == writes

    # compressor plans: each closing window's sources (this and the previous window), entry row, state ring write
    groups = [(f"kv{r}", f"state{r}", r, r == 4) for r in cfg.ratios] + [("index", "index_state", 4, True)]
    for entry, state, ratio, overlap in groups:
        plan, st = batch.compress[entry], spec[state]
        cur, prev, rows, pos0, sw = [[], [], [], [], []], [[], [], [], [], []], [], [], ([], [])
        for b, (start, n) in enumerate(lengths):
            page = tables[b][state][0]
            for w in range(start // ratio, (start + n) // ratio):
                for out, shift in ((cur, 0), (prev, ratio)):
                    row = [
                        _expected_sources(
                            w * ratio + k - shift, start, cu[b], page, st.page_rows, st.page_rows, total[state]
                        )
                        for k in range(ratio)
                    ]
                    for f in range(5):
                        out[f].append([r[f] for r in row])
                rows.append(_paged(tables[b].get(entry, []), spec[entry].page_rows, w))
                pos0.append(w * ratio)
            for p in range(max(start, start + n - st.page_rows), start + n):
                sw[0].append(cu[b] + p - start)
                sw[1].append(page * st.page_rows + p % st.page_rows)
        assert plan.num_entries == len(rows), entry
        assert _as_lists(plan.cur) == cur, entry
        assert (plan.prev is not None) == overlap and (not overlap or _as_lists(plan.prev) == prev), entry
        assert plan.entry_row.tolist() == rows and plan.entry_pos.tolist() == pos0, entry
        assert (plan.state_write.chunk_row.tolist(), plan.state_write.ring_row.tolist()) == sw, entry

    # visible entries of the groups every query attends to in full (HCA) or scores (the indexer): per request
    # rows [B, E] and per token counts [T] (nothing [T, E]); an entry past a request's pages is unspecified
    # beyond being a real row
    for name, ratio in (("kv128", 128), ("index", 4)):
        width = max(1, max(s + n for s, n in lengths) // ratio)
        vis = batch.visible[name]
        assert vis.rows.shape == (len(lengths), width) and vis.count.shape == batch.positions.shape, name
        counts = []
        for b, (start, n) in enumerate(lengths):
            counts += [(p + 1) // ratio for p in range(start, start + n)]
            known = (start + n) // ratio  # entries visible to its last token
            want = [_paged(tables[b].get(name, []), spec[name].page_rows, e) for e in range(min(width, known))]
            assert vis.rows[b, : len(want)].tolist() == want, name
        assert vis.count.tolist() == counts and torch.equal(vis.seg, batch.seq_of_token), name
        assert int(vis.rows.min()) >= 0, name  # invalid entries still name real rows (every consumer masks them)
        assert torch.equal(vis.token_valid(), torch.arange(width) < vis.count.unsqueeze(1)), name
        assert torch.equal(vis.token_rows(), vis.rows[batch.seq_of_token]), name
    assert "kv4" not in batch.visible
