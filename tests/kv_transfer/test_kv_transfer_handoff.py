"""End to end through a real transfer backend: prefill engine -> export -> decode pulls -> same output as one engine.

Like tests/kv_transfer/test_handoff.py, but the caches move through kv_transfer (plan + backend) instead of a plain page
copy, and the prefill side frees its held pages only from the backend's release callback (tests/support/handoff.py).
"""

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.loading.load import load_engine
from tests.support.backends import BACKEND_NAMES as KINDS
from tests.support.handoff import run_colocated, run_handoff

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True, temperature=0.9, top_p=0.9, seed=7)
PROMPTS = [list(range(3, 3 + n)) for n in (1, 23, 41, 140)]  # 140: a closed ratio-128 window + 12 open tokens


@pytest.fixture(scope="module")
def colocated():
    return run_colocated(load_engine(max_batch_tokens=2048), PROMPTS, PARAMS)


@pytest.mark.parametrize("kind", KINDS)
def test_handoff_through_backend_equals_colocated(kind, colocated):
    prefill = load_engine(max_batch_tokens=16)
    decode = load_engine(max_batch_tokens=64, max_num_seqs=16)  # other pool size: other page ids and strides
    for want, got in zip(colocated, run_handoff(kind, prefill, decode, PROMPTS, PARAMS)):
        assert got.output == want.output
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    assert prefill.pool.num_free_pages() == prefill.pool.idle_free_pages()
