"""The attention block's fast paths over quantised caches (`--kv-cache-dtype fp8`): CUDA, or Triton's interpreter.

Reference semantics (engine/model/attention.py): a key is the cache's dequantised row; this step's own rows enter as
the cache stores them (decode(encode(kv))); the compressor writes quantised entries; the indexer scores the
dequantised keys. Both paths here compute that without a host sync, so decode steps run under CUDA graphs:
- `flashmla_attend`, decode steps (one token per request) whose geometry FlashMLA takes: the token's kv row was
  written into the SWA ring first (`insert_decode_rows`: Triton norm + RoPE + fp8_ds_mla pack; the slot it
  overwrites holds position - window, outside the token's window), then FlashMLA reads the ring and the entry
  rows in place (dsv4_kernels.flashmla_sparse), its index lists built by one Triton launch
  (dsv4_kernels.triton_attention_rows);
- `dequantised_attend`, every other step (prefill chunks, mixed steps, geometries FlashMLA does not take): the
  keys a step names are dequantised into bf16 stores -- whole pages of the step's requests, or each query's
  own rows, whichever is fewer rows for these static shapes -- and FlashMLA's sparse prefill kernel reads them
  (dsv4_kernels.flashmla_prefill: bf16, 512-wide, <= 128 heads), else the engine's Triton MQA kernel; the caller
  writes the ring after (the chunk may overwrite ring slots its own queries read).
"""

from __future__ import annotations

import torch

from dsv4_kernels import flashmla_prefill
from engine.model.batch import StepBatch
from engine.model.cache import CacheLayer
from engine.model.fast_paths import use_flash_mla_prefill


def token_ring_rows(batch: StepBatch) -> torch.Tensor:
    """SWA ring row each token of a one-token-per-request step is written to. -> int [T].

    On such a step RingWrite's chunk rows are the tokens in order (engine.model.batch.build_step: one row a request, in
    request order; engine.model.decode_batch: arange(slots)), so its ring rows are already per token: no scatter."""
    return batch.swa_write.ring_row


def insert_decode_rows(
    kv_pre: torch.Tensor, weight: torch.Tensor, cos, sin, eps: float, ring: CacheLayer, batch: StepBatch
) -> torch.Tensor:
    """Normalise + rotate this step's kv and write it into the ring (Triton, one launch). -> [T, D].

    The ring is fp8_ds_mla (FlashMLA's decode) or exact rows in kv's dtype (the exact fast path's decode steps):
    the slot a decode token overwrites holds position - window, outside every window of this step."""
    from dsv4_kernels.triton_swa_insert import swa_insert  # imports triton: only on this path

    return swa_insert(
        kv_pre,
        weight,
        cos,
        sin,
        eps,
        ring.tensor,
        token_ring_rows(batch),
        ring.group.mla_layout if ring.quantised else None,
    )


