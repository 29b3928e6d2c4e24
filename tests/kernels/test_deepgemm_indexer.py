"""dsv4_kernels.deepgemm_indexer: the prefill indexer through DeepGEMM's fp8_mqa_logits, on fresh random keys written
into a paged FP8 index cache (geometry.write_rows) and random rotated queries.

Everything but DeepGEMM's kernel runs on the CPU: the key gather, the query quantisation and weight folding, and the
whole top-k with the plain-torch stand-in for the kernel (`reference_mqa_logits`), judged against the engine's
indexer reference (bf16 queries). The kernel itself is compared with that stand-in on an sm90 GPU (marked gpu).
"""

import pytest
import torch

from dsv4_kernels import deepgemm_indexer as dgi
from dsv4_kernels.geometry import IndexerKeyLayout, pack_indexer_fp8, read_rows, unpack_rows, write_rows
from dsv4_kernels.gpu import has_deep_gemm, why_not
from dsv4_kernels.indexer import indexer_scores
from tests.support.numerics import randn

needs_deep_gemm = pytest.mark.skipif(
    not torch.cuda.is_available() or not has_deep_gemm(),
    reason="GPU only: DeepGEMM's fp8_mqa_logits needs an sm90 GPU with tokenspeed-deepgemm installed: "
    + (why_not("deep_gemm") or "no CUDA device"),
)


def _problem(t: int, s: int, heads: int = 64, seed: int = 0, device="cpu", block: int = 64):
    """A sequence's chunk: q [T, H, 128], paged FP8 keys, candidate rows [1, S] (random distinct slots, the tail
    past the written entries -1), count [T] (a causal prefix), weights [T, H]."""
    layout = IndexerKeyLayout(128, "fp8", block)
    slots = -(-(2 * s) // block) * block  # whole blocks
    store = torch.zeros(slots // block, layout.block_bytes(), dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(slots, generator=g)[:s]
    write_rows(store, layout, perm, pack_indexer_fp8(randn(s, 128, seed=seed + 1)))
    rows = perm.view(1, s).clone()
    rows[0, s - 5 :] = -1  # candidates not written yet (beyond every count below)
    count = torch.clamp(torch.arange(t) * s // t + 1, max=s - 5)
    q = randn(t, heads, 128, seed=seed + 2).to(torch.bfloat16)
    weights = randn(t, heads, seed=seed + 3)
    return [x.to(device) for x in (q, store, rows, count, weights)], layout


def test_gather_keys_reads_the_rows_geometry_wrote():
    (_, store, rows, _, _), layout = _problem(4, 300, seed=1)
    k8, ks = dgi.gather_keys(store, layout, rows[0])
    assert k8.dtype == torch.float8_e4m3fn and k8.shape == (512, 128) and ks.shape == (512,)
    want = unpack_rows(layout, read_rows(store, layout, rows[0].clamp(min=0)))
    got = k8.float() * ks.unsqueeze(1)
    valid = rows[0] >= 0
    assert torch.equal(got[:300][valid], want[valid])
    assert not got[:300][~valid].any() and not got[300:].any()  # -1 rows and the alignment padding are zero


def test_quantize_queries_folds_a_power_of_two_scale_into_the_weights():
    q = randn(6, 64, 128, seed=4).to(torch.bfloat16) * 30
    w = randn(6, 64, seed=5)
    q8, w2 = dgi.quantize_queries(q, w, 0.125)
    s = w2 / (w * 0.125)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    assert q8.float().abs().amax() <= dgi.FP8_MAX
    back = q8.float() * s.unsqueeze(-1)
    torch.testing.assert_close(back, q.float(), rtol=2**-3, atol=s.max().item() * 2**-9)


def test_topk_through_the_reference_kernel_picks_the_reference_indexer_picks():
    (q, store, rows, count, weights), layout = _problem(96, 700, seed=7)
    k = 64
    got = dgi.fp8_indexer_topk(
        q, store, layout, rows, count, weights, k, logits_fn=dgi.reference_mqa_logits, budget=96 * 256 * 4
    )
    keys = unpack_rows(layout, read_rows(store, layout, rows[0].clamp(min=0)))
    scores = indexer_scores(q.float(), keys.unsqueeze(0).expand(q.shape[0], -1, -1), weights)
    visible = torch.arange(700)[None, :] < count[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    assert got.shape == (96, k)
    for t in range(96):
        picks = got[t][got[t] >= 0]
        n = min(k, int(count[t]))
        assert picks.numel() == n and picks.unique().numel() == n and bool((picks < count[t]).all())
        # FP8 queries move each score by a few %: every pick scores within that of the bf16 reference's k-th best
        kth = scores[t].topk(n).values[-1]
        slack = 0.08 * scores[t][visible[t]].abs().max()
        assert bool((scores[t][picks] >= kth - slack).all()), t
    # and most picks are the reference's own
    ref = scores.topk(k, dim=1).indices
    shared = sum(len(set(a[a >= 0].tolist()) & set(b.tolist())) for a, b in zip(got, ref))
    assert shared >= 0.9 * int((got >= 0).sum())


def test_unfit_reasons():
    (q, _, rows, _, _), layout = _problem(4, 64, seed=9)
    assert "CUDA" in dgi.unfit_reason(q, layout, rows)


@needs_deep_gemm
@pytest.mark.gpu
@pytest.mark.parametrize("t,s,heads", [(512, 3000, 64), (300, 257, 64), (256, 2048, 32)])
def test_deep_gemm_logits_match_the_reference(t, s, heads):
    (q, store, rows, count, weights), layout = _problem(t, s, heads, seed=t, device="cuda")
    q8, w = dgi.quantize_queries(q, weights, 128**-0.5)
    kv = dgi.gather_keys(store, layout, rows[0])
    ks = torch.zeros(t, dtype=torch.int32, device="cuda")
    ke = count.to(torch.int32)
    got = dgi._deep_gemm_logits()(q8, kv, w, ks, ke)[:, :s]
    want = dgi.reference_mqa_logits(q8, kv, w, ks, ke)[:, :s]
    inside = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), inside)
    torch.testing.assert_close(got[inside], want[inside], rtol=1e-3, atol=1e-3 * float(want[inside].abs().max()))
    picks = dgi.fp8_indexer_topk(q, store, layout, rows, count, weights, 128)
    ref = dgi.fp8_indexer_topk(q, store, layout, rows, count, weights, 128, logits_fn=dgi.reference_mqa_logits)
    # -1 pads rows that see fewer than k candidates: same padding, and >99% of the real picks shared (logits within
    # 1e-3 of each other may swap the last places)
    assert torch.equal((picks < 0).sum(1), (ref < 0).sum(1))
    same = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in zip(picks, ref))
    assert same > 0.99 * int((ref >= 0).sum())
