"""Triton sparse MQA attention (dsv4_kernels/triton_attention.py) against dsv4_kernels.attention.sparse_attention.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter (set before any
dsv4_kernels.triton_* import, because triton reads the flag when a kernel is decorated).
"""

import pytest
import torch

from dsv4_kernels import geometry as g  # noqa: E402
from dsv4_kernels.attention import sparse_attention  # noqa: E402
from dsv4_kernels.triton_attention import sparse_mqa_attention, sparse_mqa_attention_fp8, sparse_mqa_attention_multi  # noqa: E402
from tests.support import numerics as NUM  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def random_rows(t, k, r, seed, invalid=0.3):
    """int32 [T, K] in [0, R) with ~`invalid` of them -1; row 1 is entirely invalid (sink-only query)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, r, (t, k), generator=gen, dtype=torch.int32)
    rows[torch.rand(t, k, generator=gen) < invalid] = -1
    rows[1] = -1
    return rows.to(DEVICE)


def reference(q, kv, rows, sink, scale):
    return sparse_attention(q, kv[rows.long().clamp(min=0)], rows >= 0, sink, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_plain_rows_match_reference(dtype, num_splits):
    t, h, d, k, r = 4, 5, 96, 40, 50  # H not a multiple of 16, D not a power of two, K not a tile multiple
    q = randn(t, h, d, seed=1, dtype=dtype)
    kv = randn(r, d, seed=2, dtype=dtype)
    sink = randn(h, seed=3)
    rows = random_rows(t, k, r, seed=4)
    scale = d**-0.5 * 3.0  # sharper softmax than the default so the max tracking matters
    out = sparse_mqa_attention(q, kv, rows, sink, scale, num_splits=num_splits, block_k=16)
    ref = reference(q, kv, rows, sink, scale)
    assert out.dtype == dtype and out.shape == (t, h, d)
    torch.testing.assert_close(out.float(), ref.float(), **NUM.TOL[dtype])
    assert torch.all(out[1] == 0), "an all-invalid query must return the zero vector"


def test_strided_inputs_and_int64_rows():
    t, h, d, k, r = 3, 16, 64, 20, 30
    big_q = randn(t, h + 2, d, seed=5)
    q = big_q[:, 1 : h + 1]  # non-contiguous heads
    big_kv = randn(r, d + 32, seed=6)
    kv = big_kv[:, :d]  # row stride > D, as in a padded pool
    sink = randn(h, seed=7)
    rows = random_rows(t, k, r, seed=8).long()
    out = sparse_mqa_attention(q, kv, rows, sink, 0.2, num_splits=2, block_k=16)
    torch.testing.assert_close(out, reference(q, kv, rows, sink, 0.2), **NUM.TOL[torch.float32])


def test_sink_dominates_and_large_logits():
    """Logits far above and below the sink: the running max must move off its sink start safely."""
    t, h, d, k, r = 3, 4, 32, 24, 24
    q = randn(t, h, d, seed=9, scale=4.0)
    kv = randn(r, d, seed=10, scale=4.0)
    sink = torch.tensor([-30.0, 0.0, 30.0, 5.0], device=DEVICE)
    rows = random_rows(t, k, r, seed=11)
    out = sparse_mqa_attention(q, kv, rows, sink, 1.0, num_splits=2, block_k=16)
    torch.testing.assert_close(out, reference(q, kv, rows, sink, 1.0), **NUM.TOL[torch.float32])


def fp8_cache(layout, num_slots, seed, pad=8):
    """A paged uint8 cache with every slot written, plus the dequantised rows the kernel must see."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-num_slots // layout.block_size)
    cache = torch.randint(0, 256, (blocks, layout.block_bytes() + pad), generator=gen, dtype=torch.uint8)
    # Per-row magnitudes spread over several binades so the UE8M0 scales differ from row to row.
    values = torch.randn(num_slots, layout.head_dim, generator=gen) * torch.exp2(
        torch.randint(-4, 5, (num_slots, 1), generator=gen).float()
    )
    slots = torch.arange(num_slots)
    g.write_rows(cache, layout, slots, g.pack_fp8_ds_mla(values, layout))
    dequant = g.unpack_fp8_ds_mla(g.read_rows(cache, layout, slots), layout)
    return cache.to(DEVICE), dequant.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_fp8_paged_cache_matches_unpack_reference(dtype, num_splits):
    layout = g.Fp8DsMlaLayout(head_dim=192, rope_dim=64, block_size=4)  # nope 128: two scale blocks
    t, h, k, slots = 4, 6, 36, 22
    cache, dequant = fp8_cache(layout, slots, seed=12)
    q = randn(t, h, layout.head_dim, seed=13, dtype=dtype, scale=0.25)
    sink = randn(h, seed=14)
    rows = random_rows(t, k, slots, seed=15)
    scale = layout.head_dim**-0.5
    out = sparse_mqa_attention_fp8(q, cache, rows, sink, scale, layout, num_splits=num_splits, block_k=16)
    ref = reference(q, dequant, rows, sink, scale)
    torch.testing.assert_close(out.float(), ref.float(), **NUM.TOL[dtype])
    assert torch.all(out[1] == 0)


