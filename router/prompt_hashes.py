"""A prompt's chained block hashes for placement, remembered across requests that share a prefix.

The router names a prompt's blocks with the engine's hasher (`engine.execution.block_hash.block_hashes`:
blake2b over the int32 bytes of blocks 0..k), to look them up in the workers' digests. Done from scratch that
costs ~25 ns a token on a 2-core CPU (the int -> bytes conversion dominates), ~1 ms for a 40K-token prompt:
the whole placement budget twice over. But long prompts are mostly prefixes the router has hashed before
(the next turn of a session, an agent's next step, the same document asked again), so `PromptHasher` keeps
what each block hashed to, keyed by (its parent's hash, Python's hash of the block's token tuple): a block
seen before costs a slice and a tuple hash (~5 ns a token); only new blocks are run through blake2b, in one
call (`block_hashes` from the first new block, with its parent digest).

The names are the engine's: a remembered block's value is what `block_hashes` returned for it. The key is
not the block itself (comparing tokens costs as much as hashing them): a different block under the same
parent with the same 64-bit tuple hash would be named wrongly, which can only mis-place a request (the
engine checks its own blake2b names before it serves a cached page). tests/router/test_prompt_hashes.py
checks the names against `block_hashes`; tests/router/test_router_locality.py checks placement's predicted
hits against the engine's own cache with the names coming from memory.

Bounded: two generations of `capacity` entries each; a lookup that hits the old generation moves the entry
to the new one, and when the new one is full the old one is dropped (an LRU approximation at O(1) a block).
An entry takes ~170 bytes: at most ~22 MB at the default capacity (65536: 32M prompt tokens at 512-token
blocks, 8M at 128).
One `PromptHasher` per (block size, seed); not thread-safe (the router's event loop owns it).

The caller of the router's `Place` (the ingress) hashes prompts itself, so that placement only matches and scores:
`IngressHasher` names a prompt's blocks in the `HashScheme` the router's last answer named (the workers' digests'
block size and seed, or the router's own estimate's), with a `PromptHasher` of its own, and the request carries
them as `PromptHashes`. The router uses them when they are in the scheme it uses and cover the prompt's full
blocks; otherwise (an old client, the first request, a changed scheme) it hashes the prompt as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.execution.block_hash import block_hashes


@dataclass(frozen=True)
class HashScheme:
    """How prompt blocks are named: `block_hashes(tokens, block_tokens, seed)`."""

    block_tokens: int
    seed: bytes


@dataclass(frozen=True)
class PromptHashes:
    """A prompt's chained block hashes as its sender computed them: hashes[k] names blocks 0..k (k < full blocks)."""

    scheme: HashScheme
    hashes: tuple[int, ...]

    def covering(self, block: int, seed: bytes, n: int) -> Sequence[int] | None:
        """The first n hashes, if these are in scheme (block, seed) and there are that many; else None."""
        s = self.scheme
        if s.block_tokens != block or s.seed != seed or len(self.hashes) < n:
            return None
        return self.hashes if len(self.hashes) == n else self.hashes[:n]


class PromptHasher:
    def __init__(self, block: int, seed: bytes, capacity: int = 1 << 16):
        if block < 1 or capacity < 1:
            raise ValueError(f"block and capacity must be >= 1, got {block}, {capacity}")
        self.block = block
        self.seed = seed
        self.capacity = capacity
        self._new: dict[tuple[int, int], int] = {}
        self._old: dict[tuple[int, int], int] = {}
        self.hashed_blocks = 0  # blocks run through blake2b (the rest came from memory)

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def hashes(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """`block_hashes(tokens, block, seed, limit=limit)`, from memory where the prefix was seen before."""
        b = self.block
        n = len(tokens) // b if limit is None else min(len(tokens) // b, max(limit, 0))
        out: list[int] = []
        parent = -1  # block 0's parent: the seed (never a block's name: those are >= 0)
        new, old = self._new, self._old
        for k in range(n):
            blk = tokens[k * b : (k + 1) * b]
            key = (parent, hash(blk if type(blk) is tuple else tuple(blk)))
            h = new.get(key)
            if h is None:
                h = old.get(key)
                if h is None:
                    return out + self._hash_rest(tokens, k, n, parent)
                self._put(key, h)
            out.append(h)
            parent = h
        return out

    def _hash_rest(self, tokens: Sequence[int], start: int, n: int, parent: int) -> list[int]:
        """Blocks start..n-1 through the engine's hasher (one call), remembered for the next prompt."""
        prev = None if parent < 0 else parent.to_bytes(8, "little")
        rest = block_hashes(tokens, self.block, self.seed, start=start, parent=prev, limit=n - start)
        self.hashed_blocks += len(rest)
        b = self.block
        for k, h in enumerate(rest, start=start):
            blk = tokens[k * b : (k + 1) * b]
            self._put((parent, hash(blk if type(blk) is tuple else tuple(blk))), h)
            parent = h
        return rest

    def _put(self, key: tuple[int, int], h: int) -> None:
        if len(self._new) >= self.capacity:
            self._old, self._new = self._new, {}
        self._new[key] = h


class IngressHasher:
    """The router's caller's side: a prompt's `PromptHashes` in the scheme the router last named (None until a
    router has named one). Remembers prefixes like the router's own hasher (sessions hash only their new blocks)."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._hasher: PromptHasher | None = None

    @property
    def scheme(self) -> HashScheme | None:
        h = self._hasher
        return None if h is None else HashScheme(h.block, h.seed)

    def learn(self, scheme: HashScheme | None) -> None:
        """The scheme a router answered with (None or block 0: it named none; the last one stays)."""
        if scheme is None or scheme.block_tokens < 1 or scheme == self.scheme:
            return
        self._hasher = PromptHasher(scheme.block_tokens, scheme.seed, self.capacity)

    def hashes(self, prompt_ids: Sequence[int]) -> PromptHashes | None:
        h = self._hasher
        if h is None:
            return None
        return PromptHashes(HashScheme(h.block, h.seed), tuple(h.hashes(prompt_ids)))
