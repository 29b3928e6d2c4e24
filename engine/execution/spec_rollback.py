"""Rollback of rejected draft tokens in the per-request ring groups (speculative decoding).

Why: a verify step runs [last token + K drafts] through the target like a short prefill chunk, so every layer
writes those K+1 positions into the request's fixed (one page a request) rings: the SWA ring (slot = pos %
window, main layers and the MTP layers' rows) and the compressor state rings (`state{r}`, `index_state`: slot =
pos % rows). A rejected position p overwrote the slot of position p - ring, which a later query (or a window
that closes later) still reads. So the rows a verify step will write are saved before it and the rejected
positions' rows are put back after acceptance: afterwards every ring holds exactly what it would hold had the
rejected tokens never run. The paged groups (compressed KV `kv{r}`, indexer keys `index`) need nothing: their
rows are addressed by position, an entry a rejected token closed is visible to no accepted query, and the
accepted path rewrites it (in the same layer, before attention reads it) when it reaches that position.

Quantised rings (fp8_ds_mla SWA rows) are saved and restored as their packed bytes, so a restore is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.batch import to_device_nonblocking
from engine.model.cache import CacheGroup, CachePool


@dataclass(frozen=True)
class SavedRows:
    """One ring group's rows of one or more requests at their positions [N in all], as stored: [layers, N, width]
    (exact) or [layers, N, row_bytes] (packed)."""

    group: str
    layers: tuple[int, ...]
    rows: torch.Tensor  # [N] row ids in the group's tensor
    values: torch.Tensor
    counts: tuple[int, ...] = ()  # rows of each request saved, in order (0 where its table lacks the group)


def ring_rows(pool: CachePool, name: str, table: dict, positions: torch.Tensor) -> torch.Tensor:
    """Rows of ring group `name` that positions [N] write (slot = pos % ring length, as engine.model.batch)."""
    spec = pool.groups[name].spec
    ring = pool.cfg.sliding_window if name == "swa" else spec.page_rows
    return table[name][0] * spec.page_rows + positions % ring


def save(pool: CachePool, table: dict, positions: torch.Tensor, layers: dict | None = None) -> list[SavedRows]:
    """Copies of every ring group's rows that `positions` [N] (distinct mod every ring) write for the request with
    page table `table`. layers: {group: model layer ids} to save only those (default: every ring group, all
    layers)."""
    return save_requests(pool, [table], [positions], layers)


def save_requests(
    pool: CachePool, tables: list[dict], positions: list[torch.Tensor], layers: dict | None = None
) -> list[SavedRows]:
    """`save` over several requests at once (request i: tables[i], positions[i]): one gather a group and layer for
    all of them (their rows are disjoint: one ring page a request). The row ids reach the device by a non-blocking
    copy, so saving does not wait for the steps already queued."""
    out = []
    for name, group in pool.groups.items():
        if not group.spec.fixed or (layers is not None and name not in layers):
            continue
        held = [ring_rows(pool, name, t, p) for t, p in zip(tables, positions) if name in t]
        if not held:
            continue
        counts = tuple(len(p) if name in t else 0 for t, p in zip(tables, positions))
        ids = tuple(layers[name]) if layers is not None else group.spec.layers
        rows = to_device_nonblocking(torch.cat(held), group.tensor.device)
        out.append(save_rows(pool, name, ids, rows, counts))
    return out


def save_requests_at(pool: CachePool, tables: list[dict], positions: torch.Tensor) -> list[SavedRows]:
    """`save_requests` at positions on the device (int64 [requests, per_request], computed there: no host read), every
    ring group of every layer; request i's table tables[i] (each must hold every ring group)."""
    out = []
    for name, group in pool.groups.items():
        if not group.spec.fixed:
            continue
        spec = group.spec
        ring = pool.cfg.sliding_window if name == "swa" else spec.page_rows
        base = torch.tensor([t[name][0] * spec.page_rows for t in tables], dtype=torch.int64)
        rows = to_device_nonblocking(base, positions.device).unsqueeze(1) + positions % ring
        out.append(save_rows(pool, name, spec.layers, rows.reshape(-1), (positions.shape[1],) * len(tables)))
    return out


