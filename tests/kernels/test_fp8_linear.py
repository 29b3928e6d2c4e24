"""Block-scaled FP8 linear: the plain-torch reference, the Triton 1x128 activation quantiser (interpreter on the
CPU, compiled on CUDA) and DeepGEMM's FP8 GEMM against the reference (CUDA with deep_gemm only)."""

import pytest
import torch

from dsv4_kernels import fp8_linear as ref
from dsv4_kernels.gpu import has_deep_gemm, why_not
from dsv4_kernels.quant import quant_fp8_block
from dsv4_kernels.triton_fp8_quant import quant_act_1x128
from tests.support import triton_env  # noqa: F401  (sets TRITON_INTERPRET before dsv4_kernels.triton_* imports)

DEVICE = triton_env.DEVICE


def _weight(n, k, gen, device="cpu", pow2=True):
    w = torch.randn(n, k, generator=gen) * k**-0.5
    q, s = quant_fp8_block(w, scale_fmt="ue8m0")
    return w, ref.weight_from_checkpoint(q.to(device), s.to(device), pow2)


@pytest.mark.parametrize("pow2", [True, False])
def test_reference_quantiser_bounds_and_scales(pow2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=gen) * torch.rand(7, 1, generator=gen) * 50
    x[2, :128] = 0.0  # an all-zero block takes the amax floor, not a 0/0
    q, s = ref.quant_act_1x128(x, pow2)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (7, 3)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= ref.FP8_MAX
    if pow2:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    back = ref.dequant_act(q, s)
    # e4m3 keeps 3 mantissa bits: relative error per element <= 2**-4 of the block's scale * 448 range
    assert ((back - x).abs() <= s.repeat_interleave(128, 1)[:, :300] * 16 + 1e-12).all()


def test_reference_linear_close_to_exact():
    gen = torch.Generator().manual_seed(1)
    w, fw = _weight(256, 384, gen)
    x = torch.randn(5, 384, generator=gen)
    y = ref.fp8_linear_ref(x, fw)
    exact = x @ fw.dequant().t()
    assert y.shape == (5, 256)
    rel = ((y - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 3e-2  # activation quantisation is visible, and small


def test_fp8_weight_validation():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ref.Fp8Weight(torch.zeros(128, 128), torch.ones(1, 1))
    with pytest.raises(ValueError, match="scale must be float32"):
        ref.Fp8Weight(torch.zeros(256, 128).to(torch.float8_e4m3fn), torch.ones(1, 1))


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("m,k", [(1, 128), (5, 256), (33, 384), (3, 100)])
def test_triton_quantiser_matches_reference(m, k, pow2):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 20).to(DEVICE)
    x[0, : min(k, 128)] = 0.0
    q, s = quant_act_1x128(x, pow2)
    rq, rs = ref.quant_act_1x128(x.cpu(), pow2)
    assert s.stride(0) == 1  # MN-major, the layout DeepGEMM's sm90 kernels load
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))


needs_deep_gemm = pytest.mark.skipif(
    not torch.cuda.is_available() or not has_deep_gemm(),
    reason="DeepGEMM FP8 GEMM needs a CUDA GPU with deep_gemm installed (pip install '.[gpu]'): "
    + (why_not("deep_gemm") or "no CUDA device"),
)


