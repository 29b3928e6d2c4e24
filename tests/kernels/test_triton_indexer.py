"""Triton indexer logits + top-k (dsv4_kernels/triton_indexer.py) against dsv4_kernels.indexer.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (set before any
dsv4_kernels.triton_* import, because triton reads the flag when a kernel is decorated).
"""

import pytest
import torch

from dsv4_kernels import geometry as g  # noqa: E402
from dsv4_kernels import indexer as ref  # noqa: E402
from dsv4_kernels.triton_indexer import indexer_scores, indexer_topk  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

T, HI, DI, S, R = 4, 20, 48, 70, 90  # Hi >= 16 so ReLU zeros rarely tie; odd sizes exercise every mask


def randn(*shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, R, (T, S), generator=gen, dtype=torch.int32)
    rows[torch.rand(T, S, generator=gen) < 0.3] = -1
    rows[1] = -1  # a query that sees nothing
    rows[2, 40:] = -1  # fewer visible than some k below
    q = randn(T, HI, DI, seed=seed + 1, dtype=dtype)
    keys = randn(R, DI, seed=seed + 2, dtype=dtype)
    weights = randn(T, HI, seed=seed + 3) * HI**-0.5
    return q, keys, rows.to(DEVICE), weights


def reference_scores(q, keys, rows, weights):
    scores = ref.indexer_scores(q, keys[rows.long().clamp(min=0)], weights)
    return scores.masked_fill(rows < 0, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_match_reference(dtype):
    q, keys, rows, weights = inputs(dtype)
    out = indexer_scores(q, keys, rows, weights, block_s=32)
    expected = reference_scores(q, keys, rows, weights)
    assert out.dtype == torch.float32 and out.shape == (T, S)
    assert torch.equal(torch.isinf(out), rows < 0), "exactly the invalid candidates score -inf"
    valid = rows >= 0
    torch.testing.assert_close(out[valid], expected[valid], **NUM.TOL[dtype])


def test_strided_keys_and_int64_rows():
    q, keys, rows, weights = inputs(torch.float32, seed=10)
    padded = torch.cat([keys, randn(R, 16, seed=99)], dim=1)[:, :DI]  # row stride > Di
    out = indexer_scores(q, padded, rows.long(), weights, block_s=16)
    valid = rows >= 0
    torch.testing.assert_close(out[valid], reference_scores(q, keys, rows, weights)[valid], **NUM.TOL[torch.float32])


@pytest.mark.parametrize("k", [16, 80])  # 80 > S: the candidate axis gets padded
def test_topk_matches_topk_visible(k):
    q, keys, rows, weights = inputs(torch.float32, seed=20)
    picked = indexer_topk(q, keys, rows, weights, k)
    expected = ref.topk_visible(reference_scores(q, keys, rows, weights), rows >= 0, k)
    assert picked.shape == (T, k) and picked.dtype == torch.int64
    # The -1 padding is exact; the picked entries are compared by score, since near-ties may swap.
    assert torch.equal(picked < 0, expected < 0)
    assert torch.all(picked[1] == -1)
    scores = reference_scores(q, keys, rows, weights)
    got = torch.where(picked >= 0, scores.gather(1, picked.clamp(min=0)), torch.zeros(()))
    want = torch.where(expected >= 0, scores.gather(1, expected.clamp(min=0)), torch.zeros(()))
    torch.testing.assert_close(got, want, **NUM.TOL[torch.float32])
    assert torch.all(rows.gather(1, picked.clamp(min=0))[picked >= 0] >= 0), "only valid candidates are picked"


@pytest.mark.parametrize("k", [16, 80])
def test_unordered_topk_is_the_same_set(k):
    """ordered=False (the engine on CUDA): the ordered picks as a set, -1 padding included."""
    q, keys, rows, weights = inputs(torch.float32, seed=21)
    ordered = indexer_topk(q, keys, rows, weights, k)
    unordered = indexer_topk(q, keys, rows, weights, k, ordered=False)
    assert unordered.shape == ordered.shape and unordered.dtype == torch.int64
    assert torch.equal(unordered.sort(dim=1).values, ordered.sort(dim=1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,di", [("mxfp4", 64), ("fp8", 128)])
def test_quantized_paged_cache_matches_unpack_reference(fmt, di, dtype):
    """Keys written by geometry's packers into a paged cache; reference = unpack + indexer_scores."""
    layout = g.IndexerKeyLayout(index_head_dim=di, fmt=fmt, block_size=4)
    gen = torch.Generator().manual_seed(30)
    slots = 22
    blocks = -(-slots // layout.block_size)
    cache = torch.randint(0, 256, (blocks, layout.block_bytes() + 4), generator=gen, dtype=torch.uint8)
    # Per-row magnitudes over several binades so the scales differ from row to row.
    values = torch.randn(slots, di, generator=gen) * torch.exp2(torch.randint(-3, 4, (slots, 1), generator=gen).float())
    g.write_rows(cache, layout, torch.arange(slots), g.pack_rows(layout, values))
    dequant = g.unpack_rows(layout, g.read_rows(cache, layout, torch.arange(slots))).to(DEVICE)
    rows = torch.randint(0, slots, (T, S), generator=gen, dtype=torch.int32)
    rows[torch.rand(T, S, generator=gen) < 0.3] = -1
    rows[1] = -1
    rows = rows.to(DEVICE)
    q = randn(T, HI, di, seed=31, dtype=dtype)
    weights = randn(T, HI, seed=32) * HI**-0.5
    out = indexer_scores(q, cache.to(DEVICE), rows, weights, layout, block_s=32)
    expected = reference_scores(q, dequant, rows, weights)
    assert torch.equal(torch.isinf(out), rows < 0)
    valid = rows >= 0
    torch.testing.assert_close(out[valid], expected[valid], **NUM.TOL[dtype])
    picked = indexer_topk(q, cache.to(DEVICE), rows, weights, 16, layout)
    assert torch.equal(picked < 0, ref.topk_visible(expected, valid, 16) < 0)


def test_bad_shapes_raise():
    q, keys, rows, weights = inputs(torch.float32)
    with pytest.raises(ValueError, match="keys"):
        indexer_scores(q, keys[:, :16], rows, weights)
    with pytest.raises(ValueError, match="weights"):
        indexer_scores(q, keys, rows, weights[:, :4])
    with pytest.raises(ValueError, match="rows"):
        indexer_scores(q, keys, rows.float(), weights)
    with pytest.raises(ValueError, match="index_head_dim"):
        indexer_scores(q, keys.to(torch.uint8), rows, weights, g.IndexerKeyLayout(64, "mxfp4"))


def test_per_request_candidates_and_query_blocks():
    """rows [B, S] per request + seg / count (what the engine passes) equal the [T, S] list they stand for, in
    any number of query blocks (budget forced down to 2 and 3 queries a block)."""
    gen = torch.Generator().manual_seed(30)
    b = 2
    per_request = torch.randint(0, R, (b, S), generator=gen).to(DEVICE)
    seg = torch.tensor([0, 1, 1, 0]).to(DEVICE)
    count = torch.tensor([0, 33, S, 5]).to(DEVICE)
    q, keys, _, weights = inputs(torch.float32, seed=31)
    listed = torch.where(torch.arange(S, device=DEVICE) < count.unsqueeze(1), per_request[seg], -1)
    out = indexer_scores(q, keys, per_request, weights, block_s=32, seg=seg, count=count)
    assert torch.equal(out, indexer_scores(q, keys, listed, weights, block_s=32))
    expected = indexer_topk(q, keys, listed, weights, 16)
    for per_block in (2, 3, T):
        picked = indexer_topk(q, keys, per_request, weights, 16, seg=seg, count=count, budget=4 * S * per_block)
        assert torch.equal(picked, expected), per_block
    assert ref.query_blocks(T, S, 4 * S * 3) == [(0, 3), (3, 4)]