def save_rows(
    pool: CachePool, name: str, layers: tuple[int, ...], rows: torch.Tensor, counts: tuple[int, ...] = ()
) -> SavedRows:
    """Copies of rows [N] (row ids on the group's device: they may be computed there, no host read) of ring group
    `name` in `layers`."""
    group = pool.groups[name]
    if group.quantised:
        values = torch.stack([group.read_packed(layer, rows) for layer in layers])
    elif (span := _slot_span(group, layers)) is not None:
        values = group.tensor[span][:, rows]  # one gather for all the layers
    else:
        values = torch.stack([group.layer(layer)[rows] for layer in layers])
    return SavedRows(name, layers, rows, values, counts)


def _slot_span(group: CacheGroup, layers: tuple[int, ...]) -> slice | None:
    """The storage slots of `layers` when consecutive (every ring group's layers, or the MTP layers), else None."""
    slots = [group.spec.layer_slot(layer) for layer in layers]
    return slice(slots[0], slots[0] + len(slots)) if slots == list(range(slots[0], slots[0] + len(slots))) else None


def restore_tails(pool: CachePool, saved: list[SavedRows], kept: list[int]) -> None:
    """Write back, from saves of several requests (save_requests), the rows of request i's positions past its first
    kept[i] (its rejected ones): one scatter a group for all of them."""
    for s in saved:
        starts = [sum(s.counts[:i]) for i in range(len(s.counts))]
        back = [a + j for a, n, k in zip(starts, s.counts, kept) for j in range(k, n)]
        if back:
            _write_back(pool, s, to_device_nonblocking(torch.tensor(back), s.rows.device))


def restore_rejected(pool: CachePool, saved: list[SavedRows], kept: torch.Tensor, per_request: int) -> None:
    """Write back the rejected rows of saves of several requests that each saved `per_request` consecutive positions
    (save_requests), request i's first kept[i] positions kept (kept: int64 [requests] on the device, read by no host
    code: every saved row is written, the kept ones with their current values)."""
    offsets = torch.arange(per_request, device=kept.device)
    for s in saved:
        held = [i for i, n in enumerate(s.counts) if n]  # the requests whose tables hold this group
        if any(s.counts[i] != per_request for i in held):
            raise ValueError(f"restore_rejected: every request must save {per_request} rows, got {s.counts}")
        index = to_device_nonblocking(torch.tensor(held), kept.device)
        rejected = (offsets.unsqueeze(0) >= kept[index].unsqueeze(1)).reshape(-1)  # [N]
        _write_where(pool, s, rejected)


def _write_where(pool: CachePool, s: SavedRows, rejected: torch.Tensor) -> None:
    """Rows of `s` where rejected [N] (bool, on the device) get their saved values, the others keep theirs."""
    group = pool.groups[s.group]
    if s.rows.numel() == 0:
        return
    span = None if group.quantised else _slot_span(group, s.layers)
    if span is not None:
        now = group.tensor[span][:, s.rows]
        group.tensor[span][:, s.rows] = torch.where(rejected[None, :, None], s.values, now)
        return
    for i, layer in enumerate(s.layers):
        if group.quantised:
            now = group.read_packed(layer, s.rows)
            group.write_packed(layer, s.rows, torch.where(rejected[:, None], s.values[i], now))
        else:
            now = group.layer(layer)[s.rows]
            group.layer(layer)[s.rows] = torch.where(rejected.view(-1, *[1] * (now.dim() - 1)), s.values[i], now)


def restore(pool: CachePool, saved: list[SavedRows], keep: slice | None = None) -> None:
    """Write the saved rows back (only positions[keep] when given: the rejected ones)."""
    for s in saved:
        _write_back(pool, s, keep)


def _write_back(pool: CachePool, s: SavedRows, keep: slice | torch.Tensor | None) -> None:
    """The saved rows `keep` picks (a slice or an index tensor; None: all) back into the group."""
    group = pool.groups[s.group]
    rows = s.rows if keep is None else s.rows[keep]
    values = s.values if keep is None else s.values[:, keep]
    if rows.numel() == 0:
        return
    span = None if group.quantised else _slot_span(group, s.layers)
    if span is not None:
        group.tensor[span][:, rows] = values  # one scatter for all the layers
        return
    for i, layer in enumerate(s.layers):
        if group.quantised:
            group.write_packed(layer, rows, values[i])
        else:
            group.layer(layer)[rows] = values[i]
