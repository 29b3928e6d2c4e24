"""One engine step as flat tensors: every scheduled request contributes a run of consecutive tokens.

Prefill chunks and decode tokens share one varlen layout (tokens of request b occupy rows
cu[b]:cu[b+1] and positions starts[b]:ends[b]), so a step that mixes both is one forward. All index
tensors the layers need (SWA window gathers, compressor window gathers, cache writes, visible-entry
gathers) are derived here once per step and shared by every layer: the layers only gather and scatter.

Where each is built: the O(T) ones (positions, compressor windows and their sources, ring writes, the
page tables) on the host, in numpy, and sent in one copy; the O(T x window) SWA sources and O(B x visible
entries) candidate rows on the step's device, from those, by the
same formulas (`ring_sources` and `paged_rows` take numpy arrays or tensors). Visible entries are per request
([B, E] rows, [T] counts: VisibleEntries), never per token x entry. Every size is known on the host
(from the request lists), so no step waits on the device for one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import cast

import numpy as np
import torch

from engine.model.cache import CacheLayer, CachePool


def _is_host(x) -> bool:
    return isinstance(x, np.ndarray)


def _where(cond, a, b):
    return np.where(cond, a, b) if _is_host(cond) else torch.where(cond, a, b)


def _clamp(x, lo=None, hi=None):
    return np.clip(x, lo, hi) if _is_host(x) else x.clamp(lo, hi)


def segment_arange(starts, counts, total: int | None = None):
    """Concatenated aranges: for segment b, starts[b] + [0, counts[b]). -> (values [N], segment ids [N]).
    numpy int64 arrays (on the host) or torch tensors (on their device); total: N = counts.sum() when the caller
    knows it (no device-to-host sync on CUDA)."""
    if _is_host(counts):
        seg = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
        offsets = np.cumsum(counts) - counts
        return starts[seg] + np.arange(seg.size, dtype=np.int64) - offsets[seg], seg
    if total is None:
        total = int(counts.sum())
    ids = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    local = torch.arange(total, device=counts.device) - first[ids]
    return starts[ids] + local, ids


# A step's host arrays go to the device as one buffer, each part at a 128-byte boundary (PART_ALIGN int64s): a
# kernel handed a part sees the alignment a tensor of its own would have (Triton specialises on it).
PART_ALIGN = 16
_PART_BYTES = 8 * PART_ALIGN
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool}


def host_arrays(obj):
    """Every numpy array in obj: an array, or a dataclass / dict / list / tuple holding arrays (field order)."""
    if _is_host(obj):
        yield obj
    elif is_dataclass(obj):
        for f in fields(obj):
            yield from host_arrays(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from host_arrays(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from host_arrays(v)


class Upload:
    """The numpy arrays of some host objects as device tensors, through one buffer and one host-to-device copy
    that does not wait for the device (pinned on CUDA). `upload(obj)` -> obj with each array replaced by its
    device view (same shape and dtype: int64 or bool)."""

    def __init__(self, host_objects, device, into: torch.Tensor | None = None):
        """into: a device buffer of exactly this layout's size (a CUDA graph's static inputs,
        engine.model.prefill_batch) to copy into instead of a new one."""
        arrays = {id(a): a for a in host_arrays(host_objects)}  # by identity: a shared array goes once
        for a in arrays.values():
            if a.dtype not in _TORCH_DTYPES:
                raise TypeError(f"a step's host arrays are int64 or bool, got {a.dtype}")
        # int64 parts first, then bool parts: each region is cut into its views by one split call
        regions = [
            [k for k, a in arrays.items() if a.dtype == np.int64],
            [k for k, a in arrays.items() if a.dtype == np.bool_],
        ]
        padded = {k: -(-a.nbytes // _PART_BYTES) * _PART_BYTES for k, a in arrays.items()}
        int_bytes = sum(padded[k] for k in regions[0])
        size = int_bytes + sum(padded[k] for k in regions[1])
        device = torch.device(device)
        host = torch.empty(max(size, _PART_BYTES), dtype=torch.uint8, pin_memory=device.type == "cuda")
        flat, at = host.numpy(), 0
        for k in regions[0] + regions[1]:
            a = arrays[k]
            flat[at : at + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            at += padded[k]
        if into is not None:
            if into.numel() != host.numel() or into.dtype != torch.uint8:
                raise ValueError(f"static input buffer of {into.numel()} bytes, this step needs {host.numel()}")
            buffer = into.copy_(host, non_blocking=True)
        else:
            buffer = host.to(device, non_blocking=True) if device.type == "cuda" else host
        self.buffer = buffer  # uint8 [bytes]: every view below lies in it
        self._views = {}
        for keys, region, item in (
            (regions[0], buffer[:int_bytes].view(torch.int64), 8),
            (regions[1], buffer[int_bytes:size].view(torch.bool), 1),
        ):
            sizes = [n for k in keys for n in (arrays[k].nbytes // item, (padded[k] - arrays[k].nbytes) // item)]
            pieces = region.split_with_sizes(sizes) if keys else ()
            for k, piece in zip(keys, pieces[::2]):
                self._views[k] = piece if arrays[k].ndim == 1 else piece.view(arrays[k].shape)
        self._arrays = arrays  # keeps every id valid while this object lives

    def __call__(self, obj):
        if _is_host(obj):
            return self._views[id(obj)]
        if is_dataclass(obj) and not isinstance(obj, type):
            return replace(obj, **{f.name: self(getattr(obj, f.name)) for f in fields(obj) if f.init})
        if isinstance(obj, dict):
            return {k: self(v) for k, v in obj.items()}
        return obj


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
    """Candidate entries of one paged entry group, per request: token t sees rows[seg[t], :count[t]].

    rows: [B, E] request b's entries 0..E-1 as rows of the group (its page table expanded; entries past its pages
    name real rows of its last page: every consumer masks by count); count: [T] (position + 1) // ratio, the
    entries visible to each token; seg: [T] its request (the batch's seq_of_token). Nothing here is [T, E]: at a
    128K-token step of a 128K context that was 32 GiB of int64 rows (+ 4 GiB of flags) per group.
    """

    rows: torch.Tensor
    count: torch.Tensor
    seg: torch.Tensor

    def token_rows(self) -> torch.Tensor:
        """[T, E] rows of each token's request (materialised: the reference paths only, which gather [T, E, D]
        keys anyway)."""
        return self.rows.index_select(0, self.seg)

    def token_valid(self) -> torch.Tensor:
        """bool [T, E]: entry e is visible to token t (materialised: the reference paths only)."""
        return torch.arange(self.rows.shape[1], device=self.rows.device) < self.count.unsqueeze(1)


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


def ring_sources(
    pos, seg, starts, cu, ring_page, ring_rows: int, ring_total_rows: int, page_stride: int | None = None
) -> SourceRows:
    """pos: [N, W] positions; seg: their requests, [N, W] or [N, 1] (broadcast: each request's values gathered once
    a row). ring_rows: the ring's length (slot = pos % ring_rows); page_stride: rows a page (default ring_rows).
    -> SourceRows of pos's shape. numpy arrays (host) or tensors (device) alike: the same formula builds both."""
    s = starts[seg]
    valid = pos >= 0
    from_chunk = pos >= s
    chunk_row = _where(from_chunk, cu[seg] + pos - s, 0)
    ring_row = ring_page[seg] * (page_stride or ring_rows) + _clamp(pos, lo=0) % ring_rows
    return SourceRows(from_chunk, chunk_row, ring_row, valid, _where(from_chunk, ring_total_rows + chunk_row, ring_row))


