"""Pure-Python page allocator with reference counts.

One allocator per cache group. A page is an integer id into the group's flat page tensor. Reference
counts let several requests share a page (prefix caching, or a prefill worker holding pages until the
decode side confirms a transfer); a page returns to the free list when its count drops to zero.
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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

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
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero go back to the free list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"{self.name}: double free of page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]
