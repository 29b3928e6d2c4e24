"""Paged cache pool: one group per cache kind, each a flat page tensor plus its own page allocator.

Groups (names are stable: the KV-transfer plan and the metrics use them):
- `swa`          all layers; one page per request = the sliding-window ring (slot = pos % window).
- `kv{r}`        layers with compress ratio r; compressed KV entries, `page_rows` entries a page,
                 entry w of a request at row w % page_rows of page table[w // page_rows].
- `index`        CSA layers; indexer keys (ratio 4), paged like `kv4`.
- `state{r}`     layers with ratio r; one page per request = the compressor state ring
                 (fp32 [kv | score] rows of the open window(s), slot = pos % rows).
- `index_state`  CSA layers; the indexer compressor's state ring.
Each group's tensor is [num_layers_in_group, num_pages * page_rows, width]: flat rows, so every read
and write is one gather / index_copy with row = page * page_rows + offset (CUDA-graph friendly).
Page 0 of every group is the pool's scratch page (`CachePool.scratch_pages`), never given to a request:
fixed-shape decode steps (engine.model.decode_batch) point their padding slots and the writes of windows that
do not close at it, so a captured CUDA graph can write unconditionally. Groups are sized one page larger.

Formats (`CacheConfig.kv_cache_dtype`):
- "exact" (and "auto" as CacheConfig holds it, i.e. unresolved): every group holds exact rows in the model
  dtype (what the reference engine and the oracle pin). `load_engine` resolves the CLI's "auto" first
  (engine.model.fast_paths.resolve_kv_cache_dtype: fp8 on a bf16 CUDA engine where FlashMLA decodes V4's geometry).
- "fp8": the production formats of `dsv4_kernels.geometry`, stored as uint8 (width = a packed row's bytes):
  `swa` and `kv{r}` hold fp8_ds_mla rows, `index` holds MXFP4 keys (or FP8 ones with
  `index_cache_dtype="fp8"`); `state{r}` / `index_state` stay fp32 in both modes.
  Byte placement is geometry's block layout: a block of `block_size` rows stores all its value rows,
  then all its scale rows (`geometry.write_rows` / `read_rows` produce the same bytes). A block is one
  engine page for `kv{r}` and `index` (page_rows = 256 // r and 64 at the default page_tokens=256, as
  geometry's compressed_block_rows), and `geometry.SWA_BLOCK_ROWS` (64) rows for `swa`, whose page (one
  request's ring) is rounded up to whole blocks, as `geometry.SwaLayout` sizes it (slots >= window unused).
  So a page moved by kv_transfer is a run of whole geometry blocks, byte for byte.
  Models whose NoPE width (or index_head_dim) is not a multiple of the format's scale block (the tiny and
  small test presets) are zero-padded up to one: zeros never change a block's amax, so the stored
  values equal a quantisation with a block of the model's own width; real V4 dims need no padding
  (fp8_ds_mla 584 B, MXFP4 68 B, FP8 indexer 132 B a row).
Every read and write of swa / kv{r} / index goes through `CacheGroup.read` / `write` (or a bound
`CacheLayer`): plain indexing for exact groups (bit-identical to before), pack / unpack for quantised ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from dsv4_kernels import geometry
from engine.model.allocator import OutOfPages, PageAllocator
from engine.model.config import ModelConfig

KV_CACHE_DTYPES = ("auto", "exact", "fp8")
SCRATCH_PAGES = 1  # page 0 of every group (see the module docstring)
INDEX_CACHE_DTYPES = ("mxfp4", "fp8")


@dataclass(frozen=True)
class RowCodec:
    """Values <-> packed rows of one quantised group, and where the packed rows' bytes live.

    fmt: "fp8_ds_mla" | "mxfp4" | "fp8"; dim: values a row holds in the model (head_dim / index_head_dim);
    layout: the geometry row layout (block_size = rows per block; dims possibly zero-padded, see the
    module docstring); nope: the model's NoPE width (fp8_ds_mla only; layout.nope_dim may be larger).
    """

    fmt: str
    dim: int
    layout: geometry.Fp8DsMlaLayout | geometry.IndexerKeyLayout
    nope: int = 0

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.layout, geometry.Fp8DsMlaLayout):  # fmt "fp8_ds_mla"
            extra = self.layout.nope_dim - self.nope
            if extra:
                zeros = x.new_zeros(x.shape[0], extra)
                x = torch.cat([x[:, : self.nope], zeros, x[:, self.nope :]], dim=1)
        else:
            extra = self.layout.index_head_dim - self.dim
            if extra:
                x = torch.cat([x, x.new_zeros(x.shape[0], extra)], dim=1)
        return x

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] float -> uint8 [N, row_bytes] packed rows (value bytes, then scale bytes)."""
        x = x.reshape(-1, self.dim).float()
        return geometry.pack_rows(self.layout, self._pad(x))

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [N, row_bytes] -> [N, dim] in dtype."""
        v = geometry.unpack_rows(self.layout, packed)
        if isinstance(self.layout, geometry.Fp8DsMlaLayout):  # fmt "fp8_ds_mla"
            if self.layout.nope_dim != self.nope:
                v = torch.cat([v[:, : self.nope], v[:, self.layout.nope_dim :]], dim=1)
        elif v.shape[1] != self.dim:
            v = v[:, : self.dim]
        return v.to(dtype)


class Reclaimer(Protocol):
    """What frees pages the pool counts as free but that are still held (the prefix cache's unreferenced blocks)."""

    def reclaim(self, need: dict[str, int]) -> None:
        """Evict until every group named in `need` has that many free pages (or nothing more can go)."""
        ...


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def fp8_ds_mla_codec(head_dim: int, rope_dim: int, block_size: int) -> RowCodec:
    nope = head_dim - rope_dim
    padded = _round_up(nope, geometry.FP8_DS_MLA_QUANT_BLOCK)
    return RowCodec("fp8_ds_mla", head_dim, geometry.Fp8DsMlaLayout(padded + rope_dim, rope_dim, block_size), nope)


def indexer_codec(dim: int, fmt: str, block_size: int) -> RowCodec:
    block = geometry.MXFP4_BLOCK if fmt == "mxfp4" else geometry.FP8_INDEXER_BLOCK
    return RowCodec(fmt, dim, geometry.IndexerKeyLayout(_round_up(dim, block), fmt, block_size))


@dataclass(frozen=True)
class CacheGroupSpec:
    name: str
    layers: tuple[int, ...]  # model layer ids stored in this group, in order
    page_rows: int  # rows per page
    width: int  # elements per row
    dtype: torch.dtype
    tokens_per_row: int  # 0 for fixed (one page per request) groups, else the compress ratio
    num_pages: int
    codec: RowCodec | None = None  # None: exact rows of `width` values in `dtype`; else uint8 packed rows

    @property
    def dim(self) -> int:
        """Values a row holds in the model (width, unless the rows are packed bytes)."""
        return self.width if self.codec is None else self.codec.dim

    @property
    def fixed(self) -> bool:
        return self.tokens_per_row == 0

    def layer_slot(self, layer: int) -> int:
        return self.layers.index(layer)

    def rows_for_tokens(self, num_tokens: int) -> int:
        return 0 if self.fixed else num_tokens // self.tokens_per_row

    def pages_for_tokens(self, num_tokens: int) -> int:
        if self.fixed:
            return 1
        return math.ceil(self.rows_for_tokens(num_tokens) / self.page_rows)


@dataclass(frozen=True)
class CacheConfig:
    max_requests: int = 64  # concurrent requests holding caches (fixed groups are sized by it)
    max_tokens: int = 1 << 16  # total cached tokens across requests (growing groups are sized by it)
    page_tokens: int = 256  # tokens covered by one page of a growing group
    kv_cache_dtype: str = "auto"  # "auto" / "exact": exact rows in the model dtype; "fp8": the production formats
    index_cache_dtype: str = "mxfp4"  # indexer keys when kv_cache_dtype == "fp8": "mxfp4" or "fp8"
    staging_pages: int = 0  # fixed-group pages beyond one a request: the prefix cache's in-chunk snapshots
    mtp_layers: int = 0  # MTP draft layers (speculative decoding) whose SWA rows the `swa` group also holds

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ValueError(f"index_cache_dtype must be one of {INDEX_CACHE_DTYPES}, got {self.index_cache_dtype!r}")


def group_specs(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> list[CacheGroupSpec]:
    # MTP draft layer i is swa layer num_layers + i: its SWA-only KV shares each request's ring page
    all_layers = tuple(range(cfg.num_layers + cache.mtp_layers))
    fp8 = cache.kv_cache_dtype == "fp8"
    fixed_pages = cache.max_requests + SCRATCH_PAGES + cache.staging_pages  # a page a request, scratch, staging

    def kv_spec(name, layers, rows, ratio, pages, block_size):
        if not fp8:
            return CacheGroupSpec(name, layers, rows, cfg.head_dim, dtype, ratio, pages)
        codec = fp8_ds_mla_codec(cfg.head_dim, cfg.rope_dim, block_size)
        return CacheGroupSpec(name, layers, rows, codec.row_bytes, torch.uint8, ratio, pages, codec)

    if fp8:  # the ring in whole SWA blocks, as geometry.SwaLayout sizes it
        swa_block = geometry.SWA_BLOCK_ROWS
        specs = [kv_spec("swa", all_layers, _round_up(cfg.sliding_window, swa_block), 0, fixed_pages, swa_block)]
    else:
        specs = [kv_spec("swa", all_layers, cfg.sliding_window, 0, fixed_pages, 0)]
    for r in cfg.ratios:
        layers = cfg.layers_with_ratio(r)
        rows = max(1, cache.page_tokens // r)
        # + one partial page per request, + the scratch page
        pages = math.ceil(cache.max_tokens / r / rows) + cache.max_requests + SCRATCH_PAGES
        specs.append(kv_spec(f"kv{r}", layers, rows, r, pages, rows))
        coff = 2 if r == 4 else 1
        specs.append(
            CacheGroupSpec(f"state{r}", layers, coff * r, 2 * coff * cfg.head_dim, torch.float32, 0, fixed_pages)
        )
    if cfg.indexer_layers:
        layers = cfg.indexer_layers
        rows = max(1, cache.page_tokens // 4)
        pages = math.ceil(cache.max_tokens / 4 / rows) + cache.max_requests + SCRATCH_PAGES
        if fp8:
            codec = indexer_codec(cfg.index_head_dim, cache.index_cache_dtype, rows)
            specs.append(CacheGroupSpec("index", layers, rows, codec.row_bytes, torch.uint8, 4, pages, codec))
        else:
            specs.append(CacheGroupSpec("index", layers, rows, cfg.index_head_dim, dtype, 4, pages))
        specs.append(CacheGroupSpec("index_state", layers, 8, 4 * cfg.index_head_dim, torch.float32, 0, fixed_pages))
    return specs


class CacheGroup:
    """One cache kind: the page tensor, its allocator and its row codec.

    `read` / `write` are the only way the model touches swa / kv{r} / index rows: exact groups index the
    tensor directly; quantised ones (spec.codec) pack on write and unpack on read, in `compute_dtype`.
    """

    def __init__(self, spec: CacheGroupSpec, device: torch.device | str, compute_dtype: torch.dtype | None = None):
        self.spec = spec
        self.codec = spec.codec
        self.compute_dtype = compute_dtype if compute_dtype is not None and spec.codec is not None else spec.dtype
        self.allocator = PageAllocator(spec.num_pages, spec.name)
        self.tensor = torch.zeros(
            len(spec.layers), spec.num_pages * spec.page_rows, spec.width, dtype=spec.dtype, device=device
        )
        if self.codec is not None and spec.page_rows % self.codec.layout.block_size:
            raise ValueError(
                f"group {spec.name!r}: {spec.page_rows} rows a page is not a whole number of "
                f"{self.codec.layout.block_size}-row blocks"
            )

    @property
    def quantised(self) -> bool:
        return self.codec is not None

    @property
    def usable_pages(self) -> int:
        """Pages requests can hold (all but the scratch page)."""
        return self.spec.num_pages - SCRATCH_PAGES

    @property
    def num_rows(self) -> int:
        return self.tensor.shape[1]

    def layer(self, layer: int) -> torch.Tensor:
        """[num_pages * page_rows, width] view of one model layer (raw storage: bytes when quantised)."""
        return self.tensor[self.spec.layer_slot(layer)]

    def bind(self, layer: int) -> CacheLayer:
        return CacheLayer(self, layer)

    # ---- codec -------------------------------------------------------------------------------------
    @property
    def packed_codec(self) -> RowCodec:
        """The row codec of a quantised group; a ValueError on an exact one (it has no packed rows)."""
        if self.codec is None:
            raise ValueError(f"cache group {self.spec.name!r} holds exact rows: it has no packed rows to code")
        return self.codec

    @property
    def mla_layout(self) -> geometry.Fp8DsMlaLayout:
        """The row layout of an fp8_ds_mla group (SWA ring, compressed KV); a ValueError on any other group."""
        layout = self.packed_codec.layout
        if not isinstance(layout, geometry.Fp8DsMlaLayout):
            raise ValueError(f"cache group {self.spec.name!r} is {self.packed_codec.fmt}, not fp8_ds_mla")
        return layout

    @property
    def index_layout(self) -> geometry.IndexerKeyLayout:
        """The row layout of a quantised indexer-key group (MXFP4 / FP8); a ValueError on any other group."""
        layout = self.packed_codec.layout
        if not isinstance(layout, geometry.IndexerKeyLayout):
            raise ValueError(f"cache group {self.spec.name!r} is {self.packed_codec.fmt}, not indexer keys")
        return layout

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> uint8 [N, row_bytes] packed rows (quantised groups only)."""
        return self.packed_codec.encode(values)

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 [N, row_bytes] -> [N, dim] in compute_dtype (quantised groups only)."""
        return self.packed_codec.decode(packed, self.compute_dtype)

    def _planes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [blocks, block_size, value_bytes] and [blocks, block_size, scale_bytes] of one layer."""
        lay = self.packed_codec.layout
        bs = lay.block_size
        blocks = self.layer(layer).view(-1, bs * lay.row_bytes)
        values = blocks[:, : bs * lay.value_bytes].unflatten(1, (bs, lay.value_bytes))
        scales = blocks[:, bs * lay.value_bytes :].unflatten(1, (bs, lay.scale_bytes))
        return values, scales

    def read_packed(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Packed rows (geometry.read_rows of the layer's blocks) -> uint8 [N, row_bytes]."""
        rows = rows.reshape(-1)
        values, scales = self._planes(layer)
        bs = self.packed_codec.layout.block_size
        blk, pos = rows // bs, rows % bs
        return torch.cat([values[blk, pos], scales[blk, pos]], dim=1)

    def write_packed(self, layer: int, rows: torch.Tensor, packed: torch.Tensor) -> None:
        """geometry.write_rows into the layer's blocks: only each row's value and scale bytes change."""
        rows = rows.reshape(-1)
        values, scales = self._planes(layer)
        lay = self.packed_codec.layout
        blk, pos = rows // lay.block_size, rows % lay.block_size
        values[blk, pos] = packed[:, : lay.value_bytes]
        scales[blk, pos] = packed[:, lay.value_bytes :]

    # ---- what the model calls --------------------------------------------------------------------
    def read(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """rows: int [...] -> [..., dim] (exact: the stored dtype; quantised: compute_dtype).

        Quantised groups decode each distinct row once (queries of a step share most of their rows).
        """
        if self.codec is None:
            return self.layer(layer)[rows]
        flat = rows.reshape(-1)
        ids, inverse = torch.unique(flat, return_inverse=True)
        return self.decode(self.read_packed(layer, ids))[inverse].view(*rows.shape, self.codec.dim)

    def write(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """layer rows[i] = values[i] (values [N, dim]; rows distinct)."""
        if self.codec is None:
            self.layer(layer).index_copy_(0, rows, values.to(self.spec.dtype))
        else:
            self.write_packed(layer, rows, self.encode(values))


@dataclass(frozen=True)
class CacheLayer:
    """One model layer of a cache group: what SourceRows.gather / RingWrite.apply and the attention take."""

    group: CacheGroup
    layer: int

    @property
    def quantised(self) -> bool:
        return self.group.quantised

    @property
    def num_rows(self) -> int:
        return self.group.num_rows

    @property
    def tensor(self) -> torch.Tensor:
        return self.group.layer(self.layer)

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        return self.group.read(self.layer, rows)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.group.write(self.layer, rows, values)

    def write_packed(self, rows: torch.Tensor, packed: torch.Tensor) -> None:
        self.group.write_packed(self.layer, rows, packed)


PageTable = dict  # group name -> list[int] page ids, owned by one request


class CachePool:
    def __init__(self, cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device | str):
        self.cfg = cfg
        self.cache_config = cache
        self.groups = {s.name: CacheGroup(s, device, dtype) for s in group_specs(cfg, cache, dtype)}
        # Allocated first, so it is page 0; held for the pool's lifetime.
        self.scratch_pages = {n: g.allocator.allocate(SCRATCH_PAGES)[0] for n, g in self.groups.items()}
        # The prefix cache (engine.execution.prefix_cache) when one is attached: `reclaim(need)` evicts unreferenced
        # cached blocks until every group of `need` has that many free pages. Pages only the cache holds
        # count as free everywhere below (admission, load figures, idle counts).
        self.reclaimer: Reclaimer | None = None
        self._deferring = False  # see defer_frees
        self._deferred: list[PageTable] = []

    def extra_pages(self, table: PageTable, num_tokens: int) -> dict[str, int]:
        """Pages each group must add so `table` covers positions [0, num_tokens)."""
        need = {}
        for name, group in self.groups.items():
            have = len(table.get(name, ()))
            want = group.spec.pages_for_tokens(num_tokens)
            if want > have:
                need[name] = want - have
        return need

    def available(self, name: str) -> int:
        """Pages of group `name` a request can get: free, plus those only the prefix cache holds."""
        alloc = self.groups[name].allocator
        return alloc.num_free + alloc.num_evictable

    def can_grow(self, table: PageTable, num_tokens: int) -> bool:
        return all(self.available(n) >= k for n, k in self.extra_pages(table, num_tokens).items())

    def grow(self, table: PageTable, num_tokens: int) -> None:
        """Extend `table` in place to cover num_tokens; all groups or none (raises OutOfPages).
        Evicts unreferenced prefix-cache blocks (LRU) when the free lists alone are short."""
        need = self.extra_pages(table, num_tokens)
        if not all(self.available(n) >= k for n, k in need.items()):
            raise OutOfPages(f"cannot grow caches to {num_tokens} tokens: need {need}")
        if self.reclaimer is not None and not all(self.groups[n].allocator.can_allocate(k) for n, k in need.items()):
            self.reclaimer.reclaim(need)
        for name, k in need.items():
            table.setdefault(name, []).extend(self.groups[name].allocator.allocate(k))

    def free(self, table: PageTable) -> None:
        """Give `table`'s pages back (emptying it); held back while `defer_frees` is on."""
        if self._deferring:
            self._deferred.append({name: list(pages) for name, pages in table.items()})
        else:
            for name, pages in table.items():
                self.groups[name].allocator.free(pages)
        table.clear()

    def defer_frees(self) -> None:
        """Hold pages freed from now on out of the pool: a queued GPU step may still write them
        (engine.execution.decode_overlap); `release_deferred_frees` gives them back once it has completed."""
        self._deferring = True

    @property
    def has_deferred_frees(self) -> bool:
        return bool(self._deferred)

    def release_deferred_frees(self) -> None:
        self._deferring = False
        pending, self._deferred = self._deferred, []
        for table in pending:
            self.free(table)

    def free_tokens(self) -> int:
        """Tokens of new reservation the pool can still take: the tightest growing group, and zero when a
        per-request group (SWA ring, compressor state) has no page left."""
        free = []
        for g in self.groups.values():
            spec, n = g.spec, self.available(g.spec.name)
            if spec.fixed:
                if n == 0:
                    return 0
            else:
                free.append(n * spec.page_rows * spec.tokens_per_row)
        return min(free) if free else 0

    def usage(self) -> dict[str, float]:
        """Fraction of the requests' pages in use per group (the scratch page is not counted)."""
        return {
            n: (g.spec.num_pages - self.available(n) - SCRATCH_PAGES) / g.usable_pages for n, g in self.groups.items()
        }

    def idle_free_pages(self) -> dict[str, int]:
        """num_free_pages() of a pool that holds no request."""
        return {n: g.usable_pages for n, g in self.groups.items()}

    def num_free_pages(self) -> dict[str, int]:
        """Free pages per group, counting those only the prefix cache holds (evictable on demand)."""
        return {n: self.available(n) for n in self.groups}
