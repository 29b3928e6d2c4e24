"""dsv4_kernels.flashmla_prefill: FlashMLA's sparse prefill over the row concatenation of bf16 stores against the
plain-torch reference and the engine's Triton kernel, on fresh random inputs.

The argument checks run everywhere (CPU); FlashMLA itself needs an sm90 GPU with tokenspeed-flashmla installed:
those tests are marked gpu and skip elsewhere.
"""

import pytest
import torch

from dsv4_kernels import flashmla_prefill as fp
from dsv4_kernels.attention import sparse_attention
from dsv4_kernels.gpu import has_flash_mla, why_not
from tests.support.numerics import assert_close, randn

needs_flash_mla = pytest.mark.skipif(
    not torch.cuda.is_available() or not has_flash_mla(),
    reason="GPU only: FlashMLA needs an sm90 GPU with tokenspeed-flashmla installed (pip install '.[gpu]'): "
    + (why_not("flash_mla") or "no CUDA device"),
)


def _rows(t: int, k: int, total: int, seed: int, device="cpu", invalid: float = 0.25) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, total, (t, k), generator=g)
    rows[torch.rand(t, k, generator=g) < invalid] = -1
    rows[0] = -1  # a query with no visible row: all mass on the sink, zero output
    return rows.to(device)


def test_padded_rows_is_int32_and_a_multiple_of_128():
    rows = _rows(5, 130, 1000, seed=1)
    got = fp.padded_rows(rows)
    assert got.dtype == torch.int32 and got.shape == (5, 1, 256)
    assert torch.equal(got[:, 0, :130], rows.to(torch.int32)) and (got[:, 0, 130:] == -1).all()
    assert fp.padded_rows(rows[:, :128]).shape == (5, 1, 128)


def test_unfit_reasons_on_the_cpu_and_bad_shapes():
    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    stores = [torch.zeros(10, 512, dtype=torch.bfloat16)]
    assert "CUDA" in fp.unfit_reason(q, stores)
    assert [fp.padded_heads(h) for h in (1, 16, 64, 65, 128)] == [64, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="cannot run"):
        fp.sparse_prefill(q, stores, torch.zeros(4, 64, dtype=torch.int32), torch.zeros(64), 0.05)


@needs_flash_mla
@pytest.mark.gpu
@pytest.mark.parametrize(
    "t,heads,sizes,k",
    [
        (300, 64, (256, 300, 128), 640),  # CSA-shaped: window + top-512 over ring | chunk | entries
        (257, 64, (64, 257), 128),  # SWA-only layer: ring | chunk, window 128
        (100, 16, (128, 100, 33), 161),  # a tensor-parallel rank's 16 heads (padded to 64), K not a multiple of 64
        (64, 128, (512,), 200),  # one store, 128 heads
    ],
)
def test_sparse_prefill_matches_reference_and_triton(t, heads, sizes, k):
    from dsv4_kernels.triton_attention import sparse_mqa_attention_multi

    stores = [randn(n, 512, seed=10 + i, device="cuda", dtype=torch.bfloat16) for i, n in enumerate(sizes)]
    rows = _rows(t, k, sum(sizes), seed=t + k, device="cuda")
    q = randn(t, heads, 512, seed=t, device="cuda", dtype=torch.bfloat16)
    sink = randn(heads, seed=heads, device="cuda")
    scale = 512**-0.5
    got = fp.sparse_prefill(q, stores, rows, sink, scale)
    kv = torch.cat(stores).float()
    want = sparse_attention(q.float(), kv[rows.clamp(min=0)], rows >= 0, sink, scale)
    assert got.shape == (t, heads, 512) and got.dtype == torch.bfloat16
    assert_close(got, want, torch.bfloat16)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert_close(got, sparse_mqa_attention_multi(q, stores, rows, sink, scale).float(), torch.bfloat16)


@needs_flash_mla
@pytest.mark.gpu
def test_sparse_prefill_under_cuda_graph():
    stores = [randn(n, 512, seed=20 + n, device="cuda", dtype=torch.bfloat16) for n in (128, 96)]
    rows = _rows(96, 192, 224, seed=3, device="cuda")
    q = randn(96, 64, 512, seed=4, device="cuda", dtype=torch.bfloat16)
    sink = randn(64, seed=5, device="cuda")
    eager = fp.sparse_prefill(q, stores, rows, sink, 0.05)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp.sparse_prefill(q, stores, rows, sink, 0.05)
    q.copy_(randn(96, 64, 512, seed=6, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    want = fp.sparse_prefill(q, stores, rows, sink, 0.05)
    assert torch.equal(out, want) and not torch.equal(out, eager)
