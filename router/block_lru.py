"""BlockLRU: the block hashes recently routed to one worker (the router's own estimate of its cache)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockLRU:
    """The block hashes recently routed to one worker, at most `capacity`, least recently routed evicted."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading `hashes` present (a read: does not refresh recency)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        # Touch the chain tail-first so block 0 ends most recent: eviction then trims a prefix from its
        # end, and a surviving block 0..k run still matches (evicting block 0 first would orphan them all).
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