def test_fp8_packed_rows_are_block_size_one():
    layout = g.Fp8DsMlaLayout(head_dim=128, rope_dim=64, block_size=1)
    t, h, k, slots = 3, 4, 20, 17
    cache, dequant = fp8_cache(layout, slots, seed=16, pad=0)
    assert cache.shape == (slots, layout.row_bytes)
    q = randn(t, h, layout.head_dim, seed=17, scale=0.25)
    sink = randn(h, seed=18)
    rows = random_rows(t, k, slots, seed=19)
    out = sparse_mqa_attention_fp8(q, cache, rows, sink, 0.1, layout, block_k=16)
    torch.testing.assert_close(out, reference(q, dequant, rows, sink, 0.1), **NUM.TOL[torch.float32])


def test_bad_shapes_raise():
    q = randn(2, 4, 32, seed=20)
    kv = randn(10, 32, seed=21)
    sink = randn(4, seed=22)
    rows = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[T, H, 32\]"):
        sparse_mqa_attention(q[..., :16], kv, rows, sink, 1.0)
    with pytest.raises(ValueError, match="rows"):
        sparse_mqa_attention(q, kv, rows[:1], sink, 1.0)
    with pytest.raises(ValueError, match="sink"):
        sparse_mqa_attention(q, kv, rows, sink[:3], 1.0)
    layout = g.Fp8DsMlaLayout(head_dim=128, rope_dim=64, block_size=4)
    with pytest.raises(ValueError, match="cache"):
        sparse_mqa_attention_fp8(q, torch.zeros(2, 10, dtype=torch.uint8, device=DEVICE), rows, sink, 1.0, layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_shape_many_tiles_and_d_split(dtype, num_splits):
    """D = 512 (two 256-wide segments), K over several tiles, > 64 heads (two head blocks, the second partial)."""
    t, h, d, k, r = 3, 72, 512, 150, 400
    q = randn(t, h, d, seed=30, dtype=dtype, scale=0.5)
    kv = randn(r, d, seed=31, dtype=dtype)
    sink = randn(h, seed=32)
    rows = random_rows(t, k, r, seed=33)
    scale = d**-0.5 * 2.0
    out = sparse_mqa_attention(q, kv, rows, sink, scale, num_splits=num_splits, block_k=32)
    ref = reference(q, kv, rows, sink, scale)
    torch.testing.assert_close(out.float(), ref.float(), **NUM.TOL[dtype])
    assert torch.all(out[1] == 0)


def test_odd_head_dim_three_segments():
    t, h, d, k, r = 2, 3, 100, 37, 45  # 100 = 64 + 32 + 4 (the last padded to 16)
    q = randn(t, h, d, seed=34)
    kv = randn(r, d, seed=35)
    sink = randn(h, seed=36)
    rows = random_rows(t, k, r, seed=37)
    out = sparse_mqa_attention(q, kv, rows, sink, 0.1, block_k=16)
    torch.testing.assert_close(out, reference(q, kv, rows, sink, 0.1), **NUM.TOL[torch.float32])


@pytest.mark.parametrize("num_stores", [2, 3])
def test_multi_store_rows_index_the_concatenation(num_stores):
    t, h, d, k = 4, 8, 64, 45
    sizes = [30, 7, 19][:num_stores]
    big = randn(sum(sizes), d + 16, seed=38)
    stores = []
    o = 0
    for i, n in enumerate(sizes):  # separate tensors, one of them with a padded row stride
        part = big[o : o + n, :d]
        stores.append(part if i == 0 else part.contiguous())
        o += n
    flat = torch.cat([s for s in stores])
    q = randn(t, h, d, seed=39)
    sink = randn(h, seed=40)
    rows = random_rows(t, k, sum(sizes), seed=41)
    out = sparse_mqa_attention_multi(q, stores, rows, sink, 0.2, num_splits=2, block_k=16)
    torch.testing.assert_close(out, reference(q, flat, rows, sink, 0.2), **NUM.TOL[torch.float32])
    with pytest.raises(ValueError, match="dtype"):
        sparse_mqa_attention_multi(q, [stores[0], stores[1].double()], rows, sink, 0.2)


@pytest.mark.gpu
@pytest.mark.skipif(
    DEVICE == "cpu",
    reason="GPU only: the interpreter compiles no variants, and the stores must lie over 4 GiB apart in GPU memory",
)
def test_multi_store_offsets_beyond_int32_add_no_variant():
    """The element offsets of stores 1 and 2 from store 0 are pointer differences: stores over 4 GiB apart made
    them i64 where near ones were i32, and each type compiled its own variant (mid-request on the H200, named by
    engine.telemetry.compile_watch). Declared i64, the far stores run the near stores' variant and still read right."""
    from engine.telemetry.compile_watch import install_variant_log

    log = install_variant_log()
    t, h, d, k = 8, 64, 512, 160
    q = randn(t, h, d, seed=70, dtype=torch.bfloat16)
    sink = randn(h, seed=71)
    # store 0 at the start of one 5 GiB block, the far store at its end: 2.7e9 elements apart whatever the
    # allocator does (separate small tensors land next to each other)
    block = torch.empty((5 << 30) // 2 + 48 * d, dtype=torch.bfloat16, device=DEVICE)
    first, second, far = block[: 64 * d].view(64, d), block[64 * d : 112 * d].view(48, d), block[(5 << 30) // 2 :]
    first.copy_(randn(64, d, seed=72, dtype=torch.bfloat16))
    second.copy_(randn(48, d, seed=73, dtype=torch.bfloat16))
    far = far.view(48, d).copy_(second)
    near = [first, second]
    assert (far.data_ptr() - first.data_ptr()) // 2 >= 2**31 > (second.data_ptr() - first.data_ptr()) // 2
    rows = random_rows(t, k, 112, seed=74)
    sparse_mqa_attention_multi(q, near, rows, sink, 0.1)
    mark = len(log.variants)
    out = sparse_mqa_attention_multi(q, [near[0], far], rows, sink, 0.1)
    assert [v.kernel for v in log.variants[mark:]] == [], log.explain(mark)
    want = reference(q.float(), torch.cat([near[0], far]).float(), rows, sink, 0.1)
    torch.testing.assert_close(out.float(), want, **NUM.TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_v4_geometry_four_segments(dtype):
    """The V4 row: NoPE 448 = 256 + 128 + 64 fp8 segments plus the 64 bf16 RoPE values; several tiles."""
    layout = g.Fp8DsMlaLayout(head_dim=512, rope_dim=64, block_size=8)
    t, h, k, slots = 3, 16, 70, 60
    cache, dequant = fp8_cache(layout, slots, seed=42)
    q = randn(t, h, layout.head_dim, seed=43, dtype=dtype, scale=0.1)
    sink = randn(h, seed=44)
    rows = random_rows(t, k, slots, seed=45)
    scale = layout.head_dim**-0.5
    out = sparse_mqa_attention_fp8(q, cache, rows, sink, scale, layout, num_splits=2, block_k=16)
    ref = reference(q, dequant, rows, sink, scale)
    torch.testing.assert_close(out.float(), ref.float(), **NUM.TOL[dtype])
    assert torch.all(out[1] == 0)
