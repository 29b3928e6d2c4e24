"""Transfer plan: which pages of which cache group move from a prefill pool to a decode pool, as byte ranges.

Pure Python over `CacheGroupSpec`s; no tensors, no I/O. Both backends (NIXL and TCP) execute the same plan, which
is what makes their results byte-identical.

Geometry (see engine.model.cache): a group tensor is [num_layers_in_group, num_pages * page_rows, width], contiguous, so
relative to the tensor's first byte
    page_bytes   = page_rows * width * itemsize          (one page of one layer)
    layer_stride = num_pages * page_bytes
    page p of layer slot l  = bytes [l * layer_stride + p * page_bytes, + page_bytes)
A request needs, for `num_tokens` prompt positions:
- fixed groups (`swa` ring, `state{r}` and `index_state` compressor rings): their one page (the whole ring: the
  SWA tail and the open-window compressor state both live there);
- growing groups (`kv{r}`, `index`): ceil((num_tokens // ratio) / page_rows) pages, the last possibly partial
  (moved whole: the unused rows are never read, and one range is cheaper than a row-exact cut).
Runs of pages that are consecutive on BOTH sides become one range per layer; ranges that touch on both sides
(e.g. a run covering every page of a layer on both sides) are merged again, because the descriptor count,
not the byte count, is what a transfer engine pays for.
Streaming (chunk by chunk): while a long prompt is still being prefilled, the pages its finished chunks filled
completely (growing groups only: `complete_pages`; they are never written again) can move in chunk plans
(`final=False`, positions [start_tokens, num_tokens) of the chunk); the final plan then moves only what is left:
the growing groups' pages from the first one not moved yet (the partial page included), and the fixed groups
(the SWA tail and the compressor state are rewritten by every chunk, so they move once, at the end). `page_span`
gives the slice of a request's page list each plan moves.
The source and destination pools may differ in `num_pages` (prefill and decode size their pools independently);
everything else in the layout must match.

Staged layout (`staged_layout`, the NIXL backend's one-descriptor path): the same pages, packed into one
contiguous byte range of a staging buffer on each side. Groups follow spec order, each at an offset aligned to
STAGING_ALIGN bytes; inside a group the bytes are [layer slot, page in request order, page_bytes], i.e. what
`index_select(dim=1)` of the group tensor viewed as [layers, num_pages, page_bytes] with the request's page ids
produces. The source gathers its pages (the plan's src side) into that range, the destination READs the range
whole into its own staging range and scatters it to its pages (the plan's dst side). The range's size depends
only on the layout and the page counts, so both sides compute the same offsets from the same plan.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.model.cache import CacheGroupSpec


@functools.cache
def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element; works for integer (quantised byte) dtypes too, unlike torch.finfo. Cached: every pull's
    plan asks it per group (a tensor made each time cost ~0.2 ms a pull on the CPU)."""
    return torch.empty((), dtype=dtype).element_size()


def page_bytes(spec: CacheGroupSpec) -> int:
    """Bytes of one page of ONE layer of the group."""
    return spec.page_rows * spec.width * itemsize(spec.dtype)


def layer_stride(spec: CacheGroupSpec) -> int:
    """Bytes between the same row of two consecutive layer slots."""
    return spec.num_pages * page_bytes(spec)


def group_nbytes(spec: CacheGroupSpec) -> int:
    return len(spec.layers) * layer_stride(spec)


def _layout_key(spec: CacheGroupSpec) -> tuple:
    # Everything that fixes where a page's bytes are, except num_pages (pool size may differ per side).
    return (spec.name, tuple(spec.layers), spec.page_rows, spec.width, str(spec.dtype), spec.tokens_per_row)


