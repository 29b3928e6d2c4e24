"""`python -m benchmarks.kv_pull` at a tiny size: two real processes, real NIXL on host memory. Every pull is one
descriptor against a page plan of several, its bytes match the source's, streaming moves chunks before the final
pull and the final pull less than the whole, and the section renders those numbers."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.kv_pull import run
from benchmarks.kv_pull_report import section
from tests.support.backends import needs_nixl


@needs_nixl
@pytest.mark.nixl
def test_kv_pull_bench_tiny(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    args = argparse.Namespace(device="cpu", tokens=[256, 1024], layers=4, pulls=2, raw_iters=2, chunk_tokens=256)
    result = run(args)
    small, large = result["sizes"]
    for s in (small, large):
        assert s["bytes_match"] and s["descriptors"] == 1 < s["page_plan_descriptors"]
        assert s["raw_ms"] > 0 and s["whole_ms"] > 0
    assert large["bytes"] > small["bytes"]
    assert small["streamed"]["chunks"] == 0 and small["streamed"]["final_bytes"] == small["bytes"]
    streamed = large["streamed"]
    assert streamed["chunks"] >= 3  # kv4 / index pages fill every 256 positions
    assert streamed["chunk_bytes"] + streamed["final_bytes"] == large["bytes"]
    assert 0 < streamed["final_bytes"] < large["bytes"]
    text = section(result)
    assert "| 1024 | " in text and f"{large['bytes'] / 1e6:.2f}" in text and "two-GPU run" in text
