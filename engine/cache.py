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
Byte layouts of the production (quantised) formats live in `kernels.geometry`; this pool holds the
exact-dtype variant the reference engine computes with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.allocator import OutOfPages, PageAllocator
from engine.config import ModelConfig


@dataclass(frozen=True)
class CacheGroupSpec:
    name: str
    layers: tuple[int, ...]  # model layer ids stored in this group, in order
    page_rows: int  # rows per page
    width: int  # elements per row
    dtype: torch.dtype
    tokens_per_row: int  # 0 for fixed (one page per request) groups, else the compress ratio
    num_pages: int

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

    @property
    def bytes_per_page(self) -> int:
        return len(self.layers) * self.page_rows * self.width * torch.finfo(self.dtype).bits // 8


@dataclass(frozen=True)
class CacheConfig:
    max_requests: int = 64  # concurrent requests holding caches (fixed groups are sized by it)
    max_tokens: int = 1 << 16  # total cached tokens across requests (growing groups are sized by it)
    page_tokens: int = 256  # tokens covered by one page of a growing group


def group_specs(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> list[CacheGroupSpec]:
    all_layers = tuple(range(cfg.num_layers))
    specs = [CacheGroupSpec("swa", all_layers, cfg.sliding_window, cfg.head_dim, dtype, 0, cache.max_requests)]
    for r in cfg.ratios:
        layers = cfg.layers_with_ratio(r)
        rows = max(1, cache.page_tokens // r)
        pages = math.ceil(cache.max_tokens / r / rows) + cache.max_requests  # + one partial page per request
        specs.append(CacheGroupSpec(f"kv{r}", layers, rows, cfg.head_dim, dtype, r, pages))
        coff = 2 if r == 4 else 1
        specs.append(CacheGroupSpec(f"state{r}", layers, coff * r, 2 * coff * cfg.head_dim, torch.float32, 0,
                                    cache.max_requests))
    if cfg.indexer_layers:
        layers = cfg.indexer_layers
        rows = max(1, cache.page_tokens // 4)
        pages = math.ceil(cache.max_tokens / 4 / rows) + cache.max_requests
        specs.append(CacheGroupSpec("index", layers, rows, cfg.index_head_dim, dtype, 4, pages))
        specs.append(CacheGroupSpec("index_state", layers, 8, 4 * cfg.index_head_dim, torch.float32, 0,
                                    cache.max_requests))
    return specs


class CacheGroup:
    def __init__(self, spec: CacheGroupSpec, device: torch.device | str):
        self.spec = spec
        self.allocator = PageAllocator(spec.num_pages, spec.name)
        self.tensor = torch.zeros(len(spec.layers), spec.num_pages * spec.page_rows, spec.width,
                                  dtype=spec.dtype, device=device)

    def layer(self, layer: int) -> torch.Tensor:
        """[num_pages * page_rows, width] view of one model layer."""
        return self.tensor[self.spec.layer_slot(layer)]


PageTable = dict  # group name -> list[int] page ids, owned by one request


class CachePool:
    def __init__(self, cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device | str):
        self.cfg = cfg
        self.cache_config = cache
        self.groups = {s.name: CacheGroup(s, device) for s in group_specs(cfg, cache, dtype)}

    def extra_pages(self, table: PageTable, num_tokens: int) -> dict[str, int]:
        """Pages each group must add so `table` covers positions [0, num_tokens)."""
        need = {}
        for name, group in self.groups.items():
            have = len(table.get(name, ()))
            want = group.spec.pages_for_tokens(num_tokens)
            if want > have:
                need[name] = want - have
        return need

    def can_grow(self, table: PageTable, num_tokens: int) -> bool:
        return all(self.groups[n].allocator.can_allocate(k) for n, k in self.extra_pages(table, num_tokens).items())

    def grow(self, table: PageTable, num_tokens: int) -> None:
        """Extend `table` in place to cover num_tokens; all groups or none (raises OutOfPages)."""
        need = self.extra_pages(table, num_tokens)
        if not all(self.groups[n].allocator.can_allocate(k) for n, k in need.items()):
            raise OutOfPages(f"cannot grow caches to {num_tokens} tokens: need {need}")
        for name, k in need.items():
            table.setdefault(name, []).extend(self.groups[name].allocator.allocate(k))

    def free(self, table: PageTable) -> None:
        for name, pages in table.items():
            self.groups[name].allocator.free(pages)
        table.clear()

    def usage(self) -> dict[str, float]:
        """Fraction of pages in use per group."""
        return {n: g.allocator.num_used / g.spec.num_pages for n, g in self.groups.items()}

    def num_free_pages(self) -> dict[str, int]:
        return {n: g.allocator.num_free for n, g in self.groups.items()}
