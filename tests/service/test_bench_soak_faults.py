"""`dsv4 bench soak` with the faults that are not a process exit, briefly, on a real service (1P2D, tcp): a
step that raises, a step that hangs, a stopped process and a kill, each on each pool (8 faults, 6 s apart: the run
ends one interval after the last), under mixed HTTP load. Nothing but clean outcomes (ok, refused bad input,
abandoned, 429 / 503), the pools idle with every page free at the end. A stop lasts 12 s (past the router's
probe bound of about 10 s), the pool's next fault comes two intervals later."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("ray")

from service.bench_soak import add_bench_soak_args, report_markdown, run_soak  # noqa: E402

pytestmark = pytest.mark.ray

CLEAN = {"ok", "abandoned", "http_400_expected", "http_429", "http_503", "inband_503"}


def test_soak_with_every_fault_kind_stays_clean():
    parser = argparse.ArgumentParser()
    add_bench_soak_args(parser)
    args = parser.parse_args(
        [
            "--minutes",
            "2",  # the limit: the run ends 6 s after the 8th fault
            "--clients",
            "4",
            "--fault-every",
            "6",
            "--fault-count",
            "8",
            "--faults",
            "raise,hang,stop,kill",
            "--decode-workers",
            "2",
            "--transfer",
            "tcp",
            "--stop-seconds",
            "12",
            "--stall-timeout-seconds",
            "3",
            "--max-batch-tokens",
            "64",
        ]
    )
    r = run_soak(args)
    print(report_markdown(r))
    pairs = {(kind, worker.split("-")[0]) for kind, worker in (f.split() for f in r["faults"])}
    assert pairs == {(k, pool) for k in ("raise", "hang", "stop", "kill") for pool in ("prefill", "decode")}, r
    assert set(r["outcomes"]) <= CLEAN, r["outcomes"]
    assert r["outcomes"].get("ok", 0) > 0 and r["idle_at_end"], r
    assert "worker faults (" in report_markdown(r)