def _ring_write(starts, ends, cu, ring_page, ring_rows: int, page_stride: int | None = None) -> RingWrite:
    """Host arrays: each request's last ring_rows positions of this step, into its ring page."""
    first = np.maximum(starts, ends - ring_rows)
    pos, seg = segment_arange(first, ends - first)
    return RingWrite(cu[seg] + pos - starts[seg], ring_page[seg] * (page_stride or ring_rows) + pos % ring_rows)


def _staging_writes(pool: CachePool, snapshots: list, starts, ends, cu) -> dict:
    """Ring group -> RingWrite (host arrays) of the rows an in-step snapshot keeps: for each request b with
    snapshots[b] = (point, {group: page}), positions [point - ring, point) of its chunk into that group's staging
    page (slot = position % ring, as _ring_write places them)."""
    window = pool.cfg.sliding_window
    out = {}
    for name in sorted({g for snap in snapshots if snap for g in snap[1]}):
        spec = pool.groups[name].spec
        positions = window if name == "swa" else spec.page_rows
        chunk, ring = [], []
        for b, snap in enumerate(snapshots):
            if not snap or name not in snap[1]:
                continue
            point, pages = snap
            if not starts[b] + positions <= point <= ends[b]:
                raise ValueError(
                    f"in-step snapshot at {point} needs positions {point - positions}.. in the chunk "
                    f"[{starts[b]}, {ends[b]}) of request {b}"
                )
            pos = np.arange(point - positions, point, dtype=np.int64)
            chunk.append(cu[b] + pos - starts[b])
            ring.append(pages[name] * spec.page_rows + pos % positions)
        out[name] = RingWrite(_host_rows(chunk), _host_rows(ring))
    return out