def _padded(width: int) -> int:
    from dsv4_kernels.flashmla_sparse import TOPK_MULTIPLE

    return max(TOPK_MULTIPLE, -(-width // TOPK_MULTIPLE) * TOPK_MULTIPLE)


def flashmla_attend(
    q: torch.Tensor,
    ring: CacheLayer,
    entries: CacheLayer | None,
    comp: dict | None,
    batch: StepBatch,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """FlashMLA over the ring (already holding this step's rows) and the entry rows, read in place.

    comp: the entry side as dsv4_kernels.triton_attention_rows.attention_rows takes it (CSA: ids, table, seg, page_rows;
    HCA: comp_rows, comp_valid); None without entries. Both index lists are built in one launch, int32 and -1
    padded to FlashMLA's top-k multiple, so dsv4_kernels.flashmla_sparse adds no copy."""
    from dsv4_kernels.flashmla_sparse import sparse_decode
    from dsv4_kernels.triton_attention_rows import attention_rows  # imports triton: only on this path

    swa = batch.swa
    t = q.shape[0]
    main_idx = torch.empty(t, _padded(swa.ring_row.shape[1]), dtype=torch.int32, device=q.device)
    extra = extra_layout = extra_idx = None
    if entries is not None:
        if comp is None:
            raise ValueError("flashmla_attend: entries need their rows (comp)")
        k = (comp["ids"] if "ids" in comp else comp["comp_rows"]).shape[1]
        extra_idx = torch.empty(t, _padded(k), dtype=torch.int32, device=q.device)
        extra, extra_layout = entries.tensor, entries.group.mla_layout
    attention_rows(swa.ring_row, swa.valid, main_idx, out_comp=extra_idx, **(comp or {}))
    return sparse_decode(q, ring.tensor, ring.group.mla_layout, main_idx, extra, extra_layout, extra_idx, sink, scale)


def flashmla_unfit_reason(num_heads: int, ring: CacheLayer, entries: list[CacheLayer]) -> str:
    """'' when FlashMLA can run this block's decode attention, else why not."""
    from dsv4_kernels.flashmla_sparse import unfit_reason

    for layer in [ring] + entries:
        codec = layer.group.codec
        if codec is None or codec.fmt != "fp8_ds_mla":
            return f"group {layer.group.spec.name} is not fp8_ds_mla"
    return unfit_reason(num_heads, [layer.group.mla_layout for layer in [ring] + entries])


def _decoded_rows(layer: CacheLayer, rows: torch.Tensor) -> torch.Tensor:
    """Every named row (clamped at 0) dequantised, no de-duplication (static shapes). -> [N, dim]."""
    group = layer.group
    return group.decode(group.read_packed(layer.layer, rows.reshape(-1).clamp(min=0)))


def _store(
    layer: CacheLayer,
    rows: torch.Tensor,
    valid: torch.Tensor,
    pages: torch.Tensor,
    seg: torch.Tensor,
    local: torch.Tensor,
):
    """A bf16 store holding the keys `rows` [T, K] name, and their row ids in it (-1 where not valid).

    pages: [B, P] the step's page table of this group; local: [T, K] each key's row within its request's
    pages (page_idx * page_rows + offset). Dequantises whichever is fewer rows: the B * P pages, or T * K rows.
    """
    page_rows = layer.group.spec.page_rows
    t, k = rows.shape
    if pages.numel() * page_rows <= t * k:
        ids = (pages.unsqueeze(-1) * page_rows + torch.arange(page_rows, device=pages.device)).reshape(-1)
        store = _decoded_rows(layer, ids)
        idx = seg.unsqueeze(1) * (pages.shape[1] * page_rows) + local
    else:
        store = _decoded_rows(layer, rows)
        idx = torch.arange(t * k, device=rows.device).view(t, k)
    return store, torch.where(valid, idx, -1)


def dequantised_attend(
    q: torch.Tensor,
    chunk_keys: torch.Tensor,
    ring: CacheLayer,
    entries: CacheLayer | None,
    comp_rows,
    comp_ids,
    comp_valid,
    batch: StepBatch,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The Triton MQA kernel over dequantised stores [ring keys | chunk_keys | entry keys].

    chunk_keys: [T, D] this step's kv rows as the cache stores them; comp_rows / comp_ids / comp_valid:
    [T, E] global entry rows, entry numbers and visibility (None without entries). -> [T, H, D]."""
    from dsv4_kernels.triton_attention import sparse_mqa_attention_multi  # imports triton: only on this path

    swa = batch.swa
    stride = ring.group.spec.page_rows
    ring_keys, ring_idx = _store(
        ring,
        swa.ring_row,
        swa.valid & ~swa.from_chunk,
        batch.tables["swa"][:, :1],
        batch.seq_of_token,
        swa.ring_row % stride,
    )
    base = ring_keys.shape[0]
    swa_idx = torch.where(swa.from_chunk & swa.valid, base + swa.chunk_row, ring_idx)
    stores, parts = [ring_keys.to(q.dtype), chunk_keys.to(q.dtype)], [swa_idx]
    if entries is not None:
        name = entries.group.spec.name
        entry_keys, entry_idx = _store(
            entries, comp_rows, comp_valid, batch.tables[name], batch.seq_of_token, comp_ids.clamp(min=0)
        )
        parts.append(torch.where(entry_idx >= 0, entry_idx + base + chunk_keys.shape[0], -1))
        stores.append(entry_keys.to(q.dtype))
    total = sum(s.shape[0] for s in stores)
    rows = torch.cat(parts, dim=1).to(torch.int32 if total < 2**31 else torch.int64)
    if use_flash_mla_prefill(q.device) and not flashmla_prefill.unfit_reason(q, stores):
        return flashmla_prefill.sparse_prefill(q, stores, rows, sink, scale)
    return sparse_mqa_attention_multi(q, stores, rows, sink, scale)
