"""One engine step as flat tensors: every scheduled request contributes a run of consecutive tokens.

Prefill chunks and decode tokens share one varlen layout (tokens of request b occupy rows
cu[b]:cu[b+1] and positions starts[b]:ends[b]), so a step that mixes both is one forward. All index
tensors the layers need (SWA window gathers, compressor window gathers, cache writes, visible-entry
gathers) are derived here once per step and shared by every layer: the layers only gather and scatter.

They are derived *on the step's device* from a few small host tensors (per-request starts / counts, the
page tables, the token ids): the big ones are O(T x window) and O(T x visible entries) (an 8K-token prefill
of V4-Flash: ~180 MB of int64 ids), which a host would build slowly and copy over PCIe. Every size is known
on the host (from the request lists), so no step waits on the device for one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.cache import CacheLayer, CachePool


def segment_arange(starts: torch.Tensor, counts: torch.Tensor, total: int | None = None):
    """Concatenated aranges: for segment b, starts[b] + [0, counts[b]). -> (values [N], segment ids [N]).
    total: N = counts.sum() when the caller knows it (no device-to-host sync on CUDA)."""
    if total is None:
        total = int(counts.sum())
    seg = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts, output_size=total)
    offsets = torch.cumsum(counts, 0) - counts
    local = torch.arange(total, device=counts.device) - offsets[seg]
    return starts[seg] + local, seg


# Offsets (in int64 elements) of the parts packed into a step's one host-to-device copy: 128-byte aligned, so a
# kernel handed a page table sees the alignment a tensor of its own would have (Triton specialises on it).
PART_ALIGN = 16


def _padded(part: np.ndarray) -> np.ndarray:
    return np.pad(part, (0, -part.size % PART_ALIGN))


def _host_tables(tables: list[dict], names) -> tuple[np.ndarray, dict[str, tuple[int, int]]]:
    """Every group's page table, zero-padded to its widest row, flattened into one int64 array.
    -> (array, {group: (offset, width)}): group g's [B, width] table is array[offset:offset + B * width]
    (offsets multiples of PART_ALIGN)."""
    parts, where, off = [], {}, 0
    for name in names:
        rows = [t.get(name, ()) for t in tables]
        width = max(1, max((len(r) for r in rows), default=1))
        out = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        parts.append(_padded(out.reshape(-1)))
        where[name] = (off, width)
        off += parts[-1].size
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), where


def to_device_nonblocking(host: torch.Tensor, device) -> torch.Tensor:
    """One host-to-device copy that never waits for the device: from pinned memory on CUDA (a copy from
    pageable memory without non_blocking synchronises the stream; with it, CUDA still stages it)."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def copy_nonblocking_(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """dst.copy_(host) without waiting for the device: through pinned memory when dst is on CUDA (the caching
    host allocator keeps the pinned block until the copy has run)."""
    if dst.is_cuda:
        return dst.copy_(host.pin_memory(), non_blocking=True)
    return dst.copy_(host)


@dataclass(frozen=True)
class _Sizes:
    """Host-side lengths of one step (from the request lists): every data-dependent size build_step needs."""

    counts: list[int]
    starts: list[int]

    @property
    def ends(self) -> list[int]:
        return [s + c for s, c in zip(self.starts, self.counts)]

    def closing(self, ratio: int) -> int:
        """Compressor windows of `ratio` that close in this step."""
        return sum(e // ratio - s // ratio for s, e in zip(self.starts, self.ends))

    def ring_writes(self, ring_rows: int) -> int:
        """Rows this step writes into a ring of `ring_rows` slots (each request's last ring_rows tokens)."""
        return sum(e - max(s, e - ring_rows) for s, e in zip(self.starts, self.ends))


@dataclass(frozen=True)
class SourceRows:
    """Where a token's projected row lives: in this step's chunk, or in a cache ring.

    All fields share one shape. `row` indexes the concatenation [ring rows | chunk rows] (ring_rows
    is the ring layer's row count), so a gather is one index_select. Rows at invalid positions
    (before position 0) point at real, finite rows: every consumer masks them (attention by `valid`,
    the compressor by giving their slots zero weight), so they are never zeroed here.
    """

    from_chunk: torch.Tensor
    chunk_row: torch.Tensor
    ring_row: torch.Tensor
    valid: torch.Tensor
    row: torch.Tensor

    def gather(self, chunk: torch.Tensor, ring: torch.Tensor | CacheLayer) -> torch.Tensor:
        """chunk: [T, W]; ring: [R, W] rows, or a cache layer -> [*shape, W] in chunk.dtype.

        A quantised ring is read through its codec: only the distinct ring rows this gather names are
        decoded (never the whole ring), then placed in front of the chunk as usual.
        """
        if isinstance(ring, CacheLayer):
            if ring.quantised:
                return self._gather_decoded(chunk, ring)
            ring = ring.tensor
        # Two gathers and a select, never a copy of the whole ring (it holds every request's rows).
        shape = (*self.row.shape, chunk.shape[-1])
        from_ring = ring.index_select(0, self.ring_row.reshape(-1)).view(shape).to(chunk.dtype)
        from_chunk = chunk.index_select(0, self.chunk_row.reshape(-1)).view(shape)
        return torch.where(self.from_chunk.unsqueeze(-1), from_chunk, from_ring)

    def _gather_decoded(self, chunk: torch.Tensor, ring: CacheLayer) -> torch.Tensor:
        flat = self.row.reshape(-1)
        in_ring = flat < ring.num_rows
        ids, inverse = torch.unique(flat[in_ring], return_inverse=True)
        index = flat - ring.num_rows + ids.numel()  # chunk rows follow the decoded ring rows
        index[in_ring] = inverse
        source = torch.cat([ring.read(ids).to(chunk.dtype), chunk])
        return source.index_select(0, index).view(*self.row.shape, chunk.shape[-1])


@dataclass(frozen=True)
class RingWrite:
    """Rows of the chunk to copy into a ring group: ring[ring_row] = chunk[chunk_row]."""

    chunk_row: torch.Tensor
    ring_row: torch.Tensor

    def apply(self, chunk: torch.Tensor, ring: torch.Tensor | CacheLayer) -> None:
        """ring: a raw row tensor or a cache layer (written through its codec)."""
        if isinstance(ring, CacheLayer):
            ring.write(self.ring_row, chunk[self.chunk_row])
        else:
            ring.index_copy_(0, self.ring_row, chunk[self.chunk_row].to(ring.dtype))

    def apply_packed(self, packed: torch.Tensor, ring: CacheLayer) -> None:
        """packed: the chunk's rows already encoded (uint8 [T, row_bytes]) for a quantised ring."""
        ring.write_packed(self.ring_row, packed[self.chunk_row])


@dataclass(frozen=True)
class CompressPlan:
    """Entries of one compressor (ratio r) that close in this step, and where their slots come from.

    cur: SourceRows [N, r] (window w); prev: SourceRows [N, r] (window w-1, overlap only);
    entry_row: [N] rows in the entry group; entry_pos: [N] first position of each window (compress RoPE);
    state_write: the chunk tail kept in the state ring for later steps.
    """

    num_entries: int
    cur: SourceRows
    prev: SourceRows | None
    entry_row: torch.Tensor
    entry_pos: torch.Tensor
    state_write: RingWrite


@dataclass(frozen=True)
class VisibleEntries:
    """Per-query candidate entries of one paged entry group: rows [T, E] and visibility [T, E]."""

    rows: torch.Tensor
    valid: torch.Tensor


@dataclass(frozen=True)
class StepBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    seq_of_token: torch.Tensor  # [T] request row b
    cu: torch.Tensor  # [B + 1]
    starts: torch.Tensor  # [B]
    ends: torch.Tensor  # [B]
    swa: SourceRows  # [T, window]
    swa_write: RingWrite
    compress: dict  # entry group name ("kv4", "kv128", "index") -> CompressPlan
    visible: dict  # entry group name -> VisibleEntries
    tables: dict  # group name -> [B, max_pages] page ids
    logit_rows: torch.Tensor  # [L] rows of T whose logits the step needs

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


def ring_sources(pos, seg, starts, cu, ring_page, ring_rows: int, ring_total_rows: int,
             page_stride: int | None = None) -> SourceRows:
    """ring_rows: the ring's length (slot = pos % ring_rows); page_stride: rows a page (default ring_rows)."""
    s = starts[seg]
    valid = pos >= 0
    from_chunk = pos >= s
    chunk_row = torch.where(from_chunk, cu[seg] + pos - s, torch.zeros_like(pos))
    ring_row = ring_page[seg] * (page_stride or ring_rows) + pos.clamp(min=0) % ring_rows
    return SourceRows(from_chunk, chunk_row, ring_row, valid, torch.where(from_chunk, ring_total_rows + chunk_row,
                                                                          ring_row))


def _ring_write(starts, ends, cu, ring_page, ring_rows: int, page_stride: int | None = None,
                total: int | None = None) -> RingWrite:
    first = torch.maximum(starts, ends - ring_rows)
    pos, seg = segment_arange(first, ends - first, total)
    return RingWrite(cu[seg] + pos - starts[seg], ring_page[seg] * (page_stride or ring_rows) + pos % ring_rows)


def _staging_writes(pool: CachePool, snapshots: list, sizes: _Sizes, cu_host: list[int], device) -> dict:
    """Ring group -> RingWrite of the rows an in-step snapshot keeps: for each request b with snapshots[b] =
    (point, {group: page}), positions [point - ring, point) of its chunk into that group's staging page (slot =
    position % ring, as _ring_write places them). Host-known sizes: built on the host, one upload."""
    window = pool.cfg.sliding_window
    chunk, ring, at = [], [], {}
    for name in sorted({g for snap in snapshots if snap for g in snap[1]}):
        spec = pool.groups[name].spec
        positions = window if name == "swa" else spec.page_rows
        first = len(chunk)
        for b, snap in enumerate(snapshots):
            if not snap:
                continue
            point, pages = snap
            if not sizes.starts[b] + positions <= point <= sizes.ends[b]:
                raise ValueError(f"in-step snapshot at {point} needs positions {point - positions}.. in the chunk "
                                 f"[{sizes.starts[b]}, {sizes.ends[b]}) of request {b}")
            pos = np.arange(point - positions, point, dtype=np.int64)
            chunk.append(cu_host[b] + pos - sizes.starts[b])
            ring.append(pages[name] * spec.page_rows + pos % positions)
        at[name] = (first, len(chunk))
    flat = to_device_nonblocking(torch.from_numpy(np.concatenate([np.concatenate(chunk), np.concatenate(ring)])),
                                 device)
    n = flat.shape[0] // 2
    bounds = np.cumsum([0] + [c.size for c in chunk])
    return {name: RingWrite(flat[bounds[a]:bounds[b]], flat[n + bounds[a]:n + bounds[b]])
            for name, (a, b) in at.items()}


def _joined(first: RingWrite, extra: RingWrite) -> RingWrite:
    return RingWrite(torch.cat([first.chunk_row, extra.chunk_row]), torch.cat([first.ring_row, extra.ring_row]))


def paged_rows(table: torch.Tensor, page_rows: int, seg: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
    page_idx = (entry.clamp(min=0) // page_rows).clamp(max=table.shape[1] - 1)
    return table[seg, page_idx] * page_rows + entry.clamp(min=0) % page_rows


def _compress_plan(ratio: int, overlap: bool, starts, ends, cu, state_page, state_rows: int, state_total: int,
                   entry_table, entry_page_rows: int, sizes: _Sizes) -> CompressPlan:
    first, last = starts // ratio, ends // ratio
    num_entries = sizes.closing(ratio)
    w, seg = segment_arange(first, last - first, num_entries)
    offs = torch.arange(ratio, device=w.device)
    cur_pos = (w * ratio).unsqueeze(1) + offs
    seg2 = seg.unsqueeze(1).expand_as(cur_pos)
    cur = ring_sources(cur_pos, seg2, starts, cu, state_page, state_rows, state_total)
    prev = ring_sources(cur_pos - ratio, seg2, starts, cu, state_page, state_rows, state_total) if overlap else None
    return CompressPlan(
        num_entries=num_entries,
        cur=cur,
        prev=prev,
        entry_row=paged_rows(entry_table, entry_page_rows, seg, w),
        entry_pos=w * ratio,
        state_write=_ring_write(starts, ends, cu, state_page, state_rows, total=sizes.ring_writes(state_rows)),
    )


def _visible(ratio: int, positions, seg, table, page_rows: int, sizes: _Sizes) -> VisibleEntries:
    max_entries = max(1, max(e // ratio for e in sizes.ends))
    w = torch.arange(max_entries, device=positions.device).unsqueeze(0).expand(positions.shape[0], -1)
    valid = w < ((positions + 1) // ratio).unsqueeze(1)
    return VisibleEntries(paged_rows(table, page_rows, seg.unsqueeze(1).expand_as(w), w), valid)


def build_step(pool: CachePool, token_ids: list[list[int]], starts: list[int], tables: list[dict],
               logit_rows: list[int], device, snapshots: list | None = None) -> StepBatch:
    """token_ids[b]: the tokens request b runs this step, at positions starts[b]...; tables[b]: its pages.
    Built on `device` (module docstring): one host-to-device copy that does not wait for the device, no
    device-to-host sync, so the host can build this step while the device still runs the one before.
    snapshots[b] (optional): (point, {ring group: staging page}) when request b keeps a prefix-cache snapshot
    point inside its chunk (engine.prefix_cache): each of those rings' writes then also put the ring as it
    stands at `point` (positions [point - ring, point), all in the chunk) into its staging page."""
    cfg = pool.cfg
    sizes = _Sizes([len(t) for t in token_ids], list(starts))
    # The host inputs, as one int64 tensor and one copy that does not wait for the device:
    # [counts | starts | cu | logit_rows | token ids | every group's page table]
    b, total, n_logits = len(sizes.counts), sum(sizes.counts), len(logit_rows)
    cu_host = [0]
    for c in sizes.counts:
        cu_host.append(cu_host[-1] + c)
    head = np.array(sizes.counts + sizes.starts + cu_host + list(logit_rows) + [t for ids in token_ids for t in ids],
                    dtype=np.int64)
    table_host, table_at = _host_tables(tables, pool.groups)
    padded = _padded(head)
    small = to_device_nonblocking(torch.from_numpy(np.concatenate([padded, table_host])), device)
    counts, starts_t, cu = small[:b], small[b:2 * b], small[2 * b:3 * b + 1]
    logit_rows_t, token_ids_t = small[3 * b + 1:3 * b + 1 + n_logits], small[3 * b + 1 + n_logits:head.size]
    ends_t = starts_t + counts
    positions, seg = segment_arange(starts_t, counts, total)
    at = padded.size
    group_tables = {name: small[at + off:at + off + b * width].view(b, width)
                    for name, (off, width) in table_at.items()}

    window = cfg.sliding_window
    swa_spec = pool.groups["swa"].spec  # a page may hold more rows than the window (fp8: whole 64-row blocks)
    swa_page = group_tables["swa"][:, 0]
    win_pos = positions.unsqueeze(1) - window + 1 + torch.arange(window, device=positions.device)
    swa_total = swa_spec.num_pages * swa_spec.page_rows
    swa = ring_sources(win_pos, seg.unsqueeze(1).expand_as(win_pos), starts_t, cu, swa_page, window, swa_total,
                   swa_spec.page_rows)
    swa_write = _ring_write(starts_t, ends_t, cu, swa_page, window, swa_spec.page_rows, sizes.ring_writes(window))
    staged = _staging_writes(pool, snapshots, sizes, cu_host, device) if snapshots and any(snapshots) else {}
    if "swa" in staged:
        swa_write = _joined(swa_write, staged["swa"])

    compress, visible = {}, {}
    entry_groups = [(f"kv{r}", f"state{r}", r, r == 4) for r in cfg.ratios]
    if cfg.indexer_layers:
        entry_groups.append(("index", "index_state", 4, True))
    for entry_name, state_name, ratio, overlap in entry_groups:
        spec = pool.groups[entry_name].spec
        state_spec = pool.groups[state_name].spec
        compress[entry_name] = _compress_plan(ratio, overlap, starts_t, ends_t, cu, group_tables[state_name][:, 0],
                                              state_spec.page_rows, state_spec.num_pages * state_spec.page_rows,
                                              group_tables[entry_name], spec.page_rows, sizes)
        if state_name in staged:
            plan = compress[entry_name]
            compress[entry_name] = replace(plan, state_write=_joined(plan.state_write, staged[state_name]))
        if entry_name != "kv4":  # CSA picks kv4 entries through the indexer instead of attending to all
            visible[entry_name] = _visible(ratio, positions, seg, group_tables[entry_name], spec.page_rows, sizes)

    return StepBatch(
        token_ids=token_ids_t, positions=positions, seq_of_token=seg, cu=cu, starts=starts_t, ends=ends_t,
        swa=swa, swa_write=swa_write, compress=compress, visible=visible, tables=group_tables,
        logit_rows=logit_rows_t,
    )
