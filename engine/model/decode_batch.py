"""Fixed-shape decode steps: a StepBatch whose every tensor shape depends only on a (slots, context) bucket.

A decode step runs one token per request. `engine.model.batch.build_step` sizes its tensors by the step's
contents (how many compressor windows close, the longest visible-entry list), so two decode steps rarely
share shapes. A CUDA graph needs the same shapes and no host decision on device data, so this module
pads to a `DecodeShape` and derives every index tensor *on the device* from three small inputs
(`DecodeInputs`: token ids, positions, block-table rows) and a persistent `BlockTables`:
- `slots` rows: request rows first, then padding rows (token 0 at position 0) whose table row is all
  scratch pages (engine.model.cache: page 0 of each group), so their writes touch no request's rows;
- compressor plans have one entry per row, always: the window holding the row's token is pooled, and the
  result goes to the real entry row only where that token closes the window (position + 1 divisible by
  the ratio); other rows write their pooled garbage to the scratch page. A window's slots past the
  current token are never read from the chunk (they name the row's own token instead): their value
  is irrelevant, because only closing windows are kept, and those have no slot past the token;
- visible-entry rows are `context // ratio` wide (one row per slot: T == B here), with a visible count per
  slot, and page tables `ceil(context / tokens a page)` wide
  (longer reservations are cut: entries past `context` cannot be visible yet).
The host's work per step is three [slots] int64 vectors (one copy); `derive_decode_batch` is one Triton
launch (dsv4_kernels.triton_decode_prologue, laid out per bucket by `PrologueLayout`) or, without Triton, the torch
ops of `derive_decode_batch_reference` (equal element for element); both have static shapes and no host sync,
so the derivation is captured into the step's CUDA graph with the forward (engine.execution.cuda_graphs).
The forward computes exactly what it computes on `build_step`'s batch for the request rows (the tests
pin logits and cache bytes); the padding costs `slots - requests` extra token rows of work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.model.batch import (
    CompressPlan,
    RingWrite,
    SourceRows,
    StepBatch,
    VisibleEntries,
    copy_nonblocking_,
    paged_rows,
)
from engine.model.cache import CachePool
from engine.model.fast_paths import use_triton
from engine.model.prologue_check import derive_checked


@dataclass(frozen=True)
class DecodeShape:
    """The bucket of a fixed-shape decode step: rows (requests + padding) and the largest context."""

    slots: int
    context: int

    def __post_init__(self) -> None:
        if self.slots < 1 or self.context < 1:
            raise ValueError(f"DecodeShape needs slots >= 1 and context >= 1, got {self.slots}, {self.context}")


@dataclass(frozen=True)
class DecodeInputs:
    """What changes between two decode steps of one shape: int64 [3, slots] rows (token id, position,
    BlockTables row) -- one tensor, so refreshing a graph's inputs is one host-to-device copy."""

    packed: torch.Tensor

    @property
    def token_ids(self) -> torch.Tensor:
        return self.packed[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.packed[1]

    @property
    def table_rows(self) -> torch.Tensor:
        return self.packed[2]

    @staticmethod
    def make(
        token_ids: list[int], positions: list[int], table_rows: list[int], shape: DecodeShape, pad_row: int
    ) -> DecodeInputs:
        n = len(token_ids)
        if not n <= shape.slots or len(positions) != n or len(table_rows) != n:
            raise ValueError(
                f"{n} decode requests do not fit {shape} (positions {len(positions)}, table rows {len(table_rows)})"
            )
        if positions and max(positions) >= shape.context:
            raise ValueError(f"position {max(positions)} does not fit {shape}")
        pad = shape.slots - n
        return DecodeInputs(
            torch.tensor(
                [list(token_ids) + [0] * pad, list(positions) + [0] * pad, list(table_rows) + [pad_row] * pad],
                dtype=torch.long,
            )
        )


def table_widths(pool: CachePool, context: int) -> dict[str, int]:
    """Pages of each group that positions below `context` can touch."""
    return {
        name: 1 if g.spec.fixed else max(1, math.ceil(context / (g.spec.tokens_per_row * g.spec.page_rows)))
        for name, g in pool.groups.items()
    }


class BlockTables:
    """Persistent page tables, one row per live request, per cache group, on the device.

    Rows are assigned to request ids on first use and rewritten only when a request's page table changes
    (another table object under the same id, or more pages; reservations are whole-request, so normally
    a row is written once). The last row is the padding row (all
    scratch pages). When rows run out, rows of requests absent from the current step are reclaimed.
    """

    def __init__(self, pool: CachePool, max_requests: int, max_context: int, device):
        self.pool = pool
        self.pad_row = max_requests
        self.widths = table_widths(pool, max_context)
        # Every group's columns side by side in one tensor (the fused prologue reads one row of it; a new row
        # is one copy); `tables` holds each group's column view.
        self.columns: dict[str, int] = {}
        for name in self.widths:
            self.columns[name] = sum(self.widths[n] for n in self.columns)
        self.scratch_line = torch.cat(
            [torch.full((w,), pool.scratch_pages[name], dtype=torch.long) for name, w in self.widths.items()]
        )
        self.table = self.scratch_line.to(device).unsqueeze(0).repeat(max_requests + 1, 1)
        self.tables = {name: self.table[:, c : c + self.widths[name]] for name, c in self.columns.items()}
        self.layouts: dict[DecodeShape, PrologueLayout] = {}  # fused-prologue descriptors per bucket
        # and per verify bucket (engine.model.verify_batch): (bucket, queries, swa_only) -> descriptors
        self.verify_layouts: dict[tuple[DecodeShape, int, bool], PrologueLayout] = {}
        # request id -> (row, the page-table dict written, its page count then). The dict itself is kept
        # (identity check): a later request reusing an id brings a new dict, so its row is rewritten.
        self._rows: dict[str, tuple[int, dict, int]] = {}
        self._free = list(range(max_requests - 1, -1, -1))

    def rows_for(self, request_ids: list[str], page_tables: list[dict]) -> list[int]:
        """Table rows of these requests (writing rows that are new or grew)."""
        out = []
        for rid, pages in zip(request_ids, page_tables):
            count = sum(map(len, pages.values()))
            row, written, written_count = self._rows.get(rid, (None, None, -1))
            if row is None:
                row = self._take_row(set(request_ids))
            if written is not pages or written_count != count:
                self._write(row, pages)
                self._rows[rid] = (row, pages, count)
            out.append(row)
        return out

    def _take_row(self, live: set) -> int:
        if not self._free:
            for rid in [r for r in self._rows if r not in live]:
                self._free.append(self._rows.pop(rid)[0])
        if not self._free:
            raise RuntimeError("BlockTables: more live requests than rows")
        return self._free.pop()

    def _write(self, row: int, pages: dict) -> None:
        line = self.scratch_line.tolist()
        for name, col in self.columns.items():
            ids = list(pages.get(name, ()))[: self.widths[name]]
            line[col : col + len(ids)] = ids
        # one host-to-device copy a new row, after the steps already queued (which read the old row) and without
        # waiting for them: under overlapped decode a step is in flight whenever a request joins or grows a page
        host = torch.tensor(line, dtype=torch.long)
        copy_nonblocking_(self.table[row], host)


def _decode_sources(
    p: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    ring_page: torch.Tensor,
    ring_rows: int,
    ring_total_rows: int,
    page_stride: int | None = None,
) -> SourceRows:
    """engine.model.batch.ring_sources for a decode step, in 9 ops instead of 15 (each is a kernel in the graph).

    p: [S, W] positions, each <= its row's token position; row b's chunk is its one token at positions[b],
    chunk row b (rows = arange(S)), so a position from the chunk is exactly the token's own and names row b."""
    from_chunk = p >= positions.unsqueeze(1)
    chunk_row = torch.where(from_chunk, rows.unsqueeze(1), 0)
    ring_row = (ring_page * (page_stride or ring_rows)).unsqueeze(1) + p.clamp(min=0) % ring_rows
    return SourceRows(
        from_chunk, chunk_row, ring_row, p >= 0, torch.where(from_chunk, ring_total_rows + chunk_row, ring_row)
    )


def _decode_plan(
    pool: CachePool,
    entry_name: str,
    state_name: str,
    ratio: int,
    overlap: bool,
    positions: torch.Tensor,
    rows: torch.Tensor,
    tables: dict,
) -> CompressPlan:
    """One entry per row: the window holding the row's token; written for real only where it closes."""
    state_spec, entry_spec = pool.groups[state_name].spec, pool.groups[entry_name].spec
    state_page = tables[state_name][:, 0]
    state_total = state_spec.num_pages * state_spec.page_rows
    window = positions // ratio
    cur_pos = (window * ratio).unsqueeze(1) + torch.arange(ratio, device=positions.device)

    def sources(pos):
        # Slots after the token (an open window) would index chunk rows of other requests: name the
        # row's own token instead. Only closing windows are kept, and they have no such slot.
        return _decode_sources(
            torch.minimum(pos, positions.unsqueeze(1)), positions, rows, state_page, state_spec.page_rows, state_total
        )

    closes = (positions + 1) % ratio == 0
    scratch_row = pool.scratch_pages[entry_name] * entry_spec.page_rows
    entry_row = torch.where(
        closes, paged_rows(tables[entry_name], entry_spec.page_rows, rows, window), torch.full_like(window, scratch_row)
    )
    state_write = RingWrite(rows, state_page * state_spec.page_rows + positions % state_spec.page_rows)
    return CompressPlan(
        num_entries=positions.shape[0],
        cur=sources(cur_pos),
        prev=sources(cur_pos - ratio) if overlap else None,
        entry_row=entry_row,
        entry_pos=window * ratio,
        state_write=state_write,
    )


def _decode_visible(
    pool: CachePool,
    name: str,
    ratio: int,
    positions: torch.Tensor,
    rows: torch.Tensor,
    tables: dict,
    shape: DecodeShape,
) -> VisibleEntries:
    w = torch.arange(max(1, shape.context // ratio), device=positions.device).unsqueeze(0)
    return VisibleEntries(
        paged_rows(tables[name], pool.groups[name].spec.page_rows, rows.unsqueeze(1), w), (positions + 1) // ratio, rows
    )


def derive_decode_batch(pool: CachePool, tables: BlockTables, inputs: DecodeInputs, shape: DecodeShape) -> StepBatch:
    """The StepBatch of a decode step from device inputs: static shapes, no host sync (capturable).

    With the Triton fast path (engine.model.fast_paths.use_triton) one launch (dsv4_kernels.triton_decode_prologue)
    derives every index tensor; else the torch ops of `derive_decode_batch_reference` (equal element for
    element: tests/engine/test_decode_prologue.py; compared again on each bucket's first use, outside capture, by
    engine.model.prologue_check)."""
    if use_triton(inputs.packed.device):
        layout = tables.layouts.get(shape)
        if layout is None:
            layout = tables.layouts[shape] = PrologueLayout(pool, tables, shape)
        return derive_checked(
            layout,
            lambda: layout.derive(inputs.packed),
            lambda: derive_decode_batch_reference(pool, tables, inputs, shape),
            inputs.packed.device,
        )
    return derive_decode_batch_reference(pool, tables, inputs, shape)


def derive_decode_batch_reference(
    pool: CachePool, tables: BlockTables, inputs: DecodeInputs, shape: DecodeShape
) -> StepBatch:
    """derive_decode_batch as torch ops (~170 kernels a step on a GPU): the reference of the fused prologue."""
    cfg = pool.cfg
    pos, device = inputs.positions, inputs.packed.device
    rows = torch.arange(shape.slots, device=device)
    widths = table_widths(pool, shape.context)
    group_tables = {name: t.index_select(0, inputs.table_rows)[:, : widths[name]] for name, t in tables.tables.items()}

    swa_spec = pool.groups["swa"].spec
    window = cfg.sliding_window
    win_pos = pos.unsqueeze(1) - window + 1 + torch.arange(window, device=device)
    swa_page = group_tables["swa"][:, 0]
    swa = _decode_sources(
        win_pos, pos, rows, swa_page, window, swa_spec.num_pages * swa_spec.page_rows, swa_spec.page_rows
    )
    swa_write = RingWrite(rows, swa_page * swa_spec.page_rows + pos % window)

    compress, visible = {}, {}
    for entry_name, state_name, ratio, overlap in entry_groups(cfg):
        compress[entry_name] = _decode_plan(pool, entry_name, state_name, ratio, overlap, pos, rows, group_tables)
        if entry_name != "kv4":  # CSA picks kv4 entries through the indexer
            visible[entry_name] = _decode_visible(pool, entry_name, ratio, pos, rows, group_tables, shape)

    return StepBatch(
        token_ids=inputs.token_ids,
        positions=pos,
        seq_of_token=rows,
        cu=torch.arange(shape.slots + 1, device=device),
        starts=pos,
        ends=pos + 1,
        swa=swa,
        swa_write=swa_write,
        compress=compress,
        visible=visible,
        tables=group_tables,
        logit_rows=rows,
    )


def entry_groups(cfg) -> list[tuple[str, str, int, bool]]:
    """(entry group, state group, ratio, overlap) of each compressor, in derive order."""
    out = [(f"kv{r}", f"state{r}", r, r == 4) for r in cfg.ratios]
    if cfg.indexer_layers:
        out.append(("index", "index_state", 4, True))
    return out


class PrologueLayout:
    """The fused prologue's sections for one bucket (dsv4_kernels.triton_decode_prologue): the descriptor table
    (on the device, built once) and where each StepBatch tensor lies in the kernel's two flat outputs.

    queries: token rows a slot (1: a decode step; > 1: engine.model.verify_batch's layout); pad_row: the table
    row whose token rows write only scratch pages (verify_batch's padding rows; None: every row is a request's,
    as in a decode step); swa_only: no compressor plans nor visible entries (verify_batch's MTP batches)."""

    def __init__(
        self,
        pool: CachePool,
        tables: BlockTables,
        shape: DecodeShape,
        queries: int = 1,
        pad_row: int | None = None,
        swa_only: bool = False,
    ):
        from dsv4_kernels import triton_decode_prologue as k

        self.k, self.shape, self.table = k, shape, tables.table
        self.checked = False  # engine.model.prologue_check: compared with the reference once, outside capture
        self.queries, self.pad_row = queries, -1 if pad_row is None else pad_row
        s, cfg = shape.slots, pool.cfg
        r = s * queries
        self.widths = table_widths(pool, shape.context)
        if any(w > tables.widths[name] for name, w in self.widths.items()):  # (the kernel would read other columns)
            raise ValueError(f"{shape} needs wider page tables than the BlockTables hold ({tables.widths})")
        self.rows: list[list[int]] = []
        self.num_out = self.num_flags = 0
        col = tables.columns

        def add(kind, width, n_out, n_flags, **fields) -> tuple[int, int]:
            desc = [0] * k.NUM_FIELDS
            desc[k.F_KIND], desc[k.F_WIDTH], desc[k.F_OUT], desc[k.F_FLAG] = kind, width, self.num_out, self.num_flags
            desc[k.F_ALIGN] = desc[k.F_STRIDE] = desc[k.F_RING_ROWS] = desc[k.F_ENTRY_PAGE_ROWS] = 1
            desc[k.F_ENTRY_WIDTH] = 1
            for name, v in fields.items():
                desc[getattr(k, "F_" + name.upper())] = v
            self.rows.append(desc)
            at = (self.num_out, self.num_flags)
            self.num_out += n_out
            self.num_flags += n_flags
            return at

        self.table_at = {name: add(k.TABLE, w, s * w, 0, page_col=col[name])[0] for name, w in self.widths.items()}
        swa_spec = pool.groups["swa"].spec
        self.misc_at = add(
            k.MISC,
            1,
            k.misc_size(s, queries),
            0,
            page_col=col["swa"],
            stride=swa_spec.page_rows,
            ring_rows=cfg.sliding_window,
            ring_scratch=pool.scratch_pages["swa"],
        )[0]

        def sources(page_name, width, align, offset, stride, ring_rows, total):
            return (
                width,
                add(
                    k.SOURCES,
                    width,
                    3 * r * width,
                    2 * r * width,
                    page_col=col[page_name],
                    align=align,
                    offset=offset,
                    stride=stride,
                    ring_rows=ring_rows,
                    total=total,
                ),
            )

        self.swa_at = sources(
            "swa",
            cfg.sliding_window,
            1,
            1 - cfg.sliding_window,
            swa_spec.page_rows,
            cfg.sliding_window,
            swa_spec.num_pages * swa_spec.page_rows,
        )
        self.plans, self.visible = {}, {}
        for entry, state, ratio, overlap in [] if swa_only else entry_groups(cfg):
            st, es = pool.groups[state].spec, pool.groups[entry].spec
            ring = (st.page_rows, st.page_rows, st.num_pages * st.page_rows)
            cur = sources(state, ratio, ratio, 0, *ring)
            prev = sources(state, ratio, ratio, -ratio, *ring) if overlap else None
            plan = add(
                k.PLAN,
                1,
                3 * r,
                0,
                page_col=col[state],
                align=ratio,
                stride=st.page_rows,
                ring_rows=st.page_rows,
                entry_col=col[entry],
                entry_width=self.widths[entry],
                entry_page_rows=es.page_rows,
                scratch=pool.scratch_pages[entry] * es.page_rows,
                ring_scratch=pool.scratch_pages[state],
            )[0]
            self.plans[entry] = (cur, prev, plan)
            if entry != "kv4":  # CSA picks kv4 entries through the indexer
                w = max(1, shape.context // ratio)
                self.visible[entry] = (
                    w,
                    add(
                        k.VISIBLE,
                        w,
                        s * w + r,
                        0,
                        page_col=col[entry],
                        align=ratio,
                        entry_col=col[entry],
                        entry_width=self.widths[entry],
                        entry_page_rows=es.page_rows,
                    ),
                )
        self.desc = torch.tensor(self.rows, dtype=torch.long).to(tables.table.device)
        self.max_width = max(row[k.F_WIDTH] for row in self.rows)  # sets the kernel's grid

    def derive(self, packed: torch.Tensor) -> StepBatch:
        """packed: int64 [3, slots * queries] (DecodeInputs.packed or VerifyInputs.packed) -> the StepBatch, in
        one launch (every index tensor a view of the kernel's two outputs)."""
        s, q = self.shape.slots, self.queries
        r = s * q
        out, flags = self.k.decode_prologue(
            packed.contiguous(), self.table, self.desc, self.num_out, self.num_flags, self.max_width, q, self.pad_row
        )
        flags = flags.view(torch.bool)

        def ints(at, n, *shape):
            return out[at : at + n].view(*shape)

        def sources(spec) -> SourceRows:
            w, (o, f) = spec
            n = r * w
            return SourceRows(
                flags[f : f + n].view(r, w),
                ints(o, n, r, w),
                ints(o + n, n, r, w),
                flags[f + n : f + 2 * n].view(r, w),
                ints(o + 2 * n, n, r, w),
            )

        m = self.misc_at
        rows, ends, swa_ring, cu = (
            ints(m, r, r),
            ints(m + r, s, s),
            ints(m + r + s, r, r),
            ints(m + 2 * r + s, s + 1, s + 1),
        )
        seg = rows if q == 1 else ints(m + 2 * r + 2 * s + 1, r, r)
        compress = {}
        for name, (cur, prev, p) in self.plans.items():
            compress[name] = CompressPlan(
                num_entries=r,
                cur=sources(cur),
                prev=sources(prev) if prev else None,
                entry_row=ints(p, r, r),
                entry_pos=ints(p + r, r, r),
                state_write=RingWrite(rows, ints(p + 2 * r, r, r)),
            )
        visible = {
            name: VisibleEntries(ints(o, s * w, s, w), ints(o + s * w, r, r), seg)
            for name, (w, (o, _)) in self.visible.items()
        }
        group_tables = {name: ints(self.table_at[name], s * w, s, w) for name, w in self.widths.items()}
        pos = packed[1]
        return StepBatch(
            token_ids=packed[0],
            positions=pos,
            seq_of_token=seg,
            cu=cu,
            starts=pos if q == 1 else pos.view(s, q)[:, 0],
            ends=ends,
            swa=sources(self.swa_at),
            swa_write=RingWrite(rows, swa_ring),
            compress=compress,
            visible=visible,
            tables=group_tables,
            logit_rows=rows,
        )


def build_decode_step(
    pool: CachePool, token_ids: list[int], positions: list[int], tables: list[dict], shape: DecodeShape, device
) -> StepBatch:
    """One-off decode batch (tests, tools): request b runs token_ids[b] at positions[b] with pages tables[b].

    No requests at all gives a batch of padding only. Raises ValueError when the requests do not fit.
    """
    block_tables = BlockTables(pool, max(1, len(token_ids)), shape.context, device)
    ids = [f"r{b}" for b in range(len(token_ids))]
    inputs = DecodeInputs.make(
        token_ids, positions, block_tables.rows_for(ids, tables) if ids else [], shape, block_tables.pad_row
    )
    return derive_decode_batch(pool, block_tables, DecodeInputs(inputs.packed.to(device)), shape)


def doublings_and_halves(first: int, below: int) -> list[int]:
    """first, 1.5 first, 2 first, 3 first, 4 first, ... while below `below`: buckets at most 1.5x what a step needs,
    two a doubling."""
    out, n = [], first
    while n < below:
        out.append(n)
        if n * 3 // 2 < below:
            out.append(n * 3 // 2)
        n *= 2
    return out
