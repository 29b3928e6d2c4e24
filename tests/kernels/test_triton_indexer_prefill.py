"""Prefill-shaped Triton indexer logits + top-k (dsv4_kernels/triton_indexer_prefill.py) against dsv4_kernels.indexer.

Varlen steps built as engine.model.batch builds its visible index entries (one page table per sequence, entry w
visible to position p iff w < (p + 1) // 4), several sequences of different lengths, chunks starting
mid-sequence, exact and quantised (MXFP4 / FP8 paged) key stores. Runs compiled on a GPU when one is present,
else in triton's CPU interpreter (tiny sizes: the interpreter is slow).
"""

import pytest
import torch

from dsv4_kernels import geometry as g  # noqa: E402
from dsv4_kernels import indexer as ref  # noqa: E402
from dsv4_kernels import triton_indexer  # noqa: E402
from dsv4_kernels.triton_indexer import indexer_topk  # noqa: E402
from dsv4_kernels.triton_indexer_prefill import indexer_prefill_scores, prefill_blocks  # noqa: E402
from engine.model.batch import paged_rows, segment_arange  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

PAGE_ROWS, PAGES = 8, 24
# (start position, query count) per sequence: a prompt from 0 (its first 3 queries see nothing), a short
# chunk late in a long sequence (many visible entries, few queries), a chunk starting mid-sequence.
STEP = [(0, 37), (196, 5), (90, 22)]


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return NUM.randn(*shape, dtype=dtype, device=DEVICE, seed=seed, scale=scale)


def step_rows(step, seed, holes=0.0):
    """-> (rows int64 [T, S] as the engine passes them (-1 = invalid), cu_seqlens [B + 1]). holes: share of
    valid candidates additionally dropped (-1), to check the kernel relies on rows alone."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.tensor([s for s, _ in step])
    counts = torch.tensor([c for _, c in step])
    ends = starts + counts
    positions, seg = segment_arange(starts, counts)
    entries = max(1, int((ends // 4).max()))
    table = torch.randperm(PAGES, generator=gen)[: len(step) * 7].view(len(step), 7)  # distinct pages
    w = torch.arange(entries).unsqueeze(0).expand(positions.shape[0], -1)
    valid = w < ((positions + 1) // 4).unsqueeze(1)
    valid &= torch.rand(valid.shape, generator=gen) >= holes
    rows = torch.where(valid, paged_rows(table, PAGE_ROWS, seg.unsqueeze(1).expand_as(w), w), -1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
    return rows.to(DEVICE), cu.to(DEVICE)


def key_store(fmt, di, seed):
    """-> (store, layout, dense fp32 keys [R, Di] the store holds). Keys are random, never zero, over several
    binades per row so quantised rows get different scales."""
    slots = PAGES * PAGE_ROWS
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(slots, di, generator=gen) * torch.exp2(torch.randint(-3, 4, (slots, 1), generator=gen).float())
    if fmt == "exact":
        return values.to(DEVICE), None, values.to(DEVICE)
    layout = g.IndexerKeyLayout(index_head_dim=di, fmt=fmt, block_size=4)
    cache = torch.randint(
        0, 256, (slots // layout.block_size, layout.block_bytes() + 4), generator=gen, dtype=torch.uint8
    )
    g.write_rows(cache, layout, torch.arange(slots), g.pack_rows(layout, values))
    dense = g.unpack_rows(layout, g.read_rows(cache, layout, torch.arange(slots)))
    return cache.to(DEVICE), layout, dense.to(DEVICE)


def reference_scores(q, keys, rows, weights):
    scores = ref.indexer_scores(q, keys[rows.clamp(min=0)], weights)
    return scores.masked_fill(rows < 0, float("-inf"))


def assert_topk_equivalent(picked, expected, scores, tol):
    """Top-k ids equal the reference's except where the two candidates' reference scores tie within tol.

    picked, expected: int64 [T, k] (-1 padded); scores: the reference's fp32 [T, S] (-inf = invalid)."""
    assert picked.shape == expected.shape and picked.dtype == torch.int64
    assert torch.equal(picked < 0, expected < 0), "the -1 padding is exact"
    take = lambda ids: torch.where(ids >= 0, scores.gather(1, ids.clamp(min=0)), torch.zeros(()))  # noqa: E731
    got, want = take(picked), take(expected)
    assert torch.all(torch.isfinite(got)), "only valid candidates are picked"
    for row in picked:
        ids = row[row >= 0]
        assert ids.unique().numel() == ids.numel(), "no candidate twice"
    tied = (got - want).abs() <= tol["atol"] + tol["rtol"] * want.abs()
    assert torch.all((picked == expected) | tied), "a candidate differs where the scores are not tied"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["exact", "mxfp4", "fp8"])
