"""Triton mHC pre/post (dsv4_kernels/triton_mhc.py) against dsv4_kernels.mhc.hc_pre / hc_post.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (set before any
dsv4_kernels.triton_* import, because triton reads the flag when a kernel is decorated).
"""

import pytest
import torch

from dsv4_kernels import mhc as ref  # noqa: E402
from dsv4_kernels import triton_mhc, triton_mhc_mix  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

T, D = 3, 80  # D is not a multiple of the 32-wide blocks used below


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def pre_inputs(hc, dtype, seed=0):
    n_mix = (2 + hc) * hc
    streams = randn(T, hc, D, seed=seed, dtype=dtype, scale=2.0)
    fn = randn(n_mix, hc * D, seed=seed + 1, scale=0.05)  # mixes of order 1 after the RMSNorm
    base = randn(n_mix, seed=seed + 2, scale=0.5)
    scale = torch.tensor([0.7, 1.3, 2.0], device=DEVICE)
    return streams, fn, base, scale


@pytest.fixture(params=["dot tiles, 32 splits a load", "gemv mix, 128 splits a load"])
def decode_knobs(request, monkeypatch):
    """The split path's decode-size variants: the mix as 16-row dot tiles or one token a program (GEMV), the pre
    kernel adding its partials 32 or 128 splits a load."""
    gemv = request.param.startswith("gemv")
    monkeypatch.setattr(triton_mhc_mix, "MIX_GEMV_MAX_TOKENS", 16 if gemv else 0)
    monkeypatch.setattr(triton_mhc, "PRE_SPLITS_PER_LOAD", 128 if gemv else 32)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hc,iters", [(4, 20), (3, 1), (4, 2)])  # hc 3: padded comb; iters 1: no loop
