"""Triton step prologue: every index tensor of a fixed-shape decode or verify step in one launch.

engine.model.decode_batch derives a decode step's StepBatch (SWA window sources, compressor plans, visible
entry rows, page tables of each cache group) from three [rows] int64 inputs and the persistent block
tables, and engine.model.verify_batch the same for a verify step (`queries` token rows a slot). As torch ops
that is ~170 small kernels a step (each a launch inside the CUDA graph); here one launch writes them all, a
(token row, section) pair per program, or for few rows several programs a pair, each taking every NC-th block
of a wide section (chunks_per_section). What each section computes is described by one row of an int64
descriptor table built once per bucket on the host (engine.model.decode_batch.PrologueLayout); the outputs
land in one flat int64 buffer and one flat uint8 (bool) buffer, each tensor a contiguous range.

Rows and slots: R = S * Q token rows; row t belongs to slot b = t // Q, whose rows are Q consecutive positions
from start = pos[b * Q] (chunk rows b * Q ..). A slot's reads use the table row of its first row (trow[b * Q]);
a row whose own table row is `pad_row` is padding (verify_batch: rows past a request's tokens, padding slots)
and writes only the scratch page (F_RING_SCRATCH, F_SCRATCH). A decode step is Q = 1, pad_row = -1 (no row is
padding: a padding slot's table row is all scratch pages anyway). Per-slot outputs ([S, ...]) are written by
the slot's Q programs together (each takes every Q-th block), per-row outputs ([R, ...]) by each row's own.

Sections (descriptor columns: see the F_* constants; W = the section's width, page = table[trow[b * Q],
page_col], write_page = page, or F_RING_SCRATCH for a padding row):
- TABLE: out[b, j] = table[trow[b * Q], col + j] for j < W (a cache group's page-table row, cut to the bucket).
- SOURCES (engine.model.batch.ring_sources over a ring): p = min(pos - pos % align + offset + k, pos), k < W;
  from_chunk = p >= start, chunk_row = from_chunk ? b * Q + p - start : 0, ring_row = page * stride + max(p,
  0) % ring_rows, valid = p >= 0, row = from_chunk ? total + chunk_row : ring_row. int64 outputs chunk_row,
  ring_row, row (each [R, W], one after the other); flags from_chunk, valid.
- PLAN (a compressor's per-row scalars): window = pos // ratio; entry_row = paged(entry table, window) where
  (pos + 1) % ratio == 0 and the row is not padding, else the scratch row; entry_pos = window * ratio; state
  ring row = write_page * stride + pos % ring_rows. Three int64 [R] outputs.
- VISIBLE: rows[b, w] = paged(entry table, w), w < W ([S, W]), then count[t] = (pos + 1) // ratio ([R]); no
  flags (engine.model.batch.VisibleEntries: validity is derived from the count, never stored per entry).
- MISC: arange rows [R], ends = start + Q [S], the SWA write row (as PLAN's state row) [R], cu = arange * Q
  [S + 1], and for Q > 1 seq_of_token = t // Q [R] (for Q = 1 it is the arange rows).
paged(t, e) = table[trow[b * Q], col + min(e // page_rows, width - 1)] * page_rows + e % page_rows (e >= 0
here), as engine.model.batch.paged_rows. Integer math only: the outputs equal the torch derivations element
for element.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

TABLE, SOURCES, PLAN, VISIBLE, MISC = range(5)
# descriptor columns
(
    F_KIND,
    F_WIDTH,
    F_OUT,
    F_FLAG,
    F_PAGE_COL,
    F_ALIGN,
    F_OFFSET,
    F_STRIDE,
    F_RING_ROWS,
    F_TOTAL,
    F_ENTRY_COL,
    F_ENTRY_WIDTH,
    F_ENTRY_PAGE_ROWS,
    F_SCRATCH,
    F_RING_SCRATCH,
) = range(15)
NUM_FIELDS = 15
BLOCK = 128
MAX_PROGRAMS_PER_SECTION = 64  # see chunks_per_section


@triton.jit
def _paged(table_ptr, trow_off, col, width, page_rows, e):
    page_idx = tl.minimum(e // page_rows, width - 1)
    return tl.load(table_ptr + trow_off + col + page_idx) * page_rows + e % page_rows


# NC is 1 at full batches and pad_row a per-engine constant: no second compiled variant for either
@triton.jit(do_not_specialize=["NC", "pad_row"])
def _prologue_kernel(
    packed_ptr,
    table_ptr,
    desc_ptr,
    out_ptr,
    flag_ptr,
    R,
    Q,
    pad_row,
    table_stride,
    NC,
    NF: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(2)  # this program's blocks of a wide section: chunk, chunk + NC, ...
    S = R // Q
    slot = t // Q
    head = slot * Q  # the slot's first row: its chunk rows start here
    lane = t - head
    first = chunk * BLOCK_W
    step = NC * BLOCK_W
    slot_first = (lane * NC + chunk) * BLOCK_W  # a per-slot section: the slot's Q rows share its blocks
    slot_step = Q * NC * BLOCK_W
    d = desc_ptr + tl.program_id(1).to(tl.int64) * NF
    kind = tl.load(d + 0)
    W = tl.load(d + 1)
    out_off = tl.load(d + 2)
    flag_off = tl.load(d + 3)
    page_col = tl.load(d + 4)
    align = tl.load(d + 5)
    offset = tl.load(d + 6)
    stride = tl.load(d + 7)
    ring_rows = tl.load(d + 8)
    total = tl.load(d + 9)
    entry_col = tl.load(d + 10)
    entry_width = tl.load(d + 11)
    entry_page_rows = tl.load(d + 12)
    scratch = tl.load(d + 13)
    ring_scratch = tl.load(d + 14)

    pos = tl.load(packed_ptr + R + t)
    start = tl.load(packed_ptr + R + head)
    live = tl.load(packed_ptr + 2 * R + t) != pad_row
    trow_off = tl.load(packed_ptr + 2 * R + head) * table_stride
    page = tl.load(table_ptr + trow_off + page_col)
    write_page = tl.where(live, page, ring_scratch)
    cols = tl.arange(0, BLOCK_W).to(tl.int64)
    if kind == 0:  # TABLE
        for blk in range(slot_first, W, slot_step):
            j = blk + cols
            m = j < W
            v = tl.load(table_ptr + trow_off + page_col + j, mask=m)
            tl.store(out_ptr + out_off + slot * W + j, v, mask=m)
    elif kind == 1:  # SOURCES
        base = pos - pos % align + offset
        plane = R * W
        for blk in range(first, W, step):
            k = blk + cols
            m = k < W
            p = tl.minimum(base + k, pos)
            from_chunk = p >= start
            chunk_row = tl.where(from_chunk, head + p - start, 0)
            ring_row = page * stride + tl.maximum(p, 0) % ring_rows
            row = tl.where(from_chunk, total + chunk_row, ring_row)
            o = out_off + t * W + k
            tl.store(out_ptr + o, chunk_row, mask=m)
            tl.store(out_ptr + plane + o, ring_row, mask=m)
            tl.store(out_ptr + 2 * plane + o, row, mask=m)
            f = flag_off + t * W + k
            tl.store(flag_ptr + f, from_chunk.to(tl.uint8), mask=m)
            tl.store(flag_ptr + plane + f, (p >= 0).to(tl.uint8), mask=m)
    elif kind == 2 and chunk == 0:  # PLAN
        window = pos // align
        closes = ((pos + 1) % align == 0) & live
        entry = _paged(table_ptr, trow_off, entry_col, entry_width, entry_page_rows, window)
        tl.store(out_ptr + out_off + t, tl.where(closes, entry, scratch))
        tl.store(out_ptr + out_off + R + t, window * align)
        tl.store(out_ptr + out_off + 2 * R + t, write_page * stride + pos % ring_rows)
    elif kind == 3:  # VISIBLE
        for blk in range(slot_first, W, slot_step):
            w = blk + cols
            m = w < W
            page_idx = tl.minimum(w // entry_page_rows, entry_width - 1)
            rows = tl.load(table_ptr + trow_off + entry_col + page_idx, mask=m) * entry_page_rows
            tl.store(out_ptr + out_off + slot * W + w, rows + w % entry_page_rows, mask=m)
        if chunk == 0:
            tl.store(out_ptr + out_off + S * W + t, (pos + 1) // align)
    elif kind == 4 and chunk == 0:  # MISC: rows [R] | ends [S] | SWA write rows [R] | cu [S + 1] | seq [R]
        tl.store(out_ptr + out_off + t, t)
        tl.store(out_ptr + out_off + R + S + t, write_page * stride + pos % ring_rows)
        if lane == 0:
            tl.store(out_ptr + out_off + R + slot, start + Q)
            tl.store(out_ptr + out_off + 2 * R + S + slot, head)
            if slot == S - 1:  # cu's last entry, R
                tl.store(out_ptr + out_off + 2 * R + 2 * S, head + Q)
        if Q > 1:
            tl.store(out_ptr + out_off + 2 * R + 2 * S + 1 + t, slot)


def misc_size(slots: int, queries: int) -> int:
    """int64 outputs of the MISC section (see the module docstring)."""
    rows = slots * queries
    return 2 * rows + 2 * slots + 1 + (rows if queries > 1 else 0)


def chunks_per_section(rows: int, max_width: int) -> int:
    """Programs a (row, section) pair gets: a wide section (a CSA layer's visible entries, 8192 at 32K) walked by
    one program is latency-bound (BENCHMARKS.md, "GPU decode and prefill": the step prologue's share of a batch-1
    step); few rows get up to MAX_PROGRAMS_PER_SECTION // rows
    programs each, a full batch keeps one (the grid already fills the GPU there)."""
    return max(1, min(triton.cdiv(max(max_width, 1), BLOCK), MAX_PROGRAMS_PER_SECTION // max(rows, 1)))


def decode_prologue(
    packed: torch.Tensor,
    table: torch.Tensor,
    desc: torch.Tensor,
    num_out: int,
    num_flags: int,
    max_width: int = BLOCK,
    queries: int = 1,
    pad_row: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """packed: int64 [3, R] (token, position, table row), R = slots * queries; table: int64 [rows, TW] (every
    group's page-table columns side by side, contiguous); desc: int64 [sections, NUM_FIELDS]; max_width: the
    widest section's W (a host int: it sets the grid; smaller only costs parallelism); pad_row: the table row of
    padding token rows (-1: none) -> (int64 [num_out], uint8 [num_flags]): the sections' outputs at their
    descriptor offsets. One launch, no host sync."""
    if packed.dtype != torch.int64 or packed.dim() != 2 or packed.shape[0] != 3 or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous int64 [3, R], got {packed.dtype} {tuple(packed.shape)}")
    if table.dtype != torch.int64 or not table.is_contiguous() or desc.shape[-1] != NUM_FIELDS:
        raise ValueError("table must be contiguous int64 [rows, TW] and desc int64 [sections, NUM_FIELDS]")
    rows = packed.shape[1]
    if queries < 1 or rows % queries:
        raise ValueError(f"{rows} token rows are not whole slots of {queries} queries")
    require_triton(packed.device)
    out = torch.empty(num_out, dtype=torch.int64, device=packed.device)
    flags = torch.empty(num_flags, dtype=torch.uint8, device=packed.device)
    nc = chunks_per_section(rows, max_width)
    _prologue_kernel[(rows, desc.shape[0], nc)](
        packed,
        table,
        desc,
        out,
        flags,
        rows,
        queries,
        pad_row,
        table.stride(0),
        nc,
        NF=NUM_FIELDS,
        BLOCK_W=BLOCK,
        **pdl_kwargs(packed),
    )
    return out, flags
