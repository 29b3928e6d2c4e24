"""Triton decode-step prologue: every index tensor of a fixed-shape decode step in one launch.

engine.model.decode_batch derives a decode step's StepBatch (SWA window sources, compressor plans, visible
entry rows, page tables of each cache group) from three [slots] int64 inputs and the persistent block
tables. As torch ops that is ~170 small kernels a step (each a launch inside the CUDA graph); here one
launch writes them all, a (row, section) pair per program, or for few slots several programs a pair, each
taking every NC-th block of a wide section (chunks_per_section). What each section computes is described by one row of an
int64 descriptor table built once per decode bucket on the host (engine.model.decode_batch.PrologueLayout); the
outputs land in one flat int64 buffer and one flat uint8 (bool) buffer, each tensor a contiguous range.

Sections (descriptor columns: see the F_* constants; S = slots, W = the section's width, b = the row):
- TABLE: out[b, j] = table[trow[b], col + j] for j < W (a cache group's page-table row, cut to the bucket).
- SOURCES (engine.model.batch.SourceRows over a ring, decode case): p = min(pos - pos % align + offset + k, pos),
  k < W; from_chunk = p >= pos, chunk_row = from_chunk ? b : 0, ring_row = page * stride + max(p, 0) %
  ring_rows (page = table[trow[b], page_col]), valid = p >= 0, row = from_chunk ? total + chunk_row : ring_row.
  int64 outputs chunk_row, ring_row, row (each [S, W], one after the other); flags from_chunk, valid.
- PLAN (a compressor's per-row scalars): window = pos // ratio; entry_row = paged(entry table, window) where
  (pos + 1) % ratio == 0, else the scratch row; entry_pos = window * ratio; state ring row = page * stride +
  pos % ring_rows. Three int64 [S] outputs.
- VISIBLE: rows[b, w] = paged(entry table, w), w < W ([S, W]), then count[b] = (pos + 1) // ratio ([S]); no
  flags (engine.model.batch.VisibleEntries: validity is derived from the count, never stored per entry).
- MISC: arange rows [S], ends = pos + 1 [S], the SWA write row (as PLAN's state row) [S], cu = arange [S + 1].
paged(t, e) = table[trow[b], col + min(e // page_rows, width - 1)] * page_rows + e % page_rows (e >= 0 here),
as engine.model.batch.paged_rows. Integer math only: the outputs equal the torch derivation element for element.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton

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
) = range(14)
NUM_FIELDS = 14
BLOCK = 128
MAX_PROGRAMS_PER_SECTION = 64  # see chunks_per_section


@triton.jit
def _paged(table_ptr, trow_off, col, width, page_rows, e):
    page_idx = tl.minimum(e // page_rows, width - 1)
    return tl.load(table_ptr + trow_off + col + page_idx) * page_rows + e % page_rows


@triton.jit(do_not_specialize=["NC"])  # NC is 1 at full batches: no second compiled variant for it
def _prologue_kernel(
    packed_ptr, table_ptr, desc_ptr, out_ptr, flag_ptr, S, table_stride, NC, NF: tl.constexpr, BLOCK_W: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(2)  # this program's blocks of a wide section: chunk, chunk + NC, ...
    first = chunk * BLOCK_W
    step = NC * BLOCK_W
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

    pos = tl.load(packed_ptr + S + b)
    trow_off = tl.load(packed_ptr + 2 * S + b) * table_stride
    page = tl.load(table_ptr + trow_off + page_col)
    cols = tl.arange(0, BLOCK_W).to(tl.int64)
    plane = S * W
    if kind == 0:  # TABLE
        for start in range(first, W, step):
            j = start + cols
            m = j < W
            v = tl.load(table_ptr + trow_off + page_col + j, mask=m)
            tl.store(out_ptr + out_off + b * W + j, v, mask=m)
    elif kind == 1:  # SOURCES
        base = pos - pos % align + offset
        for start in range(first, W, step):
            k = start + cols
            m = k < W
            p = tl.minimum(base + k, pos)
            from_chunk = p >= pos
            chunk_row = tl.where(from_chunk, b, 0)
            ring_row = page * stride + tl.maximum(p, 0) % ring_rows
            row = tl.where(from_chunk, total + chunk_row, ring_row)
            o = out_off + b * W + k
            tl.store(out_ptr + o, chunk_row, mask=m)
            tl.store(out_ptr + plane + o, ring_row, mask=m)
            tl.store(out_ptr + 2 * plane + o, row, mask=m)
            f = flag_off + b * W + k
            tl.store(flag_ptr + f, from_chunk.to(tl.uint8), mask=m)
            tl.store(flag_ptr + plane + f, (p >= 0).to(tl.uint8), mask=m)
    elif kind == 2 and chunk == 0:  # PLAN
        window = pos // align
        closes = (pos + 1) % align == 0
        entry = _paged(table_ptr, trow_off, entry_col, entry_width, entry_page_rows, window)
        tl.store(out_ptr + out_off + b, tl.where(closes, entry, scratch))
        tl.store(out_ptr + out_off + S + b, window * align)
        tl.store(out_ptr + out_off + 2 * S + b, page * stride + pos % ring_rows)
    elif kind == 3:  # VISIBLE
        for start in range(first, W, step):
            w = start + cols
            m = w < W
            page_idx = tl.minimum(w // entry_page_rows, entry_width - 1)
            rows = tl.load(table_ptr + trow_off + entry_col + page_idx, mask=m) * entry_page_rows
            tl.store(out_ptr + out_off + b * W + w, rows + w % entry_page_rows, mask=m)
        if chunk == 0:
            tl.store(out_ptr + out_off + plane + b, (pos + 1) // align)
    elif kind == 4 and chunk == 0:  # MISC
        tl.store(out_ptr + out_off + b, b)
        tl.store(out_ptr + out_off + S + b, pos + 1)
        tl.store(out_ptr + out_off + 2 * S + b, page * stride + pos % ring_rows)
        tl.store(out_ptr + out_off + 3 * S + b, b)
        if b == S - 1:  # cu's last entry, S
            tl.store(out_ptr + out_off + 4 * S, b + 1)


def chunks_per_section(slots: int, max_width: int) -> int:
    """Programs a (row, section) pair gets: a wide section (a CSA layer's visible entries, 8192 at 32K) walked by
    one program is latency-bound (BENCHMARKS.md, "GPU decode and prefill": the step prologue's share of a batch-1
    step); few slots get up to MAX_PROGRAMS_PER_SECTION // slots
    programs each, a full batch keeps one (the grid already fills the GPU there)."""
    return max(1, min(triton.cdiv(max(max_width, 1), BLOCK), MAX_PROGRAMS_PER_SECTION // max(slots, 1)))


def decode_prologue(
    packed: torch.Tensor, table: torch.Tensor, desc: torch.Tensor, num_out: int, num_flags: int, max_width: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """packed: int64 [3, S] (token, position, table row); table: int64 [R, TW] (every group's page-table
    columns side by side, contiguous); desc: int64 [sections, NUM_FIELDS]; max_width: the widest section's W (a
    host int: it sets the grid; smaller only costs parallelism) -> (int64 [num_out], uint8 [num_flags]): the
    sections' outputs at their descriptor offsets. One launch, no host sync."""
    if packed.dtype != torch.int64 or packed.dim() != 2 or packed.shape[0] != 3 or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous int64 [3, S], got {packed.dtype} {tuple(packed.shape)}")
    if table.dtype != torch.int64 or not table.is_contiguous() or desc.shape[-1] != NUM_FIELDS:
        raise ValueError("table must be contiguous int64 [R, TW] and desc int64 [sections, NUM_FIELDS]")
    require_triton(packed.device)
    out = torch.empty(num_out, dtype=torch.int64, device=packed.device)
    flags = torch.empty(num_flags, dtype=torch.uint8, device=packed.device)
    slots = packed.shape[1]
    nc = chunks_per_section(slots, max_width)
    _prologue_kernel[(slots, desc.shape[0], nc)](
        packed, table, desc, out, flags, slots, table.stride(0), nc, NF=NUM_FIELDS, BLOCK_W=BLOCK
    )
    return out, flags
