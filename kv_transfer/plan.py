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
    name: str
    pages: tuple[tuple[int, int], ...]  # (src_page, dst_page) pairs, in request order
    ranges: tuple[ByteRange, ...]  # coalesced, relative to each side's group tensor

    @property
    def nbytes(self) -> int:
        return sum(r.length for r in self.ranges)


@dataclass(frozen=True)
class TransferPlan:
    num_tokens: int
    groups: tuple[GroupPlan, ...]  # every group of the layout, in spec order (possibly with no pages)

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def num_descriptors(self) -> int:
        return sum(len(g.ranges) for g in self.groups)

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
    [layers, len(pages), page_bytes], pages as (src_page, dst_page) in request order."""

    name: str
    offset: int
    layers: int
    page_bytes: int
    pages: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.layers * len(self.pages) * self.page_bytes


@dataclass(frozen=True)
class StagedLayout:
    groups: tuple[StagedGroup, ...]  # groups with pages only, in spec order
    nbytes: int  # the whole staging range, alignment gaps included

    @property
    def payload_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def staged_layout(plan: TransferPlan, specs: Sequence[CacheGroupSpec]) -> StagedLayout:
    """The staged form of `plan` (see the module docstring): per group its offset in the request's staging
    range and its page order. `specs`: either side's groups (only the layout, not num_pages, is read)."""
    by_name = {s.name: s for s in specs}
    groups, off = [], 0
    for g in plan.groups:
        if not g.pages:
            continue
        spec = by_name[g.name]
        sg = StagedGroup(g.name, off, len(spec.layers), page_bytes(spec), g.pages)
        groups.append(sg)
        off = align_up(off + sg.nbytes)
    return StagedLayout(tuple(groups), off)


def staged_nbytes(specs: Sequence[CacheGroupSpec], num_tokens: int) -> int:
    """Size of the staging range `staged_layout` gives a request of `num_tokens` (without building a plan)."""
    return sum(align_up(len(s.layers) * pages_needed(s, num_tokens) * page_bytes(s)) for s in specs)


def pages_needed(spec: CacheGroupSpec, num_tokens: int) -> int:
    """Pages of `spec` that hold data for positions [0, num_tokens)."""
    return spec.pages_for_tokens(num_tokens)


def _check_pages(spec: CacheGroupSpec, pages: Mapping[str, Sequence[int]], need: int, side: str) -> list[int]:
    if need == 0:
        return []
    if spec.name not in pages:
        raise ValueError(f"{side} page table has no group {spec.name!r} (needs {need} page(s))")
    have = [int(p) for p in pages[spec.name]]
    if len(have) < need:
        raise ValueError(f"{side} page table of group {spec.name!r} has {len(have)} page(s), needs {need}")
    have = have[:need]
    bad = [p for p in have if not 0 <= p < spec.num_pages]
    if bad:
        raise ValueError(f"{side} pages {bad} of group {spec.name!r} out of range [0, {spec.num_pages})")
    if len(set(have)) != len(have):
        raise ValueError(f"{side} page table of group {spec.name!r} repeats a page: {have}")
    return have


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) pairs -> [(src_start, dst_start, count)] runs consecutive on both sides."""
    runs: list[list[int]] = []
    for s, d in pairs:
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def _group_ranges(src: CacheGroupSpec, dst: CacheGroupSpec, pairs) -> tuple[ByteRange, ...]:
    pb = page_bytes(src)
    src_ls, dst_ls = layer_stride(src), layer_stride(dst)
    out: list[ByteRange] = []
    runs = _runs(pairs)
    for slot in range(len(src.layers)):
        for s, d, n in runs:
            r = ByteRange(slot * src_ls + s * pb, slot * dst_ls + d * pb, n * pb)
            last = out[-1] if out else None
            if last and last.src_offset + last.length == r.src_offset and last.dst_offset + last.length == r.dst_offset:
                out[-1] = ByteRange(last.src_offset, last.dst_offset, last.length + r.length)
            else:
                out.append(r)
    return tuple(out)


def build_plan(
    specs: Sequence[CacheGroupSpec],
    src_pages: Mapping[str, Sequence[int]],
    dst_pages: Mapping[str, Sequence[int]],
    num_tokens: int,
    dst_specs: Sequence[CacheGroupSpec] | None = None,
) -> TransferPlan:
    """Plan the move of one request's caches.

    specs: the source pool's groups; dst_specs: the destination pool's (default: the same). They must agree on
    everything but num_pages. src_pages / dst_pages: group name -> page ids (a request's PageTable); extra pages
    beyond what num_tokens needs are ignored. Raises ValueError naming the group on any inconsistency.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    dst_specs = list(specs) if dst_specs is None else list(dst_specs)
    dst_by_name = {s.name: s for s in dst_specs}
    if [s.name for s in specs] != [s.name for s in dst_specs]:
        raise ValueError(
            f"group sets differ: source {[s.name for s in specs]}, destination {[s.name for s in dst_specs]}"
        )
    groups = []
    for src in specs:
        dst = dst_by_name[src.name]
        if _layout_key(src) != _layout_key(dst):
            raise ValueError(f"group {src.name!r}: page layouts differ: {_layout_key(src)} vs {_layout_key(dst)}")
        need = pages_needed(src, num_tokens)
        pairs = tuple(
            zip(_check_pages(src, src_pages, need, "source"), _check_pages(dst, dst_pages, need, "destination"))
        )
        groups.append(GroupPlan(src.name, pairs, _group_ranges(src, dst, pairs)))
    return TransferPlan(num_tokens, tuple(groups))