@pytest.mark.gpu
@needs_deep_gemm
@pytest.mark.parametrize("m", [1, 16, 64, 200])
@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 1024), (512, 4096)])
def test_deep_gemm_matches_reference(m, n, k):
    from dsv4_kernels.deepgemm_linear import fp8_gemm

    gen = torch.Generator().manual_seed(m + n + k)
    _, fw = _weight(n, k, gen, "cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    out.copy_(fp8_gemm(x, fw))
    want = ref.fp8_linear_ref(x.float(), fw).float()
    assert torch.isfinite(out).all()
    rel = ((out.float() - want).norm() / want.norm()).item()
    assert rel < 8e-3, rel  # same products; bf16 output rounding + accumulation order


@pytest.mark.gpu
@needs_deep_gemm
@pytest.mark.parametrize("t", [1, 3, 64])
def test_deep_gemm_grouped_projection(t):
    """One masked grouped GEMM (not its G-GEMM fallback) over a transposed [T, G, D] view, as the engine passes."""
    import dsv4_kernels.deepgemm_linear as dgl
    from dsv4_kernels.deepgemm_linear import fp8_grouped_gemm

    g, r, d = 8, 256, 512
    gen = torch.Generator().manual_seed(t)
    _, fw = _weight(g * r, d, gen, "cuda")
    x = torch.randn(t, g, d, generator=gen).to("cuda", torch.bfloat16).transpose(0, 1)
    out = fp8_grouped_gemm(x, fw, g)
    assert not dgl._GROUPED_BROKEN, dgl._GROUPED_BROKEN
    for i in range(g):
        part = ref.Fp8Weight(fw.weight[i * r : (i + 1) * r], fw.scale[i * 2 : (i + 1) * 2], fw.pow2_act)
        want = ref.fp8_linear_ref(x[i].float(), part)
        assert ((out[i].float() - want).norm() / want.norm()).item() < 8e-3


@pytest.mark.gpu
@needs_deep_gemm
@pytest.mark.parametrize("t", [1, 3, 64, 200])
def test_grouped_then_linear_equals_the_two_steps(t):
    """wo_b after wo_a with the joined quantiser (no bf16 copy between them) gives bitwise what the grouped projection
    then the plain FP8 linear give: the same codes reach the same GEMM (200 tokens: the G-GEMM path)."""
    from engine.model.linear import grouped_projection, grouped_then_linear, linear

    g, r, d, n = 8, 256, 512, 384
    gen = torch.Generator().manual_seed(t)
    _, fw = _weight(g * r, d, gen, "cuda")
    _, fo = _weight(n, g * r, gen, "cuda")
    x = torch.randn(t, g, d, generator=gen).to("cuda", torch.bfloat16)
    got = grouped_then_linear(x, fw, g, fo)
    assert got.shape == (t, n)
    assert torch.equal(got, linear(grouped_projection(x, fw, g), fo))
    # with the attention output's inverse rope (two heads of 256 a group) riding in wo_a's quantiser
    from dsv4_kernels.rope import InverseRope, rope_cos_sin, rope_inv_freq
    from dsv4_kernels.triton_norm_rope import rope

    cos, sin = (c.cuda() for c in rope_cos_sin(torch.arange(t) * 37, rope_inv_freq(10000.0, 64)))
    back = InverseRope(cos, sin, 256)
    turned = rope(x.clone().view(t, -1, 256), cos, sin, inverse=True, inplace=True).view(t, g, d)
    assert torch.equal(grouped_then_linear(x.clone(), fw, g, fo, back), linear(grouped_projection(turned, fw, g), fo))


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("g,m,k", [(3, 5, 256), (2, 1, 128), (4, 6, 100)])
def test_triton_grouped_quantiser_matches_per_group(g, m, k, pow2):
    """One launch over a transposed [M, G, K] view (as engine.model.linear's grouped projection passes it) gives each
    group exactly the plain quantiser's codes and scales, in the same MN-major scale layout."""
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128_grouped

    gen = torch.Generator().manual_seed(g * 100 + m + k)
    x = (torch.randn(m, g, k, generator=gen) * torch.rand(m, g, 1, generator=gen) * 20).to(DEVICE)
    xg = x.transpose(0, 1)
    q, s = quant_act_1x128_grouped(xg, pow2)
    assert q.shape == (g, m, k) and s.shape == (g, m, (k + 127) // 128)
    for i in range(g):
        rq, rs = ref.quant_act_1x128(xg[i].cpu(), pow2)
        assert s[i].stride(0) == 1 and s[i].stride(1) == (m + 3) // 4 * 4
        assert torch.equal(s[i].cpu(), rs)
        assert torch.equal(q[i].cpu().view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("g,m,heads,head_dim,rope_dim,rows", [(2, 3, 2, 128, 64, None), (4, 5, 1, 256, 64, 16)])
def test_triton_grouped_quantiser_turns_the_rope_back_first(g, m, heads, head_dim, rope_dim, rows, dtype):
    """rope: each group's heads turned back by the rows' angles in the quantiser's launch give bitwise the codes and
    scales of the in-place Triton inverse rope then the plain grouped quantiser (the attention output before wo_a;
    head_dim 128: the rope pairs end a block; 256: a block of plain channels between them)."""
    from dsv4_kernels.rope import InverseRope, rope_cos_sin, rope_inv_freq
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128_grouped
    from dsv4_kernels.triton_norm_rope import rope

    gen = torch.Generator().manual_seed(g * 10 + m + head_dim)
    o = (torch.randn(m, g * heads, head_dim, generator=gen) * 3).to(DEVICE, dtype)  # [T, H, D] as attention's output
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (m,), generator=gen), rope_inv_freq(10000.0, rope_dim))
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    back = InverseRope(cos, sin, head_dim)
    x = o.reshape(m, g, heads * head_dim).transpose(0, 1)  # [G, T, D] as the grouped projection passes it
    q, s = quant_act_1x128_grouped(x, True, rows, back)
    assert torch.equal(o.reshape(m, g, -1).transpose(0, 1), x), "the fused rope does not write its input"
    turned = rope(o.clone(), cos, sin, inverse=True, inplace=True)
    want_q, want_s = quant_act_1x128_grouped(turned.reshape(m, g, -1).transpose(0, 1), True, rows)
    q, s, want_q, want_s = q[:, :m], s[:, :m], want_q[:, :m], want_s[:, :m]  # (padding rows are left unwritten)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    # and the reference rotation within one e4m3 step of it
    ref_x = back.apply(o.reshape(m, g, -1).float()).transpose(0, 1)
    assert (ref.dequant_act(q[0], s[0]).to(DEVICE) - ref_x[0]).abs().max() <= s[0].max() * 32
    with pytest.raises(ValueError, match="whole heads"):
        quant_act_1x128_grouped(x[..., : head_dim // 2], True, rope=back)


def test_triton_grouped_quantiser_into_padded_group_storage():
    """rows: every group gets `rows` rows of storage (the masked grouped GEMM's tile-aligned M); its first M rows
    hold the same codes and scales as without padding."""
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128_grouped

    g, m, k, rows = 3, 5, 256, 16
    x = (torch.randn(m, g, k, generator=torch.Generator().manual_seed(4)) * 7).to(DEVICE).transpose(0, 1)
    q, s = quant_act_1x128_grouped(x, True)
    qp, sp = quant_act_1x128_grouped(x, True, rows)
    assert qp.shape == (g, rows, k) and sp.shape == (g, rows, 2) and sp.stride() == (2 * rows, 1, rows)
    assert torch.equal(qp[:, :m].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sp[:, :m], s)
    with pytest.raises(ValueError, match="rows"):
        quant_act_1x128_grouped(x, True, m - 1)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("g,m,rows", [(3, 5, 5), (8, 1, 256), (2, 6, 16)])
def test_triton_joined_quantiser_matches_the_joined_copy(g, m, rows, pow2):
    """quant_act_1x128_joined over a grouped GEMM's per-group outputs [G, M, K] (here views of padded [G, rows, K]
    storage, as DeepGEMM's masked grouped GEMM leaves them) is exactly the plain quantiser of the joined [M, G*K]
    copy it replaces (engine.model.linear.grouped_then_linear): codes, scales and their MN-major layout."""
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128_joined

    k = 256
    gen = torch.Generator().manual_seed(g * 10 + m + rows)
    storage = (torch.randn(g, rows, k, generator=gen) * torch.rand(g, rows, 1, generator=gen) * 30).to(DEVICE)
    y = storage[:, :m]
    q, s = quant_act_1x128_joined(y, pow2)
    rq, rs = ref.quant_act_1x128(y.transpose(0, 1).reshape(m, g * k).cpu(), pow2)
    assert q.shape == (m, g * k) and s.shape == (m, g * k // 128)
    assert s.stride() == (1, (m + 3) // 4 * 4)
    assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    with pytest.raises(ValueError, match="whole 128-blocks"):
        quant_act_1x128_joined(storage[:, :m, :100], pow2)


def test_rms_norm_for_off_the_fp8_path_is_the_plain_norm():
    """engine.model.linear.rms_norm_for without DeepGEMM (CPU, or tensor weights): rms_norm and no quantisation;
    linear_from then is linear. (The fused path runs on CUDA: tests/kernels/test_triton_norm_quant.py.)"""
    from dsv4_kernels.norm import rms_norm
    from engine.model.linear import linear, linear_from, rms_norm_for

    gen = torch.Generator().manual_seed(5)
    x, w, proj = (
        torch.randn(3, 256, generator=gen),
        torch.rand(256, generator=gen) + 0.5,
        torch.randn(64, 256, generator=gen),
    )
    normed, qa = rms_norm_for(x, w, 1e-6, proj)
    assert qa is None and torch.equal(normed, rms_norm(x, w, 1e-6))
    assert torch.equal(linear_from(normed, qa, proj), linear(normed, proj))
