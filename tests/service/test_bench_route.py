"""`dsv4 bench route` / `make-trace`: the Mooncake reader, the CLI's JSON shape, and what the policies do on a
small shared-prefix trace (the router's real policy code over modelled caches)."""

from __future__ import annotations

import json

import pytest

from service import route_traces
from service.cli import main

FIELDS = {"hit_rate", "pooled_hit_rate", "load_imbalance", "ttft_p50_s", "ttft_p99_s", "decision_us_p99"}


def test_make_trace_and_route_json(tmp_path, capsys):
    path = tmp_path / "sp.jsonl"
    assert main(["bench", "make-trace", "--kind", "system_prompts", "--size", "8", "--out", str(path)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 8 * 16 and all(
        set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows
    )
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "route",
                "--trace",
                str(path),
                "--workers",
                "4",
                "--capacity-blocks",
                "64",
                "--policies",
                "round_robin,cache_aware",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert (
        out["workers"] == 4 and out["capacity_blocks"] == 64 and set(out["policies"]) == {"round_robin", "cache_aware"}
    )
    for r in out["policies"].values():
        assert FIELDS <= set(r) and 0.0 <= r["hit_rate"] <= r["pooled_hit_rate"] + 1e-9 <= 1.0 + 1e-9
    # 8 system prompts over 4 workers: following the real caches beats spraying them
    assert out["policies"]["cache_aware"]["hit_rate"] > out["policies"]["round_robin"]["hit_rate"]


def test_reader_names_the_bad_line_and_pads_short_hash_lists(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        route_traces.read(bad)
    short = tmp_path / "short.jsonl"
    short.write_text('{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [7]}\n')
    (req,) = route_traces.read(short)
    assert len(req.hash_ids) == 3 and req.hash_ids[0] == 7 and len(set(req.hash_ids)) == 3


def test_unknown_policy_is_a_clear_error(tmp_path, capsys):
    path = route_traces.write(route_traces.make("agentic", size=2), tmp_path / "a.jsonl")
    assert main(["bench", "route", "--trace", str(path), "--policies", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("kind,size", [("long_sessions", 30), ("bursty", 30), ("heavy_tail", 400)])
def test_real_traffic_trace_kinds(kind, size):
    """The kinds that stress what real conversations do: seeded, time-ordered, and sessions whose later prompts
    share a prefix of two or more blocks (the prefix a router must keep on one worker)."""
    rows = route_traces.make(kind, size=size)
    assert rows == route_traces.make(kind, size=size)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    heads = [tuple(r["hash_ids"][:2]) for r in rows if len(r["hash_ids"]) >= 3]
    assert sum(heads.count(h) > 1 for h in heads) > len(rows) // 6
    assert all(0 < r["input_length"] <= 512 * len(r["hash_ids"]) for r in rows)
