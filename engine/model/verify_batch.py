"""Fixed-shape verify steps: decode with `queries` token rows a request (speculative decoding's [last + K drafts]).

A verify step of MTP speculation runs, per request, its last token and its K drafts at consecutive positions
(engine.execution.speculative). As a fixed shape (vLLM's "uniform decode" with query length 1 + K) it is a
`DecodeShape` with `queries` = K + 1: slot b owns token rows b*q .. b*q + q - 1 at positions start_b ..
start_b + q - 1, so its tensors depend only on (slots, context, queries) and the step is capturable in a CUDA
graph (engine.execution.cuda_graphs) like a decode step. The batch is an ordinary multi-token StepBatch
(seq_of_token = row // q, cu = arange * q), so the model runs its varlen semantics on it: causal visibility
inside the q rows (a row's SWA window takes positions >= start_b from the chunk, older ones from the ring;
the ring is written after it is read), one compressor plan entry per row (the window holding the row's token,
kept only where it closes, as engine.model.decode_batch does), visible counts per row.

Rows past a request's tokens (fewer drafts than K) and padding slots carry the padding table row
(`BlockTables.pad_row`): every write they make (SWA ring, compressor state, closing entries) goes to the
scratch pages, and no real row reads them (a real row reads only chunk rows at positions <= its own). A padded
row repeats the position of its request's last real row (a padding slot: position 0), so it reads only what
that row reads (no entry past the request's reservation). Their logits are never read. With queries = 1 the batch equals decode_batch's (same tensors).

The MTP pass after a verify step runs on the same shape (engine.execution.mtp_graphs: each request's accepted
positions with the token after each, the rest padding; `swa_only`, as the MTP layers attend over the SWA ring
alone), and the chained MTP steps on queries = 1.

Derived on the device (no host sync, static shapes): with the Triton fast path (engine.model.fast_paths.use_triton)
in one launch of the fused prologue (dsv4_kernels.triton_decode_prologue with `queries` rows a slot and the padding
table row; its descriptors built once per bucket, engine.model.decode_batch.PrologueLayout, cached on the
BlockTables), else as the torch ops of `derive_verify_batch_reference` (~220 small kernels inside the step's graph;
equal element for element: tests/engine/test_verify_prologue.py). The MTP batches (swa_only) take the same paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.batch import CompressPlan, RingWrite, StepBatch, VisibleEntries, paged_rows, ring_sources
from engine.model.cache import CachePool
from engine.model.decode_batch import BlockTables, DecodeShape, PrologueLayout, entry_groups, table_widths
from engine.model.fast_paths import use_triton
from engine.model.prologue_check import derive_checked


@dataclass(frozen=True)
class VerifyShape:
    """A verify bucket: `decode.slots` requests of `queries` token rows each, positions < `decode.context`."""

    decode: DecodeShape
    queries: int

    def __post_init__(self) -> None:
        if self.queries < 1:
            raise ValueError(f"VerifyShape needs queries >= 1, got {self.queries}")

    @property
    def rows(self) -> int:
        return self.decode.slots * self.queries


@dataclass(frozen=True)
class VerifyInputs:
    """int64 [3, slots * queries] rows (token id, position, BlockTables row): one host-to-device copy a step."""

    packed: torch.Tensor

    @staticmethod
    def make(
        token_rows: list[list[int]], starts: list[int], table_rows: list[int], shape: VerifyShape, pad_row: int
    ) -> VerifyInputs:
        """token_rows[b]: request b's tokens (1..queries) from position starts[b]; table_rows[b]: its table row."""
        q, n = shape.queries, len(token_rows)
        if n > shape.decode.slots or len(starts) != n or len(table_rows) != n:
            raise ValueError(f"{n} verify requests do not fit {shape}")
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        for b in range(shape.decode.slots):
            toks, start, row = (token_rows[b], starts[b], table_rows[b]) if b < n else ([], 0, pad_row)
            if len(toks) > q or start + q > shape.decode.context:
                raise ValueError(f"request {b} ({len(toks)} tokens at {start}) does not fit {shape}")
            ids += list(toks) + [0] * (q - len(toks))
            last = start + max(len(toks), 1) - 1  # padded rows repeat it: they read nothing a real row does not
            pos += list(range(start, last + 1)) + [last] * (q - max(len(toks), 1))
            rows += [row] * len(toks) + [pad_row] * (q - len(toks))
        return VerifyInputs(torch.tensor([ids, pos, rows], dtype=torch.long))


