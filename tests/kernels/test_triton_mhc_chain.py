"""dsv4_kernels/triton_mhc_chain.py (a block boundary's mHC in two launches) against the reference chain:
dsv4_kernels.mhc.hc_post, then hc_pre of the next block, rms_norm in the block dtype and the 1x128 quantisation.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter.
"""

import pytest
import torch

from dsv4_kernels import mhc as ref  # noqa: E402
from dsv4_kernels.fp8_linear import dequant_act, quant_act_1x128  # noqa: E402
from dsv4_kernels.norm import rms_norm  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

from dsv4_kernels import triton_mhc_chain as chain  # noqa: E402  isort: skip

EPS = 1e-6


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def boundary_inputs(t, hc, d, dtype, seed):
    """A finished block's output and mixing weights, the streams it read, and the next block's mHC and norm weights."""
    n_mix = (2 + hc) * hc
    streams = randn(t, hc, d, seed=seed, dtype=dtype, scale=2.0)
    block_out = randn(t, d, seed=seed + 1, dtype=dtype)
    post = 2 * torch.sigmoid(randn(t, hc, seed=seed + 2))
    comb = torch.softmax(randn(t, hc, hc, seed=seed + 3), dim=-1)
    fn = randn(n_mix, hc * d, seed=seed + 4, scale=0.05)  # logits of order 1 after the RMSNorm
    base = randn(n_mix, seed=seed + 5, scale=0.5)
    scale = torch.tensor([0.7, 1.3, 2.0], device=DEVICE)
    norm_w = 1.0 + randn(d, seed=seed + 6, scale=0.3)
    return streams, block_out, post, comb, fn, base, scale, norm_w


def reference_pre(streams, fn, base, scale, iters, norm_w, out_dtype):
    collapsed, post, comb = ref.hc_pre(streams, fn, base, scale, iters, EPS, EPS)
    return rms_norm(collapsed, norm_w, 1e-5).to(out_dtype), post, comb


def check_pre(outs, expected, pow2, out_dtype):
    normed, q, s, post, comb = outs
    ref_normed, ref_post, ref_comb = expected
    assert normed.dtype == out_dtype and normed.shape == ref_normed.shape
    torch.testing.assert_close(post, ref_post, **NUM.TOL[torch.float32])
    torch.testing.assert_close(comb, ref_comb, **NUM.TOL[torch.float32])
    torch.testing.assert_close(normed.float(), ref_normed.float(), **NUM.TOL[out_dtype])
    if pow2 is None:
        assert q is None and s is None
        return
    # The quantisation of the row the kernel normed is exact: codes and scales are the reference's of that row.
    ref_q, ref_s = quant_act_1x128(normed.cpu(), pow2)  # (the CPU's division: IEEE, as the kernel's)
    assert s.stride(0) == 1, "scales are MN-major (DeepGEMM's TMA layout)"
    assert torch.equal(s.cpu(), ref_s)
    assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8))
    assert torch.isfinite(dequant_act(q, s)).all()


@pytest.mark.parametrize(
    "t,hc,d,iters,dtype,pow2",
    [
        (3, 4, 384, 20, torch.float32, True),  # V4's hc and iterations; the last pre program half full
        (1, 4, 256, 3, torch.float32, False),  # batch 1, non-pow2 scales
        (10, 3, 80, 1, torch.float32, None),  # two post programs' token runs (TOK 8), padded hc, D < one block
        (5, 4, 200, 2, torch.bfloat16, True),  # bf16 streams: the collapsed row rounds before the norm
    ],
)
def test_post_then_pre_matches_the_reference_chain(t, hc, d, iters, dtype, pow2):
    streams, block_out, post, comb, fn, base, scale, norm_w = boundary_inputs(t, hc, d, dtype, seed=t * 7 + hc + d)
    out_dtype = torch.bfloat16
    new, *outs = chain.post_pre_norm_quant(
        block_out, streams, post, comb, fn, base, scale, iters, EPS, EPS,
        norm_weight=norm_w, out_eps=1e-5, out_dtype=out_dtype, pow2=pow2,
    )  # fmt: skip
    ref_new = ref.hc_post(block_out, streams, post, comb)
    assert new.dtype == dtype and new.shape == (t, hc, d)
    torch.testing.assert_close(new.float(), ref_new.float(), **NUM.TOL[dtype])
    # the next pre from the kernel's own new streams (a bf16 rounding of them would otherwise dominate)
    check_pre(outs, reference_pre(new, fn, base, scale, iters, norm_w, out_dtype), pow2, out_dtype)


