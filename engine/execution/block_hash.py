"""Chained block hashes of token ids: how the prefix cache names its blocks and how the router names a
prompt's blocks, to look them up in a worker's digest or (without digests) in its own estimate. Pure Python
(the router imports it without torch)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def block_hashes(
    tokens: Sequence[int],
    block: int,
    seed: bytes,
    start: int = 0,
    parent: bytes | None = None,
    limit: int | None = None,
) -> list[int]:
    """Chained 64-bit hashes of the full `block`-token blocks of `tokens`, from block `start` (whose parent
    digest is `parent`; None = the seed). limit: at most this many blocks. Block k's hash covers the seed and
    blocks 0..k, so equal hashes mean equal prefixes (a partial tail block is not hashed)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    out: list[int] = []
    prev = parent if parent is not None else seed
    n = len(tokens) // block
    if limit is not None:
        n = min(n, start + limit)
    if n <= start:
        return out
    # One conversion of the whole span to int32 bytes (token ids are int32 on the wire; struct is the fastest
    # from a list), then one blake2b per block over a view of it.
    span = tokens[start * block : n * block]
    data = memoryview(struct.pack(f"<{len(span)}i", *span))
    step = 4 * block
    for k in range(n - start):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update(data[k * step : (k + 1) * step])
        prev = h.digest()
        out.append(int.from_bytes(prev, "little"))
    return out