def derive_verify_batch(
    pool: CachePool, tables: BlockTables, packed: torch.Tensor, shape: VerifyShape, swa_only: bool = False
) -> StepBatch:
    """The StepBatch of a verify step from device inputs `packed` (VerifyInputs.packed): static shapes, no host
    sync. Request tables come from each slot's first row (always a real row for a real slot). swa_only: no
    compressor plans nor visible entries (empty dicts), for the MTP layers, whose attention is sliding-window
    only (engine.model.mtp; engine.execution.mtp_graphs runs them on these batches).

    One launch of the fused prologue where engine.model.fast_paths.use_triton says so, else the torch ops of
    `derive_verify_batch_reference` (equal element for element; compared again on each bucket's first use outside
    capture, engine.model.prologue_check)."""
    if use_triton(packed.device):
        key = (shape.decode, shape.queries, swa_only)
        layout = tables.verify_layouts.get(key)
        if layout is None:
            layout = tables.verify_layouts[key] = PrologueLayout(
                pool, tables, shape.decode, shape.queries, tables.pad_row, swa_only
            )
        return derive_checked(
            layout,
            lambda: layout.derive(packed),
            lambda: derive_verify_batch_reference(pool, tables, packed, shape, swa_only),
            packed.device,
        )
    return derive_verify_batch_reference(pool, tables, packed, shape, swa_only)


def derive_verify_batch_reference(
    pool: CachePool, tables: BlockTables, packed: torch.Tensor, shape: VerifyShape, swa_only: bool = False
) -> StepBatch:
    """derive_verify_batch as torch ops (~220 kernels a step on a GPU, 40 with swa_only): the reference of the fused
    prologue."""
    cfg, device = pool.cfg, packed.device
    s, q = shape.decode.slots, shape.queries
    ids, pos, trow = packed[0], packed[1], packed[2]
    t_rows = torch.arange(s * q, device=device)
    seg = t_rows // q
    starts = pos.view(s, q)[:, 0]
    cu = torch.arange(s + 1, device=device) * q
    live = trow != tables.pad_row  # rows of real tokens; the others write only scratch pages
    widths = table_widths(pool, shape.decode.context)
    slot_rows = trow.view(s, q)[:, 0]
    group_tables = {name: t.index_select(0, slot_rows)[:, : widths[name]] for name, t in tables.tables.items()}

    def scratch(name: str, ring: int) -> torch.Tensor:
        return pool.scratch_pages[name] * pool.groups[name].spec.page_rows + pos % ring

    swa_spec, window = pool.groups["swa"].spec, cfg.sliding_window
    swa_page = group_tables["swa"][:, 0]
    win_pos = pos.unsqueeze(1) - window + 1 + torch.arange(window, device=device)
    swa = ring_sources(
        win_pos,
        seg.unsqueeze(1),
        starts,
        cu,
        swa_page,
        window,
        swa_spec.num_pages * swa_spec.page_rows,
        swa_spec.page_rows,
    )
    swa_write = RingWrite(
        t_rows, torch.where(live, swa_page[seg] * swa_spec.page_rows + pos % window, scratch("swa", window))
    )
    compress, visible = {}, {}
    for entry, state, ratio, overlap in [] if swa_only else entry_groups(cfg):
        st, es = pool.groups[state].spec, pool.groups[entry].spec
        state_page, total = group_tables[state][:, 0], st.num_pages * st.page_rows
        window_id = pos // ratio
        cur_pos = (window_id * ratio).unsqueeze(1) + torch.arange(ratio, device=device)
        # slots past the row's token (an open window) name the token itself: only closing windows are kept

        def sources(p, state_page=state_page, st=st, total=total):
            return ring_sources(
                torch.minimum(p, pos.unsqueeze(1)), seg.unsqueeze(1), starts, cu, state_page, st.page_rows, total
            )

        closes = live & ((pos + 1) % ratio == 0)
        scratch_entry = torch.full_like(pos, pool.scratch_pages[entry] * es.page_rows)
        entry_row = torch.where(closes, paged_rows(group_tables[entry], es.page_rows, seg, window_id), scratch_entry)
        state_row = torch.where(live, state_page[seg] * st.page_rows + pos % st.page_rows, scratch(state, st.page_rows))
        compress[entry] = CompressPlan(
            num_entries=s * q,
            cur=sources(cur_pos),
            prev=sources(cur_pos - ratio) if overlap else None,
            entry_row=entry_row,
            entry_pos=window_id * ratio,
            state_write=RingWrite(t_rows, state_row),
        )
        if entry != "kv4":  # CSA picks kv4 entries through the indexer
            w = torch.arange(max(1, shape.decode.context // ratio), device=device).unsqueeze(0)
            rows = paged_rows(group_tables[entry], es.page_rows, torch.arange(s, device=device).unsqueeze(1), w)
            visible[entry] = VisibleEntries(rows, (pos + 1) // ratio, seg)
    return StepBatch(
        token_ids=ids,
        positions=pos,
        seq_of_token=seg,
        cu=cu,
        starts=starts,
        ends=starts + q,
        swa=swa,
        swa_write=swa_write,
        compress=compress,
        visible=visible,
        tables=group_tables,
        logit_rows=t_rows,
    )
