"""Staging buffer for one-descriptor KV pulls: a byte-range sub-allocator and the batched gather / scatter.

Why: a NIXL READ costs ~7-8 us per descriptor on top of its bytes (H200, cuda_ipc: 64 MiB in 1 descriptor at
1322 GB/s, in 256 at 23 GB/s), and a request's pages are one descriptor per layer per group per page run. The
source packs a request's pages into one contiguous range of a staging buffer registered once (one index_select
per group), the destination READs that range whole into its own staging range and scatters it into its pages
(one index_copy_ per group). Byte layout: kv_transfer.plan.staged_layout.

`ByteArena` hands out aligned byte ranges of the buffer, first fit over a sorted free list, neighbours merged
on free; a lock makes it safe from the worker threads the backend is called on. `StagingBuffer` owns the tensor
and the arena and does the copies; on CUDA it waits for its own copies before returning (the source's bytes
must be in place before the ticket leaves; the destination's range is reused once freed).
Streams: the gather runs on the caller's stream (the source engine's thread, after the step that wrote the pages).
The scatter runs on a stream of its own, created non-blocking: on the engine's stream its host-to-device index
copy (pageable memory: CUDA syncs the stream first) and its wait would sit behind every step the decode engine
has queued, though nothing queued touches the pages being filled (they were just reserved, and the engine uses
them only after the pull returns).
"""

from __future__ import annotations

import bisect
import threading
from contextlib import nullcontext

import torch

from engine.cache import CachePool
from kv_transfer.plan import STAGING_ALIGN, StagedLayout, align_up


class ByteArena:
    """First-fit allocator of byte ranges [offset, offset + n) inside [0, capacity); thread-safe."""

    def __init__(self, capacity: int, align: int = STAGING_ALIGN):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"staging capacity must be a non-negative int of bytes, got {capacity!r}")
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
            raise ValueError(f"staging alignment must be a positive int, got {align!r}")
        self.align = align
        self.capacity = capacity - capacity % align  # a tail shorter than one alignment unit is never handed out
        self._free_starts: list[int] = [0] if self.capacity else []  # sorted; _free_len[start] = its length
        self._free_len: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._used: dict[int, int] = {}  # offset -> rounded length
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._free_len.values())

    @property
    def largest_free(self) -> int:
        with self._lock:
            return max(self._free_len.values(), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new range of `nbytes` (rounded up to the alignment), or None when no free run is long
        enough. Raises ValueError for a size that is not a positive int."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"staging range size must be a positive int of bytes, got {nbytes!r}")
        n = align_up(nbytes, self.align)
        with self._lock:
            for i, start in enumerate(self._free_starts):  # first fit, lowest offset
                length = self._free_len[start]
                if length < n:
                    continue
                del self._free_len[start]
                if length == n:
                    self._free_starts.pop(i)
                else:
                    self._free_starts[i] = start + n
                    self._free_len[start + n] = length - n
                self._used[start] = n
                return start
        return None

    def free(self, offset: int) -> None:
        """Give back the range that alloc returned at `offset`; ValueError if no such range is held."""
        with self._lock:
            n = self._used.pop(offset, None)
            if n is None:
                raise ValueError(f"staging offset {offset!r} is not an allocated range")
            i = bisect.bisect_left(self._free_starts, offset)
            start, length = offset, n
            if i < len(self._free_starts) and self._free_starts[i] == offset + n:  # merge with the next run
                length += self._free_len.pop(self._free_starts.pop(i))
            if i > 0 and self._free_starts[i - 1] + self._free_len[self._free_starts[i - 1]] == offset:
                start = self._free_starts[i - 1]  # merge into the previous run
                length += self._free_len[start]
                self._free_len[start] = length
            else:
                self._free_starts.insert(i, start)
                self._free_len[start] = length

    def allocated(self) -> dict[int, int]:
        """offset -> length of every held range (for checks and tests)."""
        with self._lock:
            return dict(self._used)


def _word_dtype(page_bytes: int) -> torch.dtype:
    """The widest integer element that tiles a page exactly: fewer, wider elements per copy."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if page_bytes % size == 0:
            return dtype
    return torch.uint8


class StagingBuffer:
    """A contiguous byte buffer on the pool's device, an arena over it, and the pool's pages as byte views."""

    def __init__(self, pool: CachePool, nbytes: int):
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"staging_bytes must be a positive int, got {nbytes!r}")
        device = next(iter(pool.groups.values())).tensor.device
        self.arena = ByteArena(nbytes)
        if not self.arena.capacity:
            raise ValueError(f"staging_bytes {nbytes!r} is below one alignment unit ({self.arena.align} bytes)")
        self.tensor = torch.empty(self.arena.capacity, dtype=torch.uint8, device=device)
        self.device = device
        self._scatter_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # (module docstring)
        # [layers, num_pages, page_bytes] views of every group tensor, made once
        self._pages = {n: g.tensor.view(-1).view(torch.uint8).view(len(g.spec.layers), g.spec.num_pages, -1)
                       for n, g in pool.groups.items()}

    def _views(self, offset: int, layout: StagedLayout, side: int):
        """Per group: (pool pages view, staged view, page ids) in one word dtype; one host->device index copy."""
        ids = [p[side] for g in layout.groups for p in g.pages]
        index = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        out, k = [], 0
        for g in layout.groups:
            word = _word_dtype(g.page_bytes)
            pages = self._pages[g.name].view(word)
            lo = offset + g.offset
            staged = self.tensor[lo:lo + g.nbytes].view(word).view(g.layers, len(g.pages), -1)
            out.append((pages, staged, index[k:k + len(g.pages)]))
            k += len(g.pages)
        return out

    def gather(self, offset: int, layout: StagedLayout) -> None:
        """Source side: copy the layout's src pages of every group into [offset, offset + layout.nbytes)."""
        for pages, staged, idx in self._views(offset, layout, side=0):
            torch.index_select(pages, 1, idx, out=staged)
        self._wait()

    def scatter(self, offset: int, layout: StagedLayout) -> None:
        """Destination side: copy [offset, offset + layout.nbytes) into the layout's dst pages of every group."""
        with torch.cuda.stream(self._scatter_stream) if self._scatter_stream is not None else nullcontext():
            for pages, staged, idx in self._views(offset, layout, side=1):
                pages.index_copy_(1, idx, staged)
            self._wait()

    def _wait(self) -> None:
        if self.device.type == "cuda":  # only the copies' stream (this thread's current one)
            torch.cuda.current_stream(self.device).synchronize()