def _joined(first: RingWrite, extra: RingWrite | None) -> RingWrite:
    if extra is None:
        return first
    return RingWrite(_host_rows([first.chunk_row, extra.chunk_row]), _host_rows([first.ring_row, extra.ring_row]))


def _host_rows(parts) -> torch.Tensor:
    """Host row ids concatenated, in a field typed as what it becomes: a step's dataclasses hold numpy arrays
    while they are built on the host, and Upload swaps each for its device view before a layer reads it."""
    return cast(torch.Tensor, np.concatenate(parts))


def paged_rows(table, page_rows: int, seg, entry):
    """Rows of entries `entry` of requests `seg` in a paged group with page table `table` [B, pages]; numpy
    arrays or tensors alike."""
    page_idx = _clamp(_clamp(entry, lo=0) // page_rows, hi=table.shape[1] - 1)
    return table[seg, page_idx] * page_rows + _clamp(entry, lo=0) % page_rows


def _compress_plan(
    ratio: int,
    overlap: bool,
    starts,
    ends,
    cu,
    state_page,
    state_rows: int,
    state_total: int,
    entry_table,
    entry_page_rows: int,
) -> CompressPlan:
    """Host arrays: [N, ratio] sources of the N windows that close in this step."""
    first, last = starts // ratio, ends // ratio
    w, seg = segment_arange(first, last - first)
    cur_pos = (w * ratio)[:, None] + np.arange(ratio, dtype=np.int64)
    cur = ring_sources(cur_pos, seg[:, None], starts, cu, state_page, state_rows, state_total)
    prev = (
        ring_sources(cur_pos - ratio, seg[:, None], starts, cu, state_page, state_rows, state_total)
        if overlap
        else None
    )
    return CompressPlan(
        num_entries=int(w.size),
        cur=cur,
        prev=prev,
        entry_row=paged_rows(entry_table, entry_page_rows, seg, w),
        entry_pos=w * ratio,
        state_write=_ring_write(starts, ends, cu, state_page, state_rows),
    )


def _visible(ratio: int, positions, seg, table, page_rows: int, max_entries: int) -> VisibleEntries:
    """On the device: [B, max_entries] rows of every entry of each request, [T] visible counts."""
    dev = positions.device
    entries = torch.arange(max_entries, device=dev).unsqueeze(0)
    requests = torch.arange(table.shape[0], device=dev).unsqueeze(1)
    return VisibleEntries(paged_rows(table, page_rows, requests, entries), (positions + 1) // ratio, seg)


def _host_tables(tables: list[dict], names, widths: dict | None = None, fill: dict | None = None) -> dict:
    """Every group's page table as int64 [B, width] (numpy): width = widths[name] (longer rows cut) or else its
    widest row (>= 1); missing columns hold fill[name] (default 0, the scratch page)."""
    out = {}
    for name in names:
        rows = [t.get(name, ()) for t in tables]
        width = widths[name] if widths else max(1, max((len(r) for r in rows), default=1))
        table = np.full((len(rows), width), fill[name] if fill else 0, dtype=np.int64)
        for i, r in enumerate(rows):
            r = list(r)[:width]
            table[i, : len(r)] = r
        out[name] = table
    return out


def build_step(
    pool: CachePool,
    token_ids: list[list[int]],
    starts: list[int],
    tables: list[dict],
    logit_rows: list[int],
    device,
    snapshots: list | None = None,
) -> StepBatch:
    """token_ids[b]: the tokens request b runs this step, at positions starts[b]...; tables[b]: its pages.

    Every index tensor of O(tokens) size (positions, compressor plans, ring writes) is built on the host in numpy
    (a few dozen array ops, microseconds each) and goes to `device` in one copy that does not wait for the device;
    only the O(tokens x window) SWA sources and the O(requests x entries) visible-entry rows are derived on the
    device from them (about 40 kernels: an 8K-token prefill built every tensor on the device in ~320 launches,
    ~9 ms of host time on the H200 with the GPU idle). No device-to-host sync, so the host can build this step
    while the device still runs the one before.
    snapshots[b] (optional): (point, {ring group: staging page}) when request b keeps a prefix-cache snapshot
    point inside its chunk (engine.execution.prefix_cache): each of those rings' writes then also put the ring as it
    stands at `point` (positions [point - ring, point), all in the chunk) into its staging page."""
    host = host_step(pool, token_ids, starts, tables, logit_rows, snapshots)
    upload = Upload(host.arrays, device)
    return device_step(pool, host, {name: upload(value) for name, value in host.arrays.items()})


@dataclass(frozen=True)
class HostStep:
    """The host half of a step (`host_step`): its numpy arrays by StepBatch field, and the visible-entry groups
    the device half derives: group name -> (ratio, page rows, entries a request)."""

    arrays: dict
    visible_at: dict


def host_step(
    pool: CachePool,
    token_ids: list[list[int]],
    starts: list[int],
    tables: list[dict],
    logit_rows: list[int],
    snapshots: list | None = None,
    widths: dict | None = None,
    context: int | None = None,
) -> HostStep:
    """build_step's host arrays (its arguments). widths: each group's page-table width (rows cut or padded with
    the scratch page) and context: the visible-entry lists' length in positions (entries = context // ratio),
    both fixed by a bucket (engine.model.prefill_batch); None: sized by the step's contents."""
    cfg = pool.cfg
    counts = np.array([len(t) for t in token_ids], dtype=np.int64)
    starts_h = np.array(list(starts), dtype=np.int64)
    ends_h = starts_h + counts
    cu = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts)])
    positions, seg = segment_arange(starts_h, counts)
    ids = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=int(cu[-1]))
    group_tables = _host_tables(tables, pool.groups, widths, pool.scratch_pages if widths else None)
    staged = _staging_writes(pool, snapshots, starts_h, ends_h, cu) if snapshots and any(snapshots) else {}

    window = cfg.sliding_window
    swa_spec = pool.groups["swa"].spec  # a page may hold more rows than the window (fp8: whole 64-row blocks)
    swa_page = group_tables["swa"][:, 0]
    swa_write = _joined(_ring_write(starts_h, ends_h, cu, swa_page, window, swa_spec.page_rows), staged.get("swa"))
    compress, visible_at = {}, {}
    entry_groups = [(f"kv{r}", f"state{r}", r, r == 4) for r in cfg.ratios]
    if cfg.indexer_layers:
        entry_groups.append(("index", "index_state", 4, True))
    reach = int(ends_h.max(initial=0)) if context is None else context
    for entry_name, state_name, ratio, overlap in entry_groups:
        spec, state_spec = pool.groups[entry_name].spec, pool.groups[state_name].spec
        plan = _compress_plan(
            ratio,
            overlap,
            starts_h,
            ends_h,
            cu,
            group_tables[state_name][:, 0],
            state_spec.page_rows,
            state_spec.num_pages * state_spec.page_rows,
            group_tables[entry_name],
            spec.page_rows,
        )
        compress[entry_name] = replace(plan, state_write=_joined(plan.state_write, staged.get(state_name)))
        if entry_name != "kv4":  # CSA picks kv4 entries through the indexer instead of attending to all
            visible_at[entry_name] = (ratio, spec.page_rows, max(1, reach // ratio))

    arrays = dict(
        token_ids=ids,
        positions=positions,
        seq_of_token=seg,
        cu=cu,
        starts=starts_h,
        ends=ends_h,
        swa_write=swa_write,
        compress=compress,
        tables=group_tables,
        logit_rows=np.array(list(logit_rows), dtype=np.int64),
    )
    return HostStep(arrays, visible_at)


def device_step(pool: CachePool, host: HostStep, on_device: dict) -> StepBatch:
    """The StepBatch from `host`'s arrays on the device (`on_device`: the same dict, device views): derives the
    two big index sets there (the SWA sources and the visible-entry rows). No host sync: static shapes, so a
    CUDA graph can hold it (engine.execution.prefill_graphs)."""
    window = pool.cfg.sliding_window
    swa_spec = pool.groups["swa"].spec
    pos_d, seg_d, tables_d = on_device["positions"], on_device["seq_of_token"], on_device["tables"]
    win_pos = pos_d.unsqueeze(1) - window + 1 + torch.arange(window, device=pos_d.device)
    swa = ring_sources(
        win_pos,
        seg_d.unsqueeze(1),
        on_device["starts"],
        on_device["cu"],
        tables_d["swa"][:, 0],
        window,
        swa_spec.num_pages * swa_spec.page_rows,
        swa_spec.page_rows,
    )
    visible = {
        name: _visible(ratio, pos_d, seg_d, tables_d[name], page_rows, entries)
        for name, (ratio, page_rows, entries) in host.visible_at.items()
    }
    return StepBatch(swa=swa, visible=visible, **on_device)
