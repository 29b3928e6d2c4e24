"""Triton indexer query prologue (dsv4_kernels/triton_indexer_query.py) against dsv4_kernels.indexer.quantize_query.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (set before any
dsv4_kernels.triton_* import, because triton reads the flag when a kernel is decorated).
"""

import pytest
import torch

from dsv4_kernels import geometry as g  # noqa: E402
from dsv4_kernels.hadamard import hadamard  # noqa: E402
from dsv4_kernels.indexer import quantize_query  # noqa: E402
from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: E402
from dsv4_kernels.triton_indexer_query import indexer_prologue, indexer_query  # noqa: E402
from tests.support.cache_kernel_checks import assert_bytes_near, assert_close  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

T, HI = 3, 7  # 21 rows: not a multiple of the 16-row block


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def cos_sin(t, rope, seed):
    positions = torch.randint(0, 5000, (t,), generator=torch.Generator().manual_seed(seed))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(160000.0, rope))
    return cos.to(DEVICE), sin.to(DEVICE)


def packed(values, scales):
    """(values, scales) of [T, Hi, .] -> geometry's packed rows uint8 [T * Hi, row_bytes]."""
    n = values.shape[0] * values.shape[1]
    return torch.cat([values.reshape(n, -1), scales.reshape(n, -1).contiguous().view(torch.uint8)], dim=1)


def pad_rows(x, width):
    return torch.nn.functional.pad(x.reshape(-1, x.shape[-1]).float(), (0, width - x.shape[-1]))


