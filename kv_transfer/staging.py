"""Staging buffer for one-descriptor KV pulls: a byte-range sub-allocator and the batched gather / scatter.

Why: a NIXL READ costs ~7-8 us per descriptor on top of its bytes (H200, cuda_ipc: 64 MiB in 1 descriptor at
1322 GB/s, in 256 at 23 GB/s), and a request's pages are one descriptor per layer per group per page run. The
source packs a request's pages into one contiguous range of a staging buffer registered once (one copy per
group), the destination READs that range whole into its own staging range and scatters it into its pages (one
copy per group). A group whose pages on that side are one run of consecutive ids (every fixed group, and a
growing group allocated in one piece) is copied as a slice, without a page-id index (no upload on CUDA; on the
CPU 3-6x faster than index_select / index_copy_); any other is gathered with index_select and scattered with
index_copy_. Byte layout: kv_transfer.plan.staged_layout.

`ByteArena` hands out aligned byte ranges of the buffer, first fit over a sorted free list, neighbours merged
on free; a lock makes it safe from the worker threads the backend is called on. `StagingBuffer` owns the tensor
and the arena and does the copies.
Source side: the gather runs on the caller's stream (the source engine's thread, after the step that wrote the
pages) and is waited for: the bytes must be in place before the ticket leaves.
Destination side: the scatter is queued on the caller's current stream, the decode engine's own (its index from
pinned memory, so the host never waits), and the pulling thread does not wait for it. Stream order does the
rest: the scatter runs after the steps already queued (none of them touches the just-reserved pages) and before
the first step that reads them, which is launched after the pull returns. The staging range the scatter reads
is held (`release(offset, event)`) until the scatter's event has completed, then reused.
Why not wait: a thread that blocks on the device, then waits for the GIL behind the engine's loop, spends
milliseconds of a pull on microseconds of copies.
Why not on the pulling thread either (`DeferredScatter`, what the decode worker uses): even only queued, the
scatter costs milliseconds there. Nothing in it waits for the device in the steady state; it is ~30 Python calls into torch (per group: views and an index_copy_ launch; the index's pin and upload, the
event), and every one of them releases the GIL and must take it back, on a thread that competes with the engine
loop and the actor's event loop. A thread waiting for the GIL asks the holder to drop it only after a whole
switch interval (5 ms) without a hand-over, and a holder that lets it go around its own short torch calls takes
it back first again and again; so each call can cost milliseconds there, several times what the same scatter
costs queued on the engine thread (BENCHMARKS.md, "Staged KV scatter on the decode side"). The decode worker therefore takes the scatter from the
pull (`TransferBackend.pull_deferred`) and queues it on the engine thread itself, in the call that joins the
request to the batch: same stream, same order (before the first step that reads the pages), no GIL hand-offs.
`scatter(..., timings=)` reports its parts (index upload, views, copies, event, thread CPU time).
"""

from __future__ import annotations

import bisect
import itertools
import struct
import threading
import time

import torch