def test_scores_and_topk_match_reference(fmt, dtype):
    hi, di = 20, 24  # Hi >= 16 so ReLU zeros rarely tie; Di below the layouts' 32 / 128: q zero-padded
    rows, cu = step_rows(STEP, seed=1)
    t = rows.shape[0]
    store, layout, dense = key_store(fmt, di if fmt == "exact" else (32 if fmt == "mxfp4" else 128), seed=2)
    q = randn(t, hi, di, seed=3, dtype=dtype)
    if layout is not None:  # zero-padded key dims, as engine.model.attention pads q: q . k unchanged
        q = torch.nn.functional.pad(q, (0, layout.index_head_dim - di))
    keys = dense.to(dtype) if layout is None else store
    weights = randn(t, hi, seed=4, scale=hi**-0.5)
    out = indexer_prefill_scores(q, keys, rows, weights, cu, layout, block_m=64, block_n=16)
    expected = reference_scores(q, dense.to(dtype), rows, weights)
    assert out.dtype == torch.float32 and out.shape == rows.shape
    assert torch.equal(torch.isinf(out), rows < 0), "exactly the invalid candidates score -inf"
    valid = rows >= 0
    torch.testing.assert_close(out[valid], expected[valid], **NUM.TOL[dtype])
    visible = valid.sum(1)
    assert (visible < 8).any() and (visible > 8).any() and (visible < 64).all()
    for k in (8, 64):  # below some visible counts and above others; above every one (S = 50)
        picked = indexer_topk(q, keys, rows, weights, k, layout, cu_seqlens=cu)
        assert_topk_equivalent(picked, ref.topk_visible(expected, valid, k), expected, NUM.TOL[dtype])


@pytest.mark.parametrize("block_m,split", [(16, 1), (32, 3), (128, 2)])
def test_block_shapes_splits_and_holes(block_m, split):
    """Query blocks of 1..8 queries, candidate chunks, and -1 holes inside the visible prefix."""
    hi, di = 16, 32
    rows, cu = step_rows(STEP, seed=5, holes=0.3)
    t = rows.shape[0]
    keys = randn(PAGES * PAGE_ROWS, di, seed=6)
    q = randn(t, hi, di, seed=7)
    weights = randn(t, hi, seed=8, scale=hi**-0.5)
    out = indexer_prefill_scores(q, keys, rows, weights, cu, block_m=block_m, block_n=16, split=split)
    expected = reference_scores(q, keys, rows, weights)
    assert torch.equal(torch.isinf(out), rows < 0)
    torch.testing.assert_close(out[rows >= 0], expected[rows >= 0], **NUM.TOL[torch.float32])


@pytest.mark.parametrize("hi", [1, 3])
def test_tiny_head_counts_tie_aware_topk(hi):
    """Few heads: ReLU zeros make exact ties (the reference's order among them is arbitrary)."""
    di = 16
    rows, cu = step_rows([(7, 9), (40, 12)], seed=9)
    t = rows.shape[0]
    keys = randn(PAGES * PAGE_ROWS, di, seed=10)
    q = randn(t, hi, di, seed=11)
    weights = randn(t, hi, seed=12)
    expected = reference_scores(q, keys, rows, weights)
    out = indexer_prefill_scores(q, keys, rows, weights, cu, block_n=16)
    torch.testing.assert_close(out[rows >= 0], expected[rows >= 0], **NUM.TOL[torch.float32])
    picked = indexer_topk(q, keys, rows, weights, 6, cu_seqlens=cu)
    assert_topk_equivalent(picked, ref.topk_visible(expected, rows >= 0, 6), expected, NUM.TOL[torch.float32])