def layout_fingerprint(specs: Sequence[CacheGroupSpec]) -> str:
    """Short hash of the page layout of every group; two pools can exchange pages iff fingerprints match."""
    blob = json.dumps([_layout_key(s) for s in specs]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class ByteRange:
    """One descriptor: `length` bytes at `src_offset` of the source group tensor -> `dst_offset` of the destination."""

    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class GroupPlan:
    """One group's pages of a request and where they lie on each side; `pages` (pairs) and `ranges` (the
    page-descriptor path's byte ranges) are derived on first use only: a staged pull needs neither."""

    name: str
    src_ids: tuple[int, ...]  # the source's pages, in request order
    dst_ids: tuple[int, ...]  # the destination's, the same length
    layers: int  # layer slots of the group (each page is moved for every one)
    page_bytes: int  # bytes of one page of one layer
    src_layer_stride: int
    dst_layer_stride: int
    # per side (source, destination): its first page when its pages are one run of consecutive ids (`run_start`),
    # else None; build_plan finds them while it checks the pages (staged_layout reads them); None: not known
    runs: tuple[int | None, int | None] | None = None

    @functools.cached_property
    def pages(self) -> tuple[tuple[int, int], ...]:
        """(src_page, dst_page) pairs, in request order."""
        return tuple(zip(self.src_ids, self.dst_ids))

    @property
    def nbytes(self) -> int:
        return len(self.src_ids) * self.layers * self.page_bytes

    @functools.cached_property
    def range_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The coalesced byte ranges as (src_offsets, dst_offsets, lengths) int64 arrays, relative to each side's
        group tensor (see the module docstring)."""
        return _group_ranges(self)

    @property
    def ranges(self) -> tuple[ByteRange, ...]:
        """`range_arrays` as ByteRanges."""
        src, dst, length = self.range_arrays
        return tuple(ByteRange(int(s), int(d), int(n)) for s, d, n in zip(src, dst, length))

    @property
    def num_descriptors(self) -> int:
        return len(self.range_arrays[2])


@dataclass(frozen=True)
class TransferPlan:
    num_tokens: int
    groups: tuple[GroupPlan, ...]  # every group of the layout, in spec order (possibly with no pages)
    start_tokens: int = 0  # a streamed request's pages filled by [0, start_tokens) moved with earlier chunks
    final: bool = True  # False: a chunk (complete pages of the growing groups only)

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def num_descriptors(self) -> int:
        """Descriptors of the page-descriptor path (a staged pull posts one instead)."""
        return sum(g.num_descriptors for g in self.groups)

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no cache group {name!r} in plan; groups: {[g.name for g in self.groups]}")


STAGING_ALIGN = 256  # bytes: every staged group starts aligned (wide loads, any dtype view)


def align_up(n: int, k: int = STAGING_ALIGN) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class StagedGroup:
    """One group's place in a request's staging range: bytes [offset, offset + nbytes) hold
    [layers, len(pages), page_bytes], pages as (src_page, dst_page) in request order. `runs[side]`: the first
    page when that side's pages are one run of consecutive ids in request order (the copy is then a slice, no
    page-id index), else None."""

    name: str
    offset: int
    layers: int
    page_bytes: int
    sides: tuple[tuple[int, ...], tuple[int, ...]]  # (src ids, dst ids), in request order
    runs: tuple[int | None, int | None] = (None, None)

    @property
    def num_pages(self) -> int:
        return len(self.sides[0])

    @functools.cached_property
    def pages(self) -> tuple[tuple[int, int], ...]:
        """(src_page, dst_page) pairs, in request order."""
        return tuple(zip(*self.sides))

    @property
    def nbytes(self) -> int:
        return self.layers * self.num_pages * self.page_bytes

    def ids(self, side: int) -> tuple[int, ...]:
        """The page ids of one side (0: source, 1: destination), in request order."""
        return self.sides[side]


def run_start(ids: Sequence[int]) -> int | None:
    """ids[0] when ids are consecutive and increasing (one slice of pages), else None."""
    first, n = ids[0], len(ids)
    if ids[-1] - first != n - 1:  # most tables that are no run fail here, without a copy
        return None
    return first if tuple(ids) == tuple(range(first, first + n)) else None  # tuple(a tuple) is no copy


@dataclass(frozen=True)
class StagedLayout:
    groups: tuple[StagedGroup, ...]  # groups with pages only, in spec order
    nbytes: int  # the whole staging range, alignment gaps included

    @property
    def payload_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def staged_layout(plan: TransferPlan) -> StagedLayout:
    """The staged form of `plan` (see the module docstring): per group its offset in the request's staging
    range and its page order (the same on both sides: the plan's groups carry the layout)."""
    groups, off = [], 0
    for g in plan.groups:
        src = g.src_ids
        if not src:
            continue
        runs = (run_start(src), run_start(g.dst_ids)) if g.runs is None else g.runs
        groups.append(StagedGroup(g.name, off, g.layers, g.page_bytes, (src, g.dst_ids), runs))
        off = align_up(off + g.layers * len(src) * g.page_bytes)
    return StagedLayout(tuple(groups), off)


def staged_nbytes(specs: Sequence[CacheGroupSpec], num_tokens: int) -> int:
    """Size of the staging range `staged_layout` gives a request of `num_tokens` (without building a plan)."""
    return sum(align_up(len(s.layers) * pages_needed(s, num_tokens) * page_bytes(s)) for s in specs)


def pages_needed(spec: CacheGroupSpec, num_tokens: int) -> int:
    """Pages of `spec` that hold data for positions [0, num_tokens)."""
    return spec.pages_for_tokens(num_tokens)


def complete_pages(spec: CacheGroupSpec, num_tokens: int) -> int:
    """Pages of a growing group that positions [0, num_tokens) fill completely: written once, never again by the
    prefill of later positions (a chunk may move them). 0 for a fixed group (rewritten by every chunk)."""
    return 0 if spec.fixed else spec.rows_for_tokens(num_tokens) // spec.page_rows


def page_span(spec: CacheGroupSpec, num_tokens: int, start_tokens: int = 0, final: bool = True) -> tuple[int, int]:
    """[lo, hi) of the request's page list of `spec` that a plan moves (see the module docstring's streaming):
    the pages not moved by earlier chunks (those [0, start_tokens) filled), up to every page holding data for
    num_tokens when final, else up to the pages num_tokens fills completely; a fixed group only when final."""
    if spec.fixed:
        return (0, 1) if final else (0, 0)
    hi = pages_needed(spec, num_tokens) if final else complete_pages(spec, num_tokens)
    return min(complete_pages(spec, start_tokens), hi), hi


_NO_PAGES: tuple[tuple[int, ...], int | None] = ((), None)


def _check_pages(
    spec: CacheGroupSpec, pages: Mapping[str, Sequence[int]], lo: int, hi: int, side: str
) -> tuple[tuple[int, ...], int | None]:
    """(entries [lo, hi) of the side's page list of `spec`, checked (in range, no repeat among them); their first
    page when they are one run of consecutive ids, else None (`run_start`))."""
    if hi <= lo:
        return _NO_PAGES
    if spec.name not in pages:
        raise ValueError(f"{side} page table has no group {spec.name!r} (needs {hi} page(s))")
    table = pages[spec.name]
    if len(table) < hi:
        raise ValueError(f"{side} page table of group {spec.name!r} has {len(table)} page(s), needs {hi}")
    have = tuple(table[lo:hi])  # only the slice: a stream's chunks cost their own pages, not the prefix
    if type(have[0]) is not int:  # a table of numpy / torch integers: as Python ints (int() a page costs ~50 ns)
        have = tuple(map(int, have))
    run = run_start(have)
    if run is not None and run >= 0 and have[-1] < spec.num_pages:
        return have, run  # one run of consecutive pages, in range: no repeat possible (most fresh tables)
    last = have[-1]
    if (
        have[0] - last == len(have) - 1
        and last >= 0
        and have[0] < spec.num_pages
        and have == tuple(range(have[0], last - 1, -1))
    ):
        return have, None  # one run downwards (the allocator hands a freed request's pages back last-in first-out)
    if min(have) < 0 or max(have) >= spec.num_pages:
        bad = [p for p in have if not 0 <= p < spec.num_pages]
        raise ValueError(f"{side} pages {bad} of group {spec.name!r} out of range [0, {spec.num_pages})")
    if len(set(have)) != len(have):
        raise ValueError(f"{side} page table of group {spec.name!r} repeats a page: {have}")
    return have, run


def _group_ranges(g: GroupPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_offsets, dst_offsets, lengths) of the group's byte ranges: runs of pages consecutive on both sides,
    one range per layer slot each, then ranges that touch on both sides merged (array ops, no per-page loop)."""
    if not g.src_ids:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    src, dst = np.asarray(g.src_ids, dtype=np.int64), np.asarray(g.dst_ids, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, (np.diff(src) != 1) | (np.diff(dst) != 1)])  # first page of each run
    counts = np.diff(np.r_[starts, len(src)])
    slots = np.arange(g.layers, dtype=np.int64)[:, None]  # layer-major: every run of slot 0, then of slot 1, ...
    src_off = (slots * g.src_layer_stride + src[starts] * g.page_bytes).ravel()
    dst_off = (slots * g.dst_layer_stride + dst[starts] * g.page_bytes).ravel()
    length = np.broadcast_to(counts * g.page_bytes, (g.layers, len(starts))).ravel()
    ends_src, ends_dst = src_off + length, dst_off + length
    touches = (ends_src[:-1] == src_off[1:]) & (ends_dst[:-1] == dst_off[1:])
    first = np.flatnonzero(np.r_[True, ~touches])  # the first range of each merged run
    return src_off[first], dst_off[first], np.add.reduceat(length, first)


def build_plan(
    specs: Sequence[CacheGroupSpec],
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
    num_tokens: int,
    dst_specs: Sequence[CacheGroupSpec] | None = None,
    start_tokens: int = 0,
    final: bool = True,
    src_moved: bool = False,
) -> TransferPlan:
    """Plan the move of one request's caches (or of one streamed chunk of them: start_tokens / final, see
    `page_span`).

    specs: the source pool's groups; dst_specs: the destination pool's (default: the same). They must agree on
    everything but num_pages. src_pages / dst_pages: group name -> page ids (a request's PageTable, from its first
    page; with src_moved, src_pages holds only the pages this plan moves, as a ticket lists them); extra pages
    beyond what num_tokens needs are ignored. Raises ValueError naming the group on any inconsistency.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if not 0 <= start_tokens <= num_tokens:
        raise ValueError(f"start_tokens must be in [0, num_tokens={num_tokens}], got {start_tokens}")
    groups = []
    for src, dst, (layers, pb, src_stride, dst_stride) in _pairs(specs, specs if dst_specs is None else dst_specs):
        lo, hi = page_span(src, num_tokens, start_tokens, final)
        # a ticket's source table holds the moved pages only (src_moved); a request's table starts at its first
        src_lo, src_hi = (0, hi - lo) if src_moved else (lo, hi)
        src_ids, src_run = _check_pages(src, src_pages, src_lo, src_hi, "source")
        dst_ids, dst_run = _check_pages(dst, dst_pages, lo, hi, "destination")
        groups.append(GroupPlan(src.name, src_ids, dst_ids, layers, pb, src_stride, dst_stride, (src_run, dst_run)))
    return TransferPlan(num_tokens, tuple(groups), start_tokens, final)


