"""service.frontdoor_runs: repeated sweeps merged into medians (counts summed, every run's p99 kept), and the
p99 read between levels at exactly half the ceiling."""

from __future__ import annotations

import pytest

from service.frontdoor_report import LevelResult
from service.frontdoor_runs import merge_runs, p99_at


def _row(replicas, streams, tps, p99, lost=0, cpu=None, load=1.0):
    return LevelResult(
        replicas, streams, streams * 50.0, tps, requests=10, tokens=400, added_ms_p50=p99 / 3, added_ms_p99=p99,
        cpu_ms_per_1k=300.0, cpu_by_component=cpu or {"ingress": 1.0}, lost_tokens=lost, out_of_order=0, errors=0,
        load_avg=load,
    )  # fmt: skip


def test_one_run_is_returned_as_is():
    run = [_row(1, 8, 400, 3.0)]
    assert merge_runs([run]) is run


def test_runs_merge_into_medians_with_counts_summed():
    runs = [
        [_row(1, 8, 400, 3.0), _row(1, 16, 800, 9.0, cpu={"ingress": 2.0, "router": 1.0})],
        [_row(1, 8, 410, 5.0, lost=2), _row(1, 16, 790, 4.0, cpu={"ingress": 4.0})],
        [_row(1, 8, 390, 4.0), _row(1, 16, 810, 6.0, load=3.0, cpu={"ingress": 3.0, "router": 3.0})],
    ]
    a, b = merge_runs(runs)
    assert (a.replicas, a.streams, b.streams) == (1, 8, 16)
    assert a.delivered_tps == 400 and a.added_ms_p99 == 4.0 and a.p99_runs == (3.0, 5.0, 4.0)
    assert a.lost_tokens == 2 and a.requests == 30 and a.tokens == 1200  # one loss in any run shows
    assert b.added_ms_p99 == 6.0 and b.load_avg == 1.0 and b.added_ms_p50 == pytest.approx(2.0)
    assert b.cpu_by_component == {"ingress": 3.0, "router": 1.0}  # a run without a component counts it as 0


def test_p99_between_levels():
    rows = [_row(1, 8, 400, 2.0), _row(1, 32, 1600, 4.0), _row(1, 64, 3200, 12.0)]
    assert p99_at(rows, 2400) == pytest.approx(8.0)  # halfway between 1600 and 3200
    assert p99_at(rows, 1600) == 4.0 and p99_at(rows, 100) == 2.0 and p99_at(rows, 9000) == 12.0