def test_prefill_blocks_cover_each_sequence():
    cu = torch.tensor([0, 5, 5, 6, 17])  # an empty sequence, a one-token one
    blocks = prefill_blocks(cu, 17, 4)
    assert blocks.dtype == torch.int32 and blocks.shape == (-(-17 // 4) + 4, 2)
    used = blocks[blocks[:, 1] > blocks[:, 0]].tolist()
    assert used == [[0, 4], [4, 5], [5, 6], [6, 10], [10, 14], [14, 17]]
    assert torch.all(blocks[len(used) :] == 0), "the rest of the static bound is empty"


def test_dispatch_by_step_shape(monkeypatch):
    """Prefill-shaped steps (T > B) take the prefill kernel; decode (T == B) and no cu_seqlens keep the old one."""
    calls = []
    real = triton_indexer.indexer_prefill_scores
    monkeypatch.setattr(triton_indexer, "indexer_prefill_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    hi, di = 16, 16
    rows, cu = step_rows([(40, 3), (60, 2)], seed=13)
    keys = randn(PAGES * PAGE_ROWS, di, seed=14)
    q, weights = randn(5, hi, di, seed=15), randn(5, hi, seed=16)
    prefill = indexer_topk(q, keys, rows, weights, 8, cu_seqlens=cu)
    assert calls == [1]
    decode_cu = torch.arange(6, device=DEVICE)  # five one-token sequences: decode-shaped
    assert torch.equal(
        indexer_topk(q, keys, rows, weights, 8, cu_seqlens=decode_cu), indexer_topk(q, keys, rows, weights, 8)
    )
    assert calls == [1]
    expected = reference_scores(q, keys, rows, weights)
    assert_topk_equivalent(prefill, ref.topk_visible(expected, rows >= 0, 8), expected, NUM.TOL[torch.float32])


def test_bad_inputs_raise():
    rows, cu = step_rows([(8, 4)], seed=17)
    keys = randn(PAGES * PAGE_ROWS, 16, seed=18)
    q, weights = randn(4, 16, 16, seed=19), randn(4, 16, seed=20)
    with pytest.raises(ValueError, match="cu_seqlens"):
        indexer_prefill_scores(q, keys, rows, weights, cu.float())
    with pytest.raises(ValueError, match="cu_seqlens"):
        indexer_prefill_scores(q, keys, rows, weights, cu[:1])
    with pytest.raises(ValueError, match="block_n"):
        indexer_prefill_scores(q, keys, rows, weights, cu, block_n=24)
    with pytest.raises(ValueError, match="keys"):
        indexer_prefill_scores(q, keys[:, :8], rows, weights, cu)
    with pytest.raises(ValueError, match="rows"):
        indexer_prefill_scores(q, keys, rows[:2], weights, cu)


def test_per_request_candidates_in_query_blocks(monkeypatch):
    """The engine's form: rows [B, S] per request, each token's visible count; split into query blocks that cut
    sequences mid-way (budget of 7 queries): the same scores and picks as the [T, S] list in one block."""
    hi, di = 16, 32
    listed, cu = step_rows(STEP, seed=7)
    t, s = listed.shape
    seg = torch.repeat_interleave(torch.arange(len(STEP)), torch.tensor([n for _, n in STEP])).to(DEVICE)
    count = (listed >= 0).sum(1)
    per_request = torch.stack([listed[int(cu[b + 1]) - 1] for b in range(len(STEP))])  # last token sees the most
    per_request = torch.where(per_request >= 0, per_request, 0)  # entries past a count: any real row
    store, _, _ = key_store("exact", di, seed=8)
    q = randn(t, hi, di, seed=9)
    weights = randn(t, hi, seed=10, scale=hi**-0.5)
    out = indexer_prefill_scores(q, store, per_request, weights, cu, block_n=16, seg=seg, count=count)
    assert torch.equal(out, indexer_prefill_scores(q, store, listed, weights, cu, block_n=16))
    calls = []
    real = triton_indexer.indexer_prefill_scores
    monkeypatch.setattr(
        triton_indexer, "indexer_prefill_scores", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw)
    )
    expected = indexer_topk(q, store, listed, weights, 8, cu_seqlens=cu)
    picked = indexer_topk(q, store, per_request, weights, 8, cu_seqlens=cu, seg=seg, count=count, budget=4 * s * 7)
    assert torch.equal(picked, expected)
    assert calls[1:] == [7] * (t // 7) + ([t % 7] if t % 7 else [])