from engine.model.batch import to_device_nonblocking
from engine.model.cache import CachePool
from kv_transfer.plan import STAGING_ALIGN, StagedLayout, align_up, page_bytes


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
        self._held: list[tuple[int, torch.cuda.Event]] = []  # (offset, its scatter's event): freed once done
        self._held_lock = threading.Lock()
        # [layers, num_pages, page_bytes] views of every group tensor, made once
        self._pages = {
            n: g.tensor.view(-1).view(torch.uint8).view(len(g.spec.layers), g.spec.num_pages, -1)
            for n, g in pool.groups.items()
        }
        # per group, made once: its pages and the whole buffer as words of the group's word dtype (capacity is a
        # multiple of the alignment, so every word size divides it), and the word's size; a request's views are
        # then one strided view (and one slice of pages) a group
        words = {dtype: self.tensor.view(dtype) for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8)}
        self._words: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        for n, g in pool.groups.items():
            word = _word_dtype(page_bytes(g.spec))
            self._words[n] = (self._pages[n].view(word), words[word], words[word].element_size())

    def _index(self, layout: StagedLayout, side: int) -> torch.Tensor | None:
        """The page ids of one side of every group that is not one run of consecutive pages, in layout order, on
        the device: one host->device copy (pinned on CUDA: the host does not wait for the stream); None when
        every group is a run (its copy is a slice)."""
        ids = [g.sides[side] for g in layout.groups if g.runs[side] is None]
        if not ids:
            return None
        # packed in C from the id tuples: 3 groups of 128 ids in ~2 us (array.extend from a tuple took ~11 us)
        packed = bytearray(struct.pack(f"{sum(map(len, ids))}q", *itertools.chain.from_iterable(ids)))
        return to_device_nonblocking(torch.frombuffer(packed, dtype=torch.int64), self.device)

    def _group_views(self, offset: int, layout: StagedLayout, index: torch.Tensor | None, side: int):
        """Per group: (the pool's pages of this side: a slice of the page view when they are one run, else the
        page view; the staged view; the page ids, None for a run), in the group's word dtype."""
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        k, word_views = 0, self._words
        for g in layout.groups:
            pages, words, size = word_views[g.name]
            n, row = len(g.sides[0]), g.page_bytes // size
            # [layers, n, row] words at the group's place (offsets are STAGING_ALIGN-aligned: whole words)
            staged = words.as_strided((g.layers, n, row), (n * row, row, 1), (offset + g.offset) // size)
            start = g.runs[side]
            if start is not None:
                out.append((pages[:, start : start + n], staged, None))
            else:
                assert index is not None  # _index made ids for every group that is not a run
                out.append((pages, staged, index[k : k + n]))
                k += n
        return out

    def _views(self, offset: int, layout: StagedLayout, side: int):
        """Per group: (pool pages view, staged view, page ids or None); at most one host->device index copy."""
        return self._group_views(offset, layout, self._index(layout, side), side)

    # ---- ranges --------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int | None:
        """A range of `nbytes` (ByteArena.alloc), reclaiming the ranges whose scatter has finished first; when
        none is free but some are held by a scatter still queued, waits for those before giving up (a pull by
        page descriptors is far slower than a queued copy)."""
        self.reclaim()
        offset = self.arena.alloc(nbytes)
        if offset is None and self._held:
            self.reclaim(wait=True)
            offset = self.arena.alloc(nbytes)
        return offset

    def release(self, offset: int, event: torch.cuda.Event | None = None) -> None:
        """Give the range back: now, or once `event` (the scatter that reads it) has completed."""
        if event is None:
            self.arena.free(offset)
            return
        with self._held_lock:
            self._held.append((offset, event))

    def reclaim(self, wait: bool = False) -> int:
        """Free the held ranges whose scatter has run (all of them, after waiting, with wait=True) -> how many."""
        with self._held_lock:  # one query per event: one that completes meanwhile stays held until the next look
            ran = [wait or e.query() for _, e in self._held]
            done = [h for h, r in zip(self._held, ran) if r]
            self._held = [h for h, r in zip(self._held, ran) if not r]
        for offset, event in done:
            event.synchronize()
            self.arena.free(offset)
        return len(done)

    # ---- copies --------------------------------------------------------------------------------------
    def gather(self, offset: int, layout: StagedLayout, wait: bool = True) -> None:
        """Source side: copy the layout's src pages of every group into [offset, offset + layout.nbytes), and
        wait for the copies (the bytes must be in place before the ticket leaves); wait=False only queues them on
        the current stream (the caller holds the ticket until an event recorded after them has completed)."""
        for pages, staged, idx in self._views(offset, layout, side=0):
            if idx is None:  # one run of pages: a slice copy (no index; 3-6x faster than index_select on the CPU)
                staged.copy_(pages)
            else:
                torch.index_select(pages, 1, idx, out=staged)
        if wait and self.device.type == "cuda":  # only the copies' stream (this thread's current one)
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(self, offset: int, layout: StagedLayout, timings: dict | None = None) -> torch.cuda.Event | None:
        """Destination side: queue the copy of [offset, offset + layout.nbytes) into the layout's dst pages of
        every group on the current stream -> the event that marks its end on CUDA (pass it to `release`), None
        on the CPU (done on return).

        timings: a dict to add this scatter's seconds to (wall clock unless named cpu): "index" (the page ids'
        host tensor and its upload), "views" (per-group views), "copies" (the index_copy_ launches), "record"
        (its event), "cpu" (this thread's CPU time over all of it: far below the sum of the others means the
        thread waited off the CPU, e.g. for the GIL)."""
        clock = time.perf_counter
        c0, t0 = time.thread_time(), clock()
        index = self._index(layout, side=1)
        t1 = clock()
        views = self._group_views(offset, layout, index, side=1)
        t2 = clock()
        for pages, staged, idx in views:
            if idx is None:
                pages.copy_(staged)
            else:
                pages.index_copy_(1, idx, staged)
        t3 = clock()
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        if timings is not None:
            t4 = clock()
            for key, seconds in (
                ("index", t1 - t0),
                ("views", t2 - t1),
                ("copies", t3 - t2),
                ("record", t4 - t3),
                ("cpu", time.thread_time() - c0),
            ):
                timings[key] = timings.get(key, 0.0) + seconds
        return event


class DeferredScatter:
    """A staged pull's scatter, not yet queued: the pulled bytes wait in their staging range (held) until the
    destination engine's own thread queues the scatter on its stream (`run`), before the first step that
    reads the pages, or the request is dropped (`cancel`, which frees the range). Exactly one of the two takes
    effect (thread-safe): `run` after `cancel` raises, `cancel` after `run` does nothing."""

    def __init__(self, buffer: StagingBuffer, offset: int, layout: StagedLayout, request_id: str = "?"):
        self.buffer, self.offset, self.layout, self.request_id = buffer, offset, layout, request_id
        self.state = "pending"  # -> "queued" (run) or "cancelled"
        self._lock = threading.Lock()

    def run(self) -> dict:
        """Queue the scatter on this thread's current stream and hold the range until it has run -> its timings
        (StagingBuffer.scatter's keys, plus "seconds": the whole call). RuntimeError once cancelled."""
        with self._lock:
            if self.state != "pending":
                raise RuntimeError(f"the staged scatter of request {self.request_id!r} was {self.state}")
            self.state = "queued"
        timings: dict = {}
        t0 = time.perf_counter()
        event = None
        try:
            event = self.buffer.scatter(self.offset, self.layout, timings)
        finally:
            self.buffer.release(self.offset, event)  # held until the queued scatter has read it
        timings["seconds"] = time.perf_counter() - t0
        return timings

    def cancel(self) -> bool:
        """Drop the scatter and free its range -> whether it was still pending (False: already run or
        cancelled)."""
        with self._lock:
            if self.state != "pending":
                return False
            self.state = "cancelled"
        self.buffer.release(self.offset)
        return True