@pytest.mark.parametrize("t,dtype", [(2, torch.float32), (9, torch.bfloat16)])
def test_pre_without_post_matches_the_reference(t, dtype):
    """A step's first block: the streams straight from the embedding, no post before the pre."""
    streams, _, _, _, fn, base, scale, norm_w = boundary_inputs(t, 4, 256, dtype, seed=100 + t)
    streams = streams[:, :, :200]  # strided rows: D 200 of a 256-wide tensor
    fn = fn[:, : 4 * 200].contiguous()
    outs = chain.pre_norm_quant(
        streams, fn, base, scale, 20, EPS, EPS, norm_weight=norm_w[:200], out_eps=1e-5, out_dtype=dtype, pow2=True
    )
    check_pre(outs, reference_pre(streams, fn, base, scale, 20, norm_w[:200], dtype), True, dtype)


def test_gram_statistic_on_nearly_cancelling_streams():
    """pre^T G pre as the collapsed row's sum of squares where streams nearly cancel (pre weights are positive, so
    opposite streams shrink the collapsed row): the norm must still match the reference's direct sum."""
    t, hc, d = 2, 4, 256
    streams, block_out, post, comb, fn, base, scale, norm_w = boundary_inputs(t, hc, d, torch.float32, seed=7)
    streams[:, 1] = -streams[:, 0] + 1e-3 * streams[:, 1]
    streams[:, 3] = -streams[:, 2] + 1e-3 * streams[:, 3]
    outs = chain.pre_norm_quant(
        streams, fn, base, scale, 20, EPS, EPS, norm_weight=norm_w, out_eps=1e-5, out_dtype=torch.float32, pow2=None
    )
    check_pre(outs, reference_pre(streams, fn, base, scale, 20, norm_w, torch.float32), None, torch.float32)


def test_bad_inputs_raise():
    streams, block_out, post, comb, fn, base, scale, norm_w = boundary_inputs(2, 4, 128, torch.float32, seed=1)
    kw = {"norm_weight": norm_w, "out_eps": 1e-5, "out_dtype": torch.bfloat16, "pow2": True}
    with pytest.raises(ValueError, match="fn must be"):
        chain.pre_norm_quant(streams, fn[:, :128], base, scale, 20, EPS, EPS, **kw)
    with pytest.raises(ValueError, match="norm_weight must be"):
        chain.pre_norm_quant(streams, fn, base, scale, 20, EPS, EPS, **{**kw, "norm_weight": norm_w[:64]})
    with pytest.raises(ValueError, match="sinkhorn iters"):
        chain.pre_norm_quant(streams, fn, base, scale, 0, EPS, EPS, **kw)
    with pytest.raises(ValueError, match="block_out must be"):
        chain.post_pre_norm_quant(block_out[:, :64], streams, post, comb, fn, base, scale, 20, EPS, EPS, **kw)
    with pytest.raises(ValueError, match="post must be"):
        chain.post_pre_norm_quant(block_out, streams, post[:, :2], comb, fn, base, scale, 20, EPS, EPS, **kw)
    long = streams.new_zeros(chain.LIMIT_TOKENS + 1, 4, 128)
    with pytest.raises(ValueError, match="steps of <= "):
        chain.pre_norm_quant(long, fn, base, scale, 20, EPS, EPS, **kw)


def test_a_setting_past_the_kernels_limit_stops_there(monkeypatch):
    """$DSV4_HC_CHAIN_MAX_TOKENS above LIMIT_TOKENS: longer steps keep the four launches instead of failing."""
    monkeypatch.setattr(chain, "CHAIN_MAX_TOKENS", 2 * chain.LIMIT_TOKENS)
    at_limit = torch.empty(chain.LIMIT_TOKENS, 4, 8)
    past = torch.empty(chain.LIMIT_TOKENS + 1, 4, 8)
    assert chain.takes_chain(at_limit) and not chain.takes_chain(past)
    monkeypatch.setattr(chain, "CHAIN_MAX_TOKENS", 8)
    assert chain.takes_chain(at_limit[:8]) and not chain.takes_chain(at_limit[:9])
