"""Fixed-shape decode steps: a StepBatch whose every tensor shape depends only on a (slots, context) bucket.

A decode step runs one token per request. `engine.batch.build_step` sizes its tensors by the step's
contents (how many compressor windows close, the longest visible-entry list), so two decode steps rarely
share shapes. A CUDA graph needs the same shapes and no host decision on device data, so this builder
pads to a `DecodeShape`:
- `slots` rows: request rows first, then padding rows (token 0 at position 0) whose every page is the
  pool's scratch page (engine.cache: page 0 of each group), so their writes touch no request's rows;
- compressor plans have one entry per row, always: the window holding the row's token is pooled, and the
  result goes to the real entry row only where that token closes the window (position + 1 divisible by
  the ratio); other rows write their pooled garbage to the scratch page. A window's slots past the
  current token are never read from the chunk (they name the row's own token instead): their value
  is irrelevant, because only closing windows are kept, and those have no slot past the token;
- visible-entry lists are `context // ratio` wide, and page tables `ceil(context / tokens a page)` wide
  (longer reservations are cut: entries past `context` cannot be visible yet).
The forward computes exactly what it computes on `build_step`'s batch for the request rows (the tests
pin logits and cache bytes); the padding costs `slots - requests` extra token rows of work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.batch import CompressPlan, RingWrite, StepBatch, VisibleEntries, _paged_rows, _sources, _to_device
from engine.cache import CachePool


@dataclass(frozen=True)
class DecodeShape:
    """The bucket of a fixed-shape decode step: rows (requests + padding) and the largest context."""

    slots: int
    context: int

    def __post_init__(self) -> None:
        if self.slots < 1 or self.context < 1:
            raise ValueError(f"DecodeShape needs slots >= 1 and context >= 1, got {self.slots}, {self.context}")


def _padded_table(pages: list[int], width: int, scratch: int) -> list[int]:
    return (list(pages) + [scratch] * width)[:width]


def _tables(pool: CachePool, tables: list[dict], shape: DecodeShape) -> dict[str, torch.Tensor]:
    """Group name -> [slots, width] page ids; padding rows (and missing pages) are the scratch page."""
    out = {}
    for name, group in pool.groups.items():
        spec, scratch = group.spec, pool.scratch_pages[name]
        width = 1 if spec.fixed else max(1, math.ceil(shape.context / (spec.tokens_per_row * spec.page_rows)))
        rows = [_padded_table(t.get(name, []), width, scratch) for t in tables]
        rows += [[scratch] * width] * (shape.slots - len(tables))
        out[name] = torch.tensor(rows, dtype=torch.long)
    return out


def _decode_plan(pool: CachePool, entry_name: str, state_name: str, ratio: int, overlap: bool,
                 positions: torch.Tensor, tables: dict) -> CompressPlan:
    """One entry per row: the window holding the row's token; written for real only where it closes."""
    slots = positions.shape[0]
    rows = torch.arange(slots)
    state_spec, entry_spec = pool.groups[state_name].spec, pool.groups[entry_name].spec
    state_page = tables[state_name][:, 0]
    state_total = state_spec.num_pages * state_spec.page_rows
    window = positions // ratio
    cur_pos = (window * ratio).unsqueeze(1) + torch.arange(ratio)
    seg = rows.unsqueeze(1).expand_as(cur_pos)

    def sources(pos):
        # Slots after the token (an open window) would index chunk rows of other requests: name the
        # row's own token instead. Only closing windows are kept, and they have no such slot.
        return _sources(torch.minimum(pos, positions.unsqueeze(1)), seg, positions, rows, state_page,
                        state_spec.page_rows, state_total)

    closes = (positions + 1) % ratio == 0
    scratch_row = pool.scratch_pages[entry_name] * entry_spec.page_rows
    entry_row = torch.where(closes, _paged_rows(tables[entry_name], entry_spec.page_rows, rows, window),
                            torch.full_like(window, scratch_row))
    state_write = RingWrite(rows, state_page * state_spec.page_rows + positions % state_spec.page_rows)
    return CompressPlan(num_entries=slots, cur=sources(cur_pos), prev=sources(cur_pos - ratio) if overlap else None,
                        entry_row=entry_row, entry_pos=window * ratio, state_write=state_write)


def _decode_visible(pool: CachePool, name: str, ratio: int, positions: torch.Tensor, tables: dict,
                    shape: DecodeShape) -> VisibleEntries:
    width = max(1, shape.context // ratio)
    w = torch.arange(width).unsqueeze(0).expand(positions.shape[0], -1)
    seg = torch.arange(positions.shape[0]).unsqueeze(1).expand_as(w)
    valid = w < ((positions + 1) // ratio).unsqueeze(1)
    return VisibleEntries(_paged_rows(tables[name], pool.groups[name].spec.page_rows, seg, w), valid)


def build_decode_step(pool: CachePool, token_ids: list[int], positions: list[int], tables: list[dict],
                      shape: DecodeShape, device) -> StepBatch:
    """Request b runs token_ids[b] at positions[b] with pages tables[b]; -> a StepBatch of `shape`.

    No requests at all gives a batch of padding only (what a CUDA graph is captured on).

    Raises ValueError when the requests do not fit the shape (more requests than slots, or a position
    at or past the context). Logit rows are all `slots` rows; the caller reads the first len(token_ids).
    """
    n = len(token_ids)
    if not n <= shape.slots or len(positions) != n or len(tables) != n:
        raise ValueError(f"{n} decode requests do not fit {shape} (positions {len(positions)}, tables {len(tables)})")
    if positions and max(positions) >= shape.context:
        raise ValueError(f"position {max(positions)} does not fit {shape}")
    cfg = pool.cfg
    pad = shape.slots - n
    pos = torch.tensor(list(positions) + [0] * pad, dtype=torch.long)
    rows = torch.arange(shape.slots)
    group_tables = _tables(pool, tables, shape)

    swa_spec = pool.groups["swa"].spec
    window = cfg.sliding_window
    win_pos = pos.unsqueeze(1) - window + 1 + torch.arange(window)
    swa_page = group_tables["swa"][:, 0]
    swa = _sources(win_pos, rows.unsqueeze(1).expand_as(win_pos), pos, rows, swa_page, window,
                   swa_spec.num_pages * swa_spec.page_rows, swa_spec.page_rows)
    swa_write = RingWrite(rows, swa_page * swa_spec.page_rows + pos % window)

    compress, visible = {}, {}
    entry_groups = [(f"kv{r}", f"state{r}", r, r == 4) for r in cfg.ratios]
    if cfg.indexer_layers:
        entry_groups.append(("index", "index_state", 4, True))
    for entry_name, state_name, ratio, overlap in entry_groups:
        compress[entry_name] = _decode_plan(pool, entry_name, state_name, ratio, overlap, pos, group_tables)
        if entry_name != "kv4":  # CSA picks kv4 entries through the indexer
            visible[entry_name] = _decode_visible(pool, entry_name, ratio, pos, group_tables, shape)

    batch = StepBatch(
        token_ids=torch.tensor(list(token_ids) + [0] * pad, dtype=torch.long),
        positions=pos, seq_of_token=rows, cu=torch.arange(shape.slots + 1), starts=pos, ends=pos + 1,
        swa=swa, swa_write=swa_write, compress=compress, visible=visible, tables=group_tables,
        logit_rows=rows,
    )
    return _to_device(batch, device)
