"""FP8 experts for prefill (dsv4_kernels.mxfp4_fp8, dsv4_kernels.fp8_experts) on the CPU: the MXFP4 -> FP8 128x128
conversion against the dequantised MXFP4 weights (exact where the block's scale span fits e4m3, bounded otherwise),
the padded contiguous layout against a plain loop, and the FP8 references against dsv4_kernels.moe's."""

import pytest
import torch

from dsv4_kernels import fp8_experts as fe
from dsv4_kernels import mxfp4_fp8
from dsv4_kernels.fp8_linear import dequant_act, quant_act_1x128
from dsv4_kernels.moe import moe_experts, moe_experts_grouped, route, swiglu
from dsv4_kernels.quant import dequant_mxfp4, quant_mxfp4
from tests.support import numerics as NUM


def _packed(e, n, k, seed, spread=(-3, 3)):
    """Random checkpoint-format MXFP4 experts uint8 [E, N, K/2] + UE8M0 [E, N, K/32]; scales around 2^-6 +- spread."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(121 + spread[0], 121 + spread[1] + 1, (e, n, k // 32), dtype=torch.uint8, generator=g)
    return w, s


def test_conversion_exact_within_span():
    """Scales spanning <= 14 binades inside every 128x128 block: the FP8 weights dequantise to exactly the MXFP4."""
    w, s = _packed(3, 256, 384, seed=1, spread=(-7, 7))  # span 14
    report = mxfp4_fp8.ConversionReport()
    q, scale = mxfp4_fp8.convert(w, s, report, chunk=2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 256, 384) and scale.shape == (3, 2, 3)
    assert torch.equal(mxfp4_fp8.dequant(q, scale), dequant_mxfp4(w, s))
    assert report.exact and report.wide_blocks == 0 and report.blocks == 18 and report.max_abs_err == 0.0
    # scales are powers of two
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))


def test_conversion_from_real_quantised_weights_is_exact():
    """quant_mxfp4 of normal weights (what a checkpoint holds): spans are small, the conversion exact."""
    g = torch.Generator().manual_seed(2)
    dense = torch.randn(2 * 128, 256, generator=g) * 0.02
    q4, s4 = quant_mxfp4(dense)
    w, s = q4.view(2, 128, 128), s4.view(torch.uint8).view(2, 128, 8)
    report = mxfp4_fp8.ConversionReport()
    q, scale = mxfp4_fp8.convert(w, s, report)
    assert torch.equal(mxfp4_fp8.dequant(q, scale), dequant_mxfp4(w, s)) and report.exact
    assert "exact" in report.describe()


def test_conversion_wide_span_is_bounded():
    """A block whose 32-group scales span 20 binades: the smallest groups' values fall below e4m3's subnormal step;
    every element stays within 2^-10 x the block scale (< 4.4e-6 of the block amax), and the report says so."""
    w, s = _packed(2, 128, 256, seed=3, spread=(-10, 10))
    s[0, 0, 0], s[0, 1, 1] = 101, 141  # force the span past 14 in block (0, 0, 0)
    report = mxfp4_fp8.ConversionReport()
    q, scale = mxfp4_fp8.convert(w, s, report, name="layers.0.w1")
    ref = dequant_mxfp4(w, s)
    got = mxfp4_fp8.dequant(q, scale)
    err = (got - ref).abs()
    full = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert bool((err <= full * 2.0**-10).all())
    amax = ref.view(2, 1, 128, 2, 128).abs().amax(dim=(2, 4)).repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert float((err / amax).max()) < 4.4e-6
    assert report.wide_blocks >= 1 and report.inexact_blocks >= 1 and not report.exact
    assert report.inexact_blocks <= report.wide_blocks  # inexact only where the span passes 14
    assert abs(report.max_abs_err - float(err.max())) <= 1e-12 * max(1.0, float(err.max()))
    assert "layers.0.w1" in report.describe()


def test_conversion_rejects_ragged_blocks():
    w, s = _packed(1, 96, 256, seed=4)
    with pytest.raises(ValueError, match="128-blocks"):
        mxfp4_fp8.convert(w, s)


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize(
    "t,k,e,align,skip",
    [(1, 1, 4, 128, False), (7, 3, 5, 8, False), (33, 6, 16, 16, True), (200, 6, 8, 128, True), (64, 2, 300, 4, False)],
)
def test_layout_matches_loop(t, k, e, align, skip, exact):
    g = torch.Generator().manual_seed(t + e)
    ids = torch.randint(0, e, (t, k), generator=g)
    if skip:
        ids[torch.rand(t, k, generator=g) < 0.3] = -1
    lay = fe.contiguous_layout(ids, e, align, exact=exact)
    pair_row, src, mi = fe.layout_ref(ids, e, align, exact=exact)
    bound = fe.padded_rows(t * k, e, align)
    assert lay.rows == (len(mi) if exact else bound) and lay.rows % align == 0 and lay.rows <= bound
    assert lay.src_token.is_contiguous() and lay.m_indices.is_contiguous()
    assert lay.pair_row.tolist() == pair_row
    assert lay.m_indices.tolist() == mi and lay.m_indices.dtype == torch.int32
    real = lay.m_indices >= 0
    assert lay.src_token[real].tolist() == [v for v, m in zip(src, mi) if m >= 0]
    # every expert segment starts on an aligned row; no aligned tile holds two experts
    tiles = lay.m_indices.view(-1, align)
    first = tiles[:, :1]
    assert bool(((tiles == first) | (tiles == -1)).all())


def test_exact_layout_is_minimal():
    """The exact layout has the fewest rows DeepGEMM can take (each used expert's segment rounded up to the
    alignment, nothing else; one tile when no pair is local). V4-Flash's 8K-token step under uniform routing:
    each expert's ~192 pairs round up to 256, 65,536 rows against the bound's 81,792."""
    g = torch.Generator().manual_seed(11)
    for t, k, e, align in ((8192, 6, 256, 128), (2048, 6, 256, 128), (50, 4, 64, 16)):
        ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
        counts = torch.bincount(ids.reshape(-1), minlength=e)
        want = int(sum(-(-c // align) * align for c in counts.tolist()))
        lay = fe.contiguous_layout(ids, e, align, exact=True)
        assert lay.rows == want and bool((lay.m_indices >= 0).sum() == t * k)
        if (t, e) == (8192, 256):
            assert fe.padded_rows(t * k, e, align) - lay.rows > 15_000
    none = torch.full((5, 2), -1)
    lay = fe.contiguous_layout(none, 8, 16, exact=True)
    assert lay.rows == 16 and lay.pair_row.tolist() == [-1] * 10 and bool((lay.m_indices == -1).all())


def _grouped_emulated(x, weights, ids, ex, limit, layout):
    """DeepGEMM's contiguous grouped path on the CPU, row for row: each padded row multiplied by its m_indices
    expert (padding rows left NaN: they must never be read), the k-way sum read through pair_row."""
    xq = dequant_act(*quant_act_1x128(x, ex.pow2_act)).index_select(0, layout.src_token)  # [M, H]
    h = torch.full((layout.rows, 2 * ex.inter), float("nan"))
    y = torch.full((layout.rows, ex.hidden), float("nan"))
    experts = [int(v) for v in layout.m_indices.unique() if v >= 0]
    for e in experts:
        sel = layout.m_indices == e
        h[sel] = (xq[sel] @ mxfp4_fp8.dequant(ex.w13[e], ex.s13[e]).t()).to(x.dtype).float()
    act = swiglu(h[:, : ex.inter], h[:, ex.inter :], limit)
    aq = dequant_act(*quant_act_1x128(act, ex.pow2_act))
    for e in experts:
        sel = layout.m_indices == e
        y[sel] = (aq[sel] @ mxfp4_fp8.dequant(ex.w2[e], ex.s2[e]).t()).to(x.dtype).float()
    rows = layout.pair_row.view(ids.shape)
    picked = y.index_select(0, rows.clamp_min(0).reshape(-1)).view(*ids.shape, ex.hidden)
    return torch.where((rows >= 0).unsqueeze(-1), weights.unsqueeze(-1) * picked, 0.0).sum(1).to(x.dtype)


@pytest.mark.parametrize("skip", [False, True])
def test_exact_and_bound_layouts_same_outputs(skip):
    """The grouped FP8 MoE over the exact layout = over the bound one (the same rows for the same pairs; only the
    trailing padding differs), and both = fp8_moe_ref to fp32 summation order."""
    e, h, inter, k, limit, align = 8, 256, 128, 3, 10.0, 16
    pk = _experts(e, h, inter, seed=12)
    ex = fe.from_packed(pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"])
    x, weights, ids = _inputs(41, h, e, k, seed=13, skip=skip)
    exact = fe.contiguous_layout(ids, e, align, exact=True)
    bound = fe.contiguous_layout(ids, e, align)
    assert exact.rows < bound.rows
    got = _grouped_emulated(x, weights, ids, ex, limit, exact)
    assert not got.isnan().any()
    assert torch.equal(got, _grouped_emulated(x, weights, ids, ex, limit, bound))
    NUM.assert_close(got, fe.fp8_moe_ref(x, weights, ids, ex, limit), torch.float32, loose=True)


def test_deepgemm_moe_layout_is_bound_unless_exact_is_asked_outside_a_capture(monkeypatch):
    """deepgemm_moe's layout: the sync-free bound by default; exact (one sync) on eager calls with
    DSV4_FP8_MOE_LAYOUT=exact; the bound while a CUDA graph is captured whatever the setting."""
    from dsv4_kernels import deepgemm_moe

    ids = torch.zeros(3, 2, dtype=torch.long)
    assert not deepgemm_moe.exact_layout(ids)
    monkeypatch.setenv("DSV4_FP8_MOE_LAYOUT", "exact")
    assert deepgemm_moe.exact_layout(ids)  # (a CPU tensor is never captured)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not deepgemm_moe.exact_layout(ids)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert deepgemm_moe.exact_layout(ids)


def _experts(e, h, inter, seed):
    packed = {}
    for i, (name, (n, kk)) in enumerate((("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter)))):
        g = torch.Generator().manual_seed(seed + i)
        q, s = quant_mxfp4(torch.randn(e * n, kk, generator=g) * kk**-0.5)
        packed[name], packed["s" + name[1]] = q.view(e, n, kk // 2), s.view(torch.uint8).view(e, n, kk // 32)
    return packed


def _inputs(t, h, e, k, seed, skip=False):
    x = NUM.randn(t, h, seed=seed)
    gate = NUM.randn(e, h, seed=seed + 1, scale=h**-0.5)
    weights, ids = route(x, gate, k, 1.5, bias=NUM.randn(e, seed=seed + 2, scale=0.1))
    if skip:
        ids = torch.where(ids % 3 == 0, -1, ids)
    return x, weights, ids


@pytest.mark.parametrize("grouped", [False, True])
def test_fp8_experts_reference_matches_moe_reference(grouped):
    """The engine's reference on FP8 experts (dequantised, dsv4_kernels.moe) = the MoE reference on the MXFP4
    experts: the conversion is exact here, so the two agree to fp32 reordering."""
    e, h, inter, k, limit = 8, 256, 128, 3, 10.0
    pk = _experts(e, h, inter, seed=5)
    ex = fe.from_packed(pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"])
    x, weights, ids = _inputs(19, h, e, k, seed=6, skip=grouped)
    dense = [dequant_mxfp4(pk[n], pk["s" + n[1]]) for n in ("w1", "w2", "w3")]
    want = moe_experts(x, weights, ids, *dense, limit)
    every = torch.arange(e)
    run = moe_experts_grouped if grouped and hasattr(torch, "_grouped_mm") else moe_experts
    got = run(x, weights, ids, *ex.dequant(every, torch.float32), limit)
    NUM.assert_close(got, want, torch.float32, loose=True)


@pytest.mark.parametrize("skip", [False, True])
def test_fp8_moe_ref_bounded_against_moe_reference(skip):
    """fp8_moe_ref (what DeepGEMM computes: FP8 1x128 activations) against the bf16-activation reference: the
    difference is the activations' FP8 rounding (e4m3: 3 mantissa bits, <= 2^-4 relative an element), a few % of
    the output's scale after the sums; in fp32 it is exactly fp8_moe_ref, checked against a second evaluation."""
    e, h, inter, k, limit = 8, 256, 128, 3, 10.0
    pk = _experts(e, h, inter, seed=7)
    ex = fe.from_packed(pk["w1"], pk["s1"], pk["w2"], pk["s2"], pk["w3"], pk["s3"])
    x, weights, ids = _inputs(23, h, e, k, seed=8, skip=skip)
    dense = [dequant_mxfp4(pk[n], pk["s" + n[1]]) for n in ("w1", "w2", "w3")]
    want = moe_experts(x, weights, ids, *dense, limit)
    got = fe.fp8_moe_ref(x, weights, ids, ex, limit)
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.06, rel
    shared = NUM.randn(23, h, seed=9)
    NUM.assert_close(fe.fp8_moe_ref(x, weights, ids, ex, limit, shared), got + shared, torch.float32)
