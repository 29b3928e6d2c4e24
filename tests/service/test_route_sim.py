"""service/route_sim.py: a request's cached prefix is looked up when its prefill starts (as the engine does at
admission), so a follow-up queued behind its first turn on the same worker resumes after it."""

from __future__ import annotations

import pytest

from service.route_sim import SimConfig, TraceRequest, simulate

BLOCK = 512


def session(gap_ms: float) -> list[TraceRequest]:
    """A first turn of 8 blocks, then its follow-up (the same 8 blocks + 1) `gap_ms` later."""
    first = TraceRequest(0.0, 8 * BLOCK, 1, tuple(range(8)))
    follow = TraceRequest(gap_ms, 9 * BLOCK, 1, tuple(range(9)))
    return [first, follow]


@pytest.mark.parametrize("workers", [1, 4])
def test_follow_up_queued_behind_its_first_turn_resumes_after_it(workers):
    cfg = SimConfig(workers=workers, capacity_blocks=64, block_tokens=BLOCK)
    first_ends = cfg.overhead_s + 8 * BLOCK / cfg.tokens_per_s
    gap_s = first_ends / 2  # the follow-up arrives while the first prefill runs: no digest shows its blocks
    res = simulate(session(gap_s * 1000.0), "cache_aware", cfg)
    # Its 8 blocks are served from cache (a hit leaves >= 1 token: 9 * 512 - 1 // 512 = 8), as in the pooled cache;
    # with 4 workers, cache_aware sent it behind its first turn (the router counts the unpublished blocks as cached).
    assert res["hit_rate"] == pytest.approx(8 / 17) and res["pooled_hit_rate"] == pytest.approx(8 / 17)
    assert res["behind_prefill"] == 1.0
    follow_ttft = first_ends - gap_s + cfg.overhead_s + BLOCK / cfg.tokens_per_s
    assert res["ttft_p99_s"] == pytest.approx(max(first_ends, follow_ttft))


def test_lookup_at_arrival_cannot_use_a_prefill_still_running():
    cfg = SimConfig(workers=1, capacity_blocks=64, block_tokens=BLOCK, lookup_at_start=False)
    gap_ms = 1.0  # the first prefill runs 0.21 s
    res = simulate(session(gap_ms), "cache_aware", cfg)
    assert res["hit_rate"] == 0.0 and res["pooled_hit_rate"] == pytest.approx(8 / 17)
    # Arriving after it ended, the follow-up hits in both models.
    later = simulate(session(1000.0), "cache_aware", cfg)
    assert later["hit_rate"] == pytest.approx(8 / 17) and later["behind_prefill"] == 0.0