def test_hc_pre_matches_reference(decode_knobs, dtype, hc, iters):
    streams, fn, base, scale = pre_inputs(hc, dtype, seed=hc * 10 + iters)
    collapsed, post, comb = triton_mhc.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6, block_d=32)
    ref_collapsed, ref_post, ref_comb = ref.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
    assert collapsed.dtype == dtype and post.dtype == comb.dtype == torch.float32
    # The mixing weights are fp32 on both sides whatever the streams' dtype.
    torch.testing.assert_close(post, ref_post, **NUM.TOL[torch.float32])
    torch.testing.assert_close(comb, ref_comb, **NUM.TOL[torch.float32])
    torch.testing.assert_close(collapsed.float(), ref_collapsed.float(), **NUM.TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hc", [4, 3])
def test_hc_post_matches_reference(dtype, hc):
    streams = randn(T, hc, D, seed=40 + hc, dtype=dtype)
    block_out = randn(T, D, seed=50 + hc, dtype=dtype)
    post = 2 * torch.sigmoid(randn(T, hc, seed=60 + hc))
    comb = torch.softmax(randn(T, hc, hc, seed=70 + hc), dim=-1)
    out = triton_mhc.hc_post(block_out, streams, post, comb, block_d=32)
    expected = ref.hc_post(block_out, streams, post, comb)
    assert out.dtype == dtype and out.shape == (T, hc, D)
    torch.testing.assert_close(out.float(), expected.float(), **NUM.TOL[dtype])


def test_pre_then_post_round_trip_on_strided_streams():
    """The two kernels chained as a layer uses them, on a non-contiguous [T, hc, D] view."""
    hc = 4
    streams, fn, base, scale = pre_inputs(hc, torch.float32, seed=90)
    wide = torch.cat([streams, randn(T, hc, 8, seed=91)], dim=-1)[..., :D]
    collapsed, post, comb = triton_mhc.hc_pre(wide, fn, base, scale, 20, 1e-6, 1e-6, block_d=32)
    new = triton_mhc.hc_post(collapsed * 0.5, wide, post, comb, block_d=32)
    rc, rp, rm = ref.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    torch.testing.assert_close(new, ref.hc_post(rc * 0.5, streams, rp, rm), **NUM.TOL[torch.float32])


def test_bad_shapes_raise():
    streams, fn, base, scale = pre_inputs(4, torch.float32)
    with pytest.raises(ValueError, match="fn"):
        triton_mhc.hc_pre(streams, fn[:, :10], base, scale, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="streams"):
        triton_mhc.hc_pre(streams[0], fn, base, scale, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="comb"):
        triton_mhc.hc_post(streams[:, 0], streams, torch.ones(T, 4, device=DEVICE), torch.ones(T, 4, device=DEVICE))


@pytest.mark.parametrize(
    "dtype,out_dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
def test_hc_pre_with_fused_input_norm(decode_knobs, dtype, out_dtype):
    """norm_weight: the first output is the block's input, rms_norm(collapsed, w).to(out_dtype) (engine.model.model)."""
    from dsv4_kernels.norm import rms_norm

    hc, iters = 4, 3
    streams, fn, base, scale = pre_inputs(hc, dtype, seed=90)
    weight = 1.0 + randn(D, seed=91, scale=0.3)
    normed, post, comb = triton_mhc.hc_pre(
        streams, fn, base, scale, iters, 1e-6, 1e-6, block_d=32, norm_weight=weight, out_eps=1e-5, out_dtype=out_dtype
    )
    ref_collapsed, ref_post, ref_comb = ref.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
    expected = rms_norm(ref_collapsed, weight, 1e-5).to(out_dtype)
    assert normed.dtype == out_dtype and normed.shape == (T, D)
    torch.testing.assert_close(post, ref_post, **NUM.TOL[torch.float32])
    torch.testing.assert_close(comb, ref_comb, **NUM.TOL[torch.float32])
    torch.testing.assert_close(normed.float(), expected.float(), **NUM.TOL[out_dtype])


@pytest.mark.parametrize(
    "t,d,dtype",
    [(1, 300, torch.bfloat16), (17, 80, torch.float32), (70, 300, torch.bfloat16), (300, 256, torch.bfloat16)],
)
def test_mix_partials_sum_to_the_fp32_matmul(decode_knobs, t, d, dtype):
    """The split-K mixing logits (one token, a 16-row tile and a 64-row tile; several K splits; strided streams
    read in their stored dtype; K tiles within one stream (D = 256, 128) and across two (D = 300, 80); from 257
    tokens bf16 streams' tensor-core kernel: three bf16 dots on fn's hi / mid / lo parts) add up to the
    reference's fp32 matmul of the flattened streams."""
    hc, n_mix = 4, 24
    wide = randn(t, hc, d + 8, seed=t + d, dtype=dtype, scale=2.0)
    streams = wide[..., :d]  # a non-contiguous [T, hc, D] view
    fn = randn(n_mix, hc * d, seed=d, scale=0.05)
    parts = triton_mhc_mix.mix_partials(streams, fn)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (t, n_mix) and parts.shape[0] > 1
    want = streams.reshape(t, hc * d).float() @ fn.float().t()
    torch.testing.assert_close(parts.sum(0), want, **NUM.TOL[torch.float32])


def test_mix_partials_of_a_long_chunk_are_one_matmul(monkeypatch):
    """Above MIX_MAX_TOKENS tokens the logits are torch's fp32 matmul: one partial."""
    monkeypatch.setattr(triton_mhc_mix, "MIX_MAX_TOKENS", 4)
    streams, fn = randn(5, 4, 80, seed=3), randn(24, 320, seed=4, scale=0.05)
    parts = triton_mhc_mix.mix_partials(streams, fn)
    assert parts.shape == (1, 5, 24)
    torch.testing.assert_close(parts[0], streams.reshape(5, 320) @ fn.t(), **NUM.TOL[torch.float32])


def test_long_steps_take_the_path_measured_faster_for_their_dtype():
    """By default: fp32 streams beyond 256 tokens take the long path (torch's matmul for the logits, then the
    "rows" kernels), bf16 streams stay on the split kernels at every length."""
    assert triton_mhc_mix.split_max_tokens(torch.float32) == triton_mhc_mix.MIX_MAX_TOKENS == 256
    assert triton_mhc_mix.split_max_tokens(torch.bfloat16) > 1 << 20
    assert triton_mhc.LONG_PATH == "rows"
    fn = randn(24, 4 * 128, seed=5, scale=0.05)
    assert triton_mhc_mix.mix_partials(randn(257, 4, 128, seed=6), fn).shape[0] == 1
    assert triton_mhc_mix.mix_partials(randn(257, 4, 128, seed=6, dtype=torch.bfloat16), fn).shape[0] > 1


def test_mix_partials_sum_of_squares_column(decode_knobs):
    """sumsq=True: one more column whose split sum is each token's sum of squares (the split-path's RMSNorm)."""
    t, hc, d = 5, 4, 300
    streams = randn(t, hc, d, seed=7, dtype=torch.bfloat16, scale=2.0)
    fn = randn(24, hc * d, seed=8, scale=0.05)
    parts = triton_mhc_mix.mix_partials(streams, fn, sumsq=True)
    assert parts.shape[1:] == (t, 25) and parts.shape[0] > 1
    flat = streams.reshape(t, hc * d).float()
    torch.testing.assert_close(parts[..., :24].sum(0), flat @ fn.float().t(), **NUM.TOL[torch.float32])
    torch.testing.assert_close(parts[..., 24].sum(0), flat.square().sum(1), **NUM.TOL[torch.float32])


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("long_path", ["rows", "token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_steps_take_the_long_path(monkeypatch, norm, long_path, dtype):
    """Above MIX_MAX_TOKENS (prefill chunks) the long path, torch's matmul for the logits, then "rows" (whole-row
    collapses, weights for blocks of tokens) or "token" (one program a token); below, a token spreads over D
    blocks. All match the reference, with and without the fused input norm."""
    from dsv4_kernels.norm import rms_norm

    hc, iters = 4, 20
    streams, fn, base, scale = pre_inputs(hc, dtype, seed=120)
    weight = 1.0 + randn(D, seed=121, scale=0.3)
    kw = {"norm_weight": weight, "out_eps": 1e-5, "out_dtype": torch.bfloat16} if norm else {}
    ref_collapsed, ref_post, ref_comb = ref.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
    want = rms_norm(ref_collapsed, weight, 1e-5).to(torch.bfloat16) if norm else ref_collapsed
    split = triton_mhc.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6, block_d=32, **kw)
    monkeypatch.setattr(triton_mhc_mix, "MIX_MAX_TOKENS", T - 1)
    monkeypatch.setattr(triton_mhc_mix, "MIX_MAX_TOKENS_BF16", T - 1)
    monkeypatch.setattr(triton_mhc, "LONG_PATH", long_path)
    long = triton_mhc.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6, block_d=32, **kw)
    for first, post, comb in (split, long):
        torch.testing.assert_close(post, ref_post, **NUM.TOL[torch.float32])
        torch.testing.assert_close(comb, ref_comb, **NUM.TOL[torch.float32])
        assert first.dtype == want.dtype
        torch.testing.assert_close(first.float(), want.float(), **NUM.TOL[want.dtype])


@pytest.mark.parametrize("hc,t,d", [(3, 70, 300), (4, 130, 64)])
def test_rows_path_over_several_token_blocks(monkeypatch, hc, t, d):
    """The rows path with more tokens than one weights program takes (WEIGHT_BLOCK_T) and a partial last block,
    padded streams (hc 3) and D not a power of two (padded row columns)."""
    from dsv4_kernels import triton_mhc_rows

    n_mix = (2 + hc) * hc
    streams = randn(t, hc, d, seed=t + d, scale=2.0)
    fn = randn(n_mix, hc * d, seed=d, scale=0.05)
    base, scale = randn(n_mix, seed=hc, scale=0.5), torch.tensor([0.7, 1.3, 2.0], device=DEVICE)
    monkeypatch.setattr(triton_mhc_mix, "MIX_MAX_TOKENS", 1)
    assert t > triton_mhc_rows.WEIGHT_BLOCK_T and t % triton_mhc_rows.WEIGHT_BLOCK_T
    got = triton_mhc.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    want = ref.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **NUM.TOL[torch.float32])


def test_split_pre_sums_many_partials():
    """A decode token of wide streams: more split-K partials than one load of the pre kernel takes (35 > 32)."""
    hc, d, t = 4, 1100, 2
    streams = randn(t, hc, d, seed=130, dtype=torch.bfloat16, scale=2.0)
    fn = randn((2 + hc) * hc, hc * d, seed=131, scale=0.02)
    base, scale = randn((2 + hc) * hc, seed=132, scale=0.5), torch.tensor([0.7, 1.3, 2.0], device=DEVICE)
    assert triton_mhc_mix.mix_partials(streams, fn).shape[0] > 32
    got = triton_mhc.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    want = ref.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    torch.testing.assert_close(got[1], want[1], **NUM.TOL[torch.float32])
    torch.testing.assert_close(got[2], want[2], **NUM.TOL[torch.float32])
    torch.testing.assert_close(got[0].float(), want[0].float(), **NUM.TOL[torch.bfloat16])
