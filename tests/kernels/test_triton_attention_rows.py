"""Triton attention row ids (dsv4_kernels/triton_attention_rows.py) against the torch glue they replace.

Runs compiled on a GPU when one is present, else in triton's CPU interpreter.
"""

import pytest
import torch

from dsv4_kernels.triton_attention_rows import attention_rows  # noqa: E402
from engine.model.batch import paged_rows  # noqa: E402
from tests.support.triton_env import DEVICE  # noqa: E402  (sets TRITON_INTERPRET first; may skip)

T, W = 6, 20


def rand(seed):
    g = torch.Generator().manual_seed(seed)
    swa = torch.randint(0, 500, (T, W), generator=g).to(DEVICE)
    valid = (torch.rand(T, W, generator=g) > 0.3).to(DEVICE)
    return g, swa, valid


def padded(x, width):
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1).to(torch.int32)


@pytest.mark.parametrize("idtype", [torch.int64, torch.int32])
def test_csa_ids_side_by_side(idtype):
    """[swa | CSA entries] in one tensor (two column views), entries through the page table, + base."""
    g, swa, valid = rand(1)
    k, b, p, page_rows, base = 9, 3, 4, 5, 777
    ids = torch.randint(-1, p * page_rows + 3, (T, k), generator=g).to(DEVICE, idtype)  # past the table: clamped
    ids[0] = -1
    table = torch.randint(0, 50, (b, p), generator=g).to(DEVICE)
    seg = torch.tensor([0, 0, 1, 2, 2, 1], device=DEVICE)
    out = torch.empty(T, W + k, dtype=torch.int32, device=DEVICE)
    attention_rows(
        swa, valid, out[:, :W], ids=ids, table=table, seg=seg, page_rows=page_rows, base=base, out_comp=out[:, W:]
    )
    rows = paged_rows(table, page_rows, seg.unsqueeze(1).expand_as(ids), ids.long())
    expected = torch.cat([torch.where(valid, swa, -1), torch.where(ids >= 0, rows + base, -1)], 1)
    assert torch.equal(out, expected.to(torch.int32))


def test_hca_rows_padded_destinations():
    """Separate destinations padded with -1 (FlashMLA's multiples of 64)."""
    g, swa, valid = rand(2)
    k = 11
    rows = torch.randint(0, 900, (T, k), generator=g).to(DEVICE)
    cvalid = (torch.rand(T, k, generator=g) > 0.5).to(DEVICE)
    main = torch.empty(T, 64, dtype=torch.int32, device=DEVICE)
    extra = torch.empty(T, 64, dtype=torch.int32, device=DEVICE)
    attention_rows(swa, valid, main, comp_rows=rows, comp_valid=cvalid, out_comp=extra)
    assert torch.equal(main, padded(torch.where(valid, swa, -1), 64))
    assert torch.equal(extra, padded(torch.where(cvalid, rows, -1), 64))


def test_swa_only_and_bad_inputs():
    _, swa, valid = rand(3)
    out = torch.empty(T, W, dtype=torch.int32, device=DEVICE)
    attention_rows(swa, valid, out)
    assert torch.equal(out, torch.where(valid, swa, -1).to(torch.int32))
    with pytest.raises(ValueError, match="out_swa"):
        attention_rows(swa, valid, out[:, :3])
    with pytest.raises(ValueError, match="table"):
        attention_rows(swa, valid, out, ids=swa, out_comp=out)
    with pytest.raises(ValueError, match="swa_valid"):
        attention_rows(swa, valid.int(), out)


def test_hca_rows_per_request_with_counts():
    """The engine's HCA form: per-request rows [B, K], each token's request and visible count."""
    g, swa, valid = rand(3)
    k = 13
    rows = torch.randint(0, 900, (2, k), generator=g).to(DEVICE)
    seg = torch.randint(0, 2, (T,), generator=g).to(DEVICE)
    count = torch.randint(0, k + 1, (T,), generator=g).to(DEVICE)
    main = torch.empty(T, 64, dtype=torch.int32, device=DEVICE)
    extra = torch.empty(T, 64, dtype=torch.int32, device=DEVICE)
    attention_rows(swa, valid, main, comp_rows=rows, seg=seg, comp_count=count, base=7, out_comp=extra)
    listed = torch.where(torch.arange(k, device=DEVICE) < count.unsqueeze(1), rows[seg] + 7, -1)
    assert torch.equal(main, padded(torch.where(valid, swa, -1), 64))
    assert torch.equal(extra, padded(listed, 64))
