"""dsv4_kernels.flashmla_sparse: FlashMLA's sparse decode over two fp8_ds_mla paged caches against the plain-torch
reference, on fresh random caches written in the engine's block layout (geometry.write_rows).

The reference's block addressing is checked everywhere (CPU); FlashMLA itself needs an sm90 GPU with
tokenspeed-flashmla installed: those tests are marked gpu and skip elsewhere.
"""

import pytest
import torch

from dsv4_kernels import flashmla_sparse as fm
from dsv4_kernels.attention import sparse_attention
from dsv4_kernels.geometry import Fp8DsMlaLayout, pack_fp8_ds_mla, read_rows, unpack_fp8_ds_mla, write_rows
from dsv4_kernels.gpu import has_flash_mla, why_not
from tests.support.numerics import assert_close, randn

needs_flash_mla = pytest.mark.skipif(
    not torch.cuda.is_available() or not has_flash_mla(),
    reason="GPU only: FlashMLA needs an sm90 GPU with tokenspeed-flashmla installed (pip install '.[gpu]'): "
    + (why_not("flash_mla") or "no CUDA device"),
)


def _cache(rows: int, block: int, seed: int, device="cpu", head_dim: int = 512, rope: int = 64):
    """A paged fp8_ds_mla cache of one layer, every row written from random latents -> (uint8 [rows, 584], layout)."""
    layout = Fp8DsMlaLayout(head_dim, rope, block)
    cache = torch.zeros(rows // block, block * layout.row_bytes, dtype=torch.uint8)
    kv = randn(rows, head_dim, seed=seed)
    write_rows(cache, layout, torch.arange(rows), pack_fp8_ds_mla(kv, layout))
    return cache.view(rows, layout.row_bytes).to(device), layout


def _indices(t: int, k: int, rows: int, seed: int, invalid: float = 0.2, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < invalid] = -1
    return idx.to(device)


@pytest.mark.parametrize("block", [64, 2])
def test_reference_reads_the_rows_geometry_wrote(block):
    cache, layout = _cache(256, block, seed=1)
    idx = _indices(5, 70, 256, seed=2)
    q = randn(5, 16, 512, seed=3)
    sink = randn(16, seed=4)
    got = fm.reference_sparse_decode(q, cache, layout, idx, None, None, None, sink, 0.05)
    rows = read_rows(cache.view(-1, block * layout.row_bytes), layout, idx.reshape(-1).clamp(min=0))
    keys = unpack_fp8_ds_mla(rows, layout).view(5, 70, 512)
    assert_close(got, sparse_attention(q, keys, idx >= 0, sink, 0.05), torch.float32)


def test_unfit_reasons():
    assert fm.unfit_reason(64, [Fp8DsMlaLayout(512, 64, 64)]) == ""
    assert "heads" in fm.unfit_reason(256, [Fp8DsMlaLayout(512, 64, 64)])
    assert "head_dim" in fm.unfit_reason(64, [Fp8DsMlaLayout(128, 64, 64)])
    assert [fm.padded_heads(h) for h in (1, 16, 64, 65, 128)] == [64, 64, 64, 128, 128]


@needs_flash_mla
@pytest.mark.gpu
@pytest.mark.parametrize(
    "t,heads,extra_block,extra_k",
    [
        (1, 64, 64, 512),  # CSA decode, batch 1
        (64, 64, 64, 512),  # CSA decode, batch 64
        (37, 128, 2, 130),  # HCA-like: 2-row entry pages, visible list padded to 192
        (16, 32, 64, 512),  # a tensor-parallel rank's 32 heads, padded to 64
        (8, 64, None, 0),  # SWA-only layer
    ],
)
def test_flashmla_matches_reference(t, heads, extra_block, extra_k):
    cache, layout = _cache(64 * 40, 64, seed=t, device="cuda")
    main_idx = _indices(t, 128, cache.shape[0], seed=t + 1, device="cuda")
    extra = extra_layout = extra_idx = None
    if extra_block is not None:
        extra, extra_layout = _cache(extra_block * 300, extra_block, seed=t + 2, device="cuda")
        extra_idx = _indices(t, extra_k, extra.shape[0], seed=t + 3, device="cuda")
    q = randn(t, heads, 512, seed=t + 4, device="cuda", dtype=torch.bfloat16)
    sink = randn(heads, seed=t + 5, device="cuda")
    scale = 512**-0.5
    got = fm.sparse_decode(q, cache, layout, main_idx, extra, extra_layout, extra_idx, sink, scale)
    want = fm.reference_sparse_decode(q.float(), cache, layout, main_idx, extra, extra_layout, extra_idx, sink, scale)
    assert got.shape == (t, heads, 512) and got.dtype == torch.bfloat16
    assert_close(got, want, torch.bfloat16)


@needs_flash_mla
@pytest.mark.gpu
def test_flashmla_under_cuda_graph():
    cache, layout = _cache(64 * 20, 64, seed=9, device="cuda")
    extra, extra_layout = _cache(64 * 20, 64, seed=10, device="cuda")
    main_idx = _indices(16, 128, cache.shape[0], seed=11, device="cuda")
    extra_idx = _indices(16, 512, extra.shape[0], seed=12, device="cuda")
    q = randn(16, 64, 512, seed=13, device="cuda", dtype=torch.bfloat16)
    sink = randn(64, seed=14, device="cuda")
    eager = fm.sparse_decode(q, cache, layout, main_idx, extra, extra_layout, extra_idx, sink, 0.05)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.sparse_decode(q, cache, layout, main_idx, extra, extra_layout, extra_idx, sink, 0.05)
    q.copy_(randn(16, 64, 512, seed=15, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    want = fm.sparse_decode(q, cache, layout, main_idx, extra, extra_layout, extra_idx, sink, 0.05)
    assert torch.equal(out, want) and not torch.equal(out, eager)