CASES = [("mxfp4", 64, 16, 64), ("mxfp4", 32, 16, 64), ("fp8", 128, 32, 128), ("fp8", 64, 16, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, di, rope, width", CASES)  # width > di: zero-padded layout (as engine.model.cache)
@pytest.mark.parametrize("rotate", [True, False])
def test_matches_reference_and_pack(dtype, fmt, di, rope, width, rotate):
    q = randn(T, HI, di, seed=di + rope, dtype=dtype, scale=3.0)
    cos, sin = cos_sin(T, rope, seed=1)
    layout = g.IndexerKeyLayout(width, fmt)
    values, scales, rotated = indexer_query(q, cos, sin, layout, hadamard=rotate, return_rotated=True)
    ref_values, ref_scales, ref_rotated = quantize_query(q, cos, sin, layout, hadamard_rotate=rotate)
    assert values.shape == ref_values.shape and values.dtype == torch.uint8
    assert scales.shape == ref_scales.shape and scales.dtype == ref_scales.dtype
    assert rotated.dtype == dtype
    assert_close(rotated, ref_rotated, dtype)
    # Byte-exact against geometry's pack of the values the kernel quantised.
    assert torch.equal(packed(values, scales), g.pack_rows(layout, pad_rows(rotated, width)))
    assert_bytes_near(layout, packed(values, scales), packed(ref_values, ref_scales))
    if not rotate:  # no rotation: the identity dots are exact, so the bytes equal the reference's
        assert torch.equal(packed(values, scales), packed(ref_values, ref_scales))


@pytest.mark.parametrize("fmt, rel_rms", [("mxfp4", 0.2), ("fp8", 0.05)])
def test_rotated_quantised_dot_products_match_q_dot_k(fmt, rel_rms):
    """deq(rotated q) . deq(rotated k) ~ q . k: both sides share the rotation, only quantisation error remains."""
    di, rope, s = 128, 64, 40
    q = randn(T, HI, di, seed=3, scale=2.0)
    q[..., 5] *= 20.0  # an outlier channel: what the rotation spreads out before quantising
    keys = randn(s, di, seed=4)
    cos, sin = cos_sin(T, rope, seed=5)
    layout = g.IndexerKeyLayout(di, fmt)
    values, scales = indexer_query(q, cos, sin, layout)
    q_hat = g.unpack_rows(layout, packed(values, scales)).double().view(T * HI, di)
    k_hat = g.unpack_rows(layout, g.pack_rows(layout, hadamard(keys))).double()
    exact = apply_rope(q, cos, sin).double().reshape(T * HI, di) @ keys.double().t()
    approx = q_hat @ k_hat.t()
    # Cauchy-Schwarz bound from each side's quantisation error in the rotated basis (H is orthogonal).
    hq = hadamard(apply_rope(q, cos, sin)).double().reshape(T * HI, di)
    hk = hadamard(keys).double()
    bound = (q_hat - hq).norm(dim=1)[:, None] * k_hat.norm(dim=1)[None, :] + hq.norm(dim=1)[:, None] * (
        k_hat - hk
    ).norm(dim=1)[None, :]
    assert bool(((approx - exact).abs() <= bound + 1e-3).all())
    rel = ((approx - exact).square().mean() / exact.square().mean()).sqrt().item()
    assert rel < rel_rms, f"relative RMS error of q.k {rel:.3f}"


def test_v4_shape_and_bad_inputs():
    q = randn(2, 64, 128, seed=6, dtype=torch.bfloat16)
    cos, sin = cos_sin(2, 64, seed=7)
    values, scales = indexer_query(q, cos, sin, g.IndexerKeyLayout(128, "mxfp4"), block_r=32)
    assert values.shape == (2, 64, 64) and scales.shape == (2, 64, 4)
    with pytest.raises(ValueError, match="power-of-two"):
        indexer_query(randn(2, 4, 96, seed=8), cos, sin, g.IndexerKeyLayout(96, "mxfp4"))
    with pytest.raises(ValueError, match="index_head_dim"):
        indexer_query(q, cos, sin, g.IndexerKeyLayout(64, "mxfp4"))
    with pytest.raises(ValueError, match="block_r"):
        indexer_query(q, cos, sin, g.IndexerKeyLayout(128, "mxfp4"), block_r=8)
    with pytest.raises(ValueError, match="cos/sin"):
        indexer_query(q, cos[:1], sin[:1], g.IndexerKeyLayout(128, "mxfp4"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [None, 32])  # 32: zero-padded key dims (test presets)
@pytest.mark.parametrize(
    "t,e,max_programs",
    [
        (5, 37, 64),  # one block a token
        (1, 1500, 64),  # a decode step's few tokens: three programs, one block each
        (2, 2100, 4),  # two programs a token, each walking several blocks (chunk, chunk + NE, ...)
    ],
)
def test_prologue_matches_the_engine_glue(monkeypatch, dtype, width, t, e, max_programs):
    """indexer_prologue = apply_rope(q) (+ zero padding), weights.float() * scale, where(valid, rows, -1)."""
    import dsv4_kernels.triton_indexer_query as iq

    monkeypatch.setattr(iq, "PROLOGUE_MAX_PROGRAMS", max_programs)
    h, di, rope = 6, 24, 8
    gen = torch.Generator().manual_seed(5)
    big = (torch.randn(t, h + 1, di + 4, generator=gen) * 3).to(dtype).to(DEVICE)
    q = big[:, :h, :di]  # strided token / head views, as the GEMM output's slices
    wbig = (torch.randn(t, h + 3, generator=gen)).to(dtype).to(DEVICE)
    weights = wbig[:, 1 : h + 1]
    rows = torch.randint(0, 1000, (t, e), generator=gen).to(DEVICE)
    valid = (torch.rand(t, e, generator=gen) > 0.4).to(DEVICE)
    cos, sin = rope_cos_sin(torch.randint(0, 4000, (t,), generator=gen), rope_inv_freq(160000.0, rope))
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    q_out, w_out, r_out = indexer_prologue(q, cos, sin, weights, h**-0.5, rows, valid, width)
    expected = apply_rope(q, cos, sin)
    if width:
        expected = torch.nn.functional.pad(expected, (0, width - di))
    assert q_out.shape == expected.shape and q_out.dtype == dtype
    assert_close(q_out, expected, dtype)
    assert torch.equal(w_out, weights.float() * h**-0.5)
    assert torch.equal(r_out, torch.where(valid, rows, -1))
    q_only, w_only, none = indexer_prologue(q, cos, sin, weights, h**-0.5, width=width)  # the engine's call
    assert none is None and torch.equal(q_only, q_out) and torch.equal(w_only, w_out)
