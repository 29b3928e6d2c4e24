"""The router's remembered prompt hashes (router/prompt_hashes.py) name blocks exactly as the engine's hasher does,
hash only what they have not seen, and stay bounded."""

from __future__ import annotations

import random

import pytest

from engine.execution.block_hash import block_hashes
from router.prompt_hashes import PromptHasher

SEED = b"hashseed"


def test_names_are_the_engines_for_prefixes_tails_and_limits():
    rng = random.Random(0)
    base = [rng.randrange(2, 129_000) for _ in range(700)]
    h = PromptHasher(16, SEED)
    prompts = [
        base[:5],  # no full block
        base[:16],
        base[:300],
        tuple(base[:300]),  # the router's prompts are tuples; the same names
        base[:300] + [1, 2, 3] * 20,  # a turn appended
        base[:150] + [9] * 200,  # diverges inside block 9
        base,
        base[16:],  # the same tokens one block later: other names (chained)
        base[:300],  # seen: all from memory
    ]
    for p in prompts:
        assert h.hashes(p) == block_hashes(p, 16, SEED), len(p)
        for limit in (0, 3, 18):
            assert h.hashes(p, limit=limit) == block_hashes(p, 16, SEED, limit=limit)
    assert PromptHasher(16, b"otherfmt").hashes(base) != h.hashes(base)


def test_a_sessions_next_turn_hashes_only_its_new_blocks():
    rng = random.Random(1)
    h = PromptHasher(32, SEED)
    turn = [rng.randrange(2, 129_000) for _ in range(32 * 40)]
    h.hashes(turn)
    assert h.hashed_blocks == 40
    for _ in range(3):
        turn = turn + [rng.randrange(2, 129_000) for _ in range(32 * 2 + 5)]  # two blocks and a partial one
        assert h.hashes(turn) == block_hashes(turn, 32, SEED)
        assert h.hashed_blocks == len(turn) // 32  # each block through blake2b once, in the turn that fills it
    h.hashes(turn)
    assert h.hashed_blocks == len(turn) // 32  # a repeat: nothing


def test_memory_is_bounded_and_old_names_are_recomputed_exactly():
    rng = random.Random(2)
    h = PromptHasher(4, SEED, capacity=10)
    prompts = [[rng.randrange(2, 1000) for _ in range(4 * 7)] for _ in range(12)]
    for p in prompts * 2:
        assert h.hashes(p) == block_hashes(p, 4, SEED)
        assert len(h) <= 20
    with pytest.raises(ValueError, match="capacity"):
        PromptHasher(4, SEED, capacity=0)
