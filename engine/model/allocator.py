"""Pure-Python page allocator with reference counts.

One allocator per cache group. A page is an integer id into the group's flat page tensor. Reference
counts let several requests share a page (prefix caching, or a prefill worker holding pages until the
decode side confirms a transfer); a page returns to the free list when its count drops to zero.

The prefix cache (engine.execution.prefix_cache) holds its pages through `hold_cached` / `release_cached`: such a
page is *evictable* while the cache's reference is its only one (`num_evictable`), so admission and the
load figures can count it as free: evicting every cached block would return exactly those pages.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Raised when a group cannot satisfy an allocation; the caller keeps the request waiting."""


class PageAllocator:
    def __init__(self, num_pages: int, name: str = "pages"):
        if num_pages < 1:
            raise ValueError(f"{name}: num_pages must be >= 1, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps small runs in low memory.
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._cached = bytearray(num_pages)  # 1 where the prefix cache holds one of the references
        self._evictable = 0  # cached pages whose only reference is the cache's

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_evictable(self) -> int:
        """Pages only the prefix cache references: free once it evicts them."""
        return self._evictable

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free pages (refcount 1 each); all or nothing."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"{self.name}: need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"{self.name}: incref of free page {p}")
            if self._cached[p] and self._refs[p] == 1:
                self._evictable -= 1
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero go back to the free list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"{self.name}: double free of page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
            elif self._refs[p] == 1 and self._cached[p]:
                self._evictable += 1

    def hold_cached(self, pages: list[int]) -> None:
        """The prefix cache takes a reference on pages a request filled (at most one cache reference a page)."""
        for p in pages:
            if self._cached[p]:
                raise ValueError(f"{self.name}: page {p} is already held by the prefix cache")
            self.incref([p])
            self._cached[p] = 1

    def release_cached(self, pages: list[int]) -> None:
        """The prefix cache drops its reference (eviction); a page nobody else holds becomes free."""
        for p in pages:
            if not self._cached[p]:
                raise ValueError(f"{self.name}: page {p} is not held by the prefix cache")
            if self._refs[p] == 1:
                self._evictable -= 1
            self._cached[p] = 0
            self.free([p])

    def is_cached(self, page: int) -> bool:
        return bool(self._cached[page])

    def refcount(self, page: int) -> int:
        return self._refs[page]