_Pair = tuple[CacheGroupSpec, CacheGroupSpec, tuple[int, int, int, int]]
# (ids of the source specs, ids of the destination specs) -> (the specs, their pairs): a pool's specs are made once
# (a backend keeps its own and each peer's), so every plan between two pools hits; an entry holds the specs it was
# made from, so an id reused by a later object never matches (checked with `is`).
_PAIRS: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[CacheGroupSpec, ...], tuple[_Pair, ...]]] = {}
_PAIRS_CAP = 1024


def _pairs(specs: Sequence[CacheGroupSpec], dst_specs: Sequence[CacheGroupSpec]) -> tuple[_Pair, ...]:
    """Per group, in spec order: (source spec, destination spec, `_pair_geometry`), the group sets checked equal;
    made once per pair of spec lists (each plan would otherwise look up and check every group again)."""
    key = (tuple(map(id, specs)), tuple(map(id, dst_specs)))
    hit = _PAIRS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], (*specs, *dst_specs))):
        return hit[1]
    if [s.name for s in specs] != [s.name for s in dst_specs]:
        raise ValueError(
            f"group sets differ: source {[s.name for s in specs]}, destination {[s.name for s in dst_specs]}"
        )
    pairs = tuple((s, d, _pair_geometry(s, d)) for s, d in zip(specs, dst_specs))
    if len(_PAIRS) >= _PAIRS_CAP:  # many short-lived pools (tests): start over rather than grow
        _PAIRS.clear()
    _PAIRS[key] = ((*specs, *dst_specs), pairs)
    return pairs


def _pair_geometry(src: CacheGroupSpec, dst: CacheGroupSpec) -> tuple[int, int, int, int]:
    """(layer slots, page bytes, source layer stride, destination layer stride) of a group's source and destination
    specs, their layouts checked equal (`_pairs` keeps the answers)."""
    if src is not dst and _layout_key(src) != _layout_key(dst):
        raise ValueError(f"group {src.name!r}: page layouts differ: {_layout_key(src)} vs {_layout_key(dst)}")
    return len(src.layers), page_bytes(src), layer_stride(src), layer_stride(dst)
