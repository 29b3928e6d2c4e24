"""The hand-off through a real transfer backend on random checkpoints (tests/engine/test_oracle_random.py's
draws): a prefill engine with its own step budget -> export -> pull into a decode engine whose page ids are
shifted -> the same tokens and logprobs as one engine, exact or fp8 caches, several page sizes, and the prefill
side's pages all back once the pull is confirmed. Beyond the tiny model of test_kv_transfer_handoff.py: layer
mixes with HCA rates 8-128 (compressor states of every width), windows 4-32, mHC widths 1-4, prompts to 300.
"""

import random

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.loading.load import load_engine
from tests.engine.test_oracle_random import draw_config
from tests.support.backends import BACKEND_NAMES
from tests.support.handoff import run_colocated, run_handoff
from tests.support.oracle import make_hf_checkpoint

SEEDS = (0, 6, 11, 16)


@pytest.mark.parametrize("kind", BACKEND_NAMES)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_checkpoint_handoff_equals_one_engine(seed, kind, tmp_path):
    rng = random.Random(seed)
    overrides, lens, budget = draw_config(rng)
    model = make_hf_checkpoint(tmp_path, seed=1100 + seed, **overrides)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]
    kv, page = rng.choice(["exact", "fp8"]), rng.choice([16, 64, 256])
    params = SamplingParams(
        max_new_tokens=10, ignore_eos=True, logprobs=True, temperature=rng.choice([0.0, 0.9]), seed=7
    )
    want = run_colocated(
        load_engine(model, max_batch_tokens=2048, kv_cache_dtype=kv, page_tokens=page), prompts, params
    )
    prefill = load_engine(model, max_batch_tokens=budget, kv_cache_dtype=kv, page_tokens=page)
    decode = load_engine(model, max_batch_tokens=64, max_num_seqs=16, kv_cache_dtype=kv, page_tokens=page)
    for i, (w, got) in enumerate(zip(want, run_handoff(kind, prefill, decode, prompts, params))):
        assert got.output == w.output, (overrides, lens, i)
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(w.logprobs), atol=1e-5)
    assert prefill.pool.num_free_pages() == prefill.pool.idle_free_pages()
