"""`dsv4 bench quality` (benchmarks/quality.py): its rows are real engine options and switches (so a GPU run does
not die on a typo), its comparison arithmetic is right, and a regression beyond the tolerance is flagged."""

import dataclasses
import math

import pytest

from benchmarks.quality import FORMATS, TOLERANCE_BPB, Texts, compare, table
from dsv4_kernels.settings import BY_NAME
from engine.loading.load import EngineOptions

OPTION_NAMES = {f.name for f in dataclasses.fields(EngineOptions)}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_row_sets_real_options_and_switches(fmt):
    assert set(fmt.options) <= OPTION_NAMES, set(fmt.options) - OPTION_NAMES
    assert set(fmt.env) <= set(BY_NAME), set(fmt.env) - set(BY_NAME)
    if fmt.twin:
        assert any(f.name.startswith(fmt.twin) for f in FORMATS if f is not fmt)


def _row(logprobs, greedy):
    return dict(logprobs=logprobs, greedy=greedy, exact_match=0.5, tasks=2, drafted=0, accepted=0, seconds=1.0)


def test_compare_reports_bits_per_byte_dlogprob_and_greedy_agreement():
    ref = _row([[-1.0, -2.0], [-0.5]], [[1, 2, 3], [4, 5, 6]])
    row = _row([[-1.05, -2.5], [-0.5]], [[1, 2, 3], [4, 9, 6]])
    c = compare(row, ref, n_bytes=10)
    assert c["bits_per_byte"] == pytest.approx(4.05 / math.log(2) / 10)
    assert c["mean_abs_dlogprob"] == pytest.approx((0.05 + 0.5 + 0.0) / 3)
    assert c["within_0_1"] == pytest.approx(2 / 3)
    assert c["greedy_identical"] == 0.5
    assert c["greedy_common_prefix"] == pytest.approx((3 + 1) / 2)


def test_table_flags_a_format_beyond_the_tolerance_and_a_speculative_row_that_changes_tokens():
    texts = Texts(files=["a.py"], n_bytes=100, windows=[[0, 1, 2]], prompts=[[0, 1]], tasks=[])
    ref = _row([[-10.0, -10.0]], [[1, 2]])
    nats = TOLERANCE_BPB * 3 * math.log(2) * 100  # 3x the tolerance, in nats over the text
    results = {
        FORMATS[0].name: ref,
        "exact bf16": _row([[-10.0, -10.0]], [[1, 2]]),
        "bf16 + fp8 KV cache (MXFP4 index keys)": _row([[-10.0, -10.0 - nats]], [[1, 2]]),
        "bf16 + MTP K=1": _row([[-10.0, -10.0]], [[1, 3]]),
        "exact fp32 + MTP K=1": _row([[-10.0, -10.0]], [[1, 3]]),
    }
    args = type("A", (), dict(device="cpu", files=1, window=2, url=None, model="m", gen_context=1, gen_tokens=1))
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table(args, texts, results).splitlines()}
    assert lines["exact bf16"].endswith("| pass |")
    assert "FINDING: bits/byte +0.0300" in lines["bf16 + fp8 KV cache (MXFP4 index keys)"]
    # exactness is asked of the fp32 speculative row; a bf16 one's flips are counted, not failed
    assert "FINDING: greedy tokens differ from its non-speculative twin" in lines["exact fp32 + MTP K=1"]
    assert "| pass (greedy differs from its twin in 1 of 1 prompts" in lines["bf16 + MTP K=1"]
