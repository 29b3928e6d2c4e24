"""`dsv4 bench slice`'s prefill options (benchmarks/slice): --prefill-chunk / --prefill-runs / --prefill-only and
--experts fp8 reach the plan, and the report names each chunk's time as the prompt grows and the peak memory. The
GPU run itself is not part of CI (`python -m benchmarks.slice --experts mxfp4 fp8 --prefill-only --prefill-runs 3`)."""

from __future__ import annotations

from benchmarks.slice.cli import parse_args
from benchmarks.slice.report import _chunk_text
from benchmarks.slice.suite import make_plan, prefill_line


def test_prefill_flags_reach_the_plan():
    plan = make_plan(
        parse_args(
            [
                "--experts",
                "mxfp4",
                "fp8",
                "--prefill-tokens",
                "131072",
                "--prefill-chunk",
                "8192",
                "--prefill-runs",
                "3",
                "--prefill-only",
            ]
        )
    )
    assert plan.experts == ("mxfp4", "fp8") and plan.prefill_tokens == 131072
    assert plan.prefill_chunk == 8192 and plan.prefill_runs == 3 and plan.prefill_only
    default = make_plan(parse_args([]))
    assert default.experts == ("mxfp4", "bf16") and default.prefill_chunk == 8192 and not default.prefill_only


def test_chunk_report_as_the_prompt_grows():
    ends = list(range(8192, 131072 + 1, 8192))
    p = {
        "experts": "fp8",
        "tokens": 131072,
        "chunk": 8192,
        "chunk_s": [0.05 + 0.001 * i for i in range(16)],
        "chunk_end": ends,
        "runs_s": [1.1, 1.0, 1.05],
        "peak_gib": 40.5,
        "base_gib": 38.0,
        "s": 1.05,
        "tok_s": 124830.0,
        "roof_tok_s": 300000.0,
        "share": 0.41,
        "share_fp8": 0.25,
        "steps": 16,
    }
    text = _chunk_text(p)
    assert "runs 1.100, 1.000, 1.050 s" in text and "peak 40.50 GiB" in text
    assert "8K 50 ms" in text and "128K 65 ms" in text and text.count(" ms") == 16  # <= 16 chunks: every one
    line = prefill_line(p)
    assert "25.0% of the FP8 roof" in line and "16 chunk(s)" in line
    long = dict(p, chunk_s=[0.05] * 32, chunk_end=[8192 * (i + 1) for i in range(32)], tokens=262144)
    assert _chunk_text(long).count(" ms") == 6  # 8K 16K 32K 64K 128K 256K
