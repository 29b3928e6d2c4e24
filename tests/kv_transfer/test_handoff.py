"""Prefill on one engine, decode on another: the same tokens and logprobs as one engine doing both.

The caches move here by a plain page copy (every group, every page the request owns); the transfer
backends in kv_transfer/ are tested against the same expectation in their own tests.
"""

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.loading.load import load_engine


def copy_pages(src_pool, src_pages, dst_pool, dst_pages):
    for name, group in src_pool.groups.items():
        rows = group.spec.page_rows
        for sp, dp in zip(src_pages.get(name, []), dst_pages.get(name, [])):
            dst_pool.groups[name].tensor[:, dp * rows : (dp + 1) * rows] = group.tensor[:, sp * rows : (sp + 1) * rows]


def run_to_end(engine):
    while engine.has_work:
        engine.step()


@pytest.fixture(scope="module")
def engines():
    # Different step budgets on the two sides; an occupier request shifts the decode side's page ids.
    return load_engine(max_batch_tokens=9), load_engine(max_batch_tokens=64)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, temperature=0.9, top_p=0.9, seed=7),
    ],
)
def test_disaggregated_equals_colocated(engines, params):
    prefill, decode = engines
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 23, 41)]
    colocated = load_engine(max_batch_tokens=2048)
    ids = [colocated.add_request(p, params, seed=100 + i) for i, p in enumerate(prompts)]
    run_to_end(colocated)
    want = [colocated.pop_finished(r) for r in ids]

    pids = [
        prefill.add_request(p, params, request_id=f"p{i}", prefill_only=True, seed=100 + i)
        for i, p in enumerate(prompts)
    ]
    decode.reserve_import([1], SamplingParams(max_new_tokens=3), "occupier", 0, 1, 0.0)  # shift page ids
    run_to_end(prefill)
    assert set(prefill.held) == set(pids)
    for i, rid in enumerate(pids):
        req = prefill.held_request(rid)
        pages = decode.reserve_import(req.prompt, params, f"d{i}", req.seed, req.output[0], req.logprobs[0])
        copy_pages(prefill.pool, req.pages, decode.pool, pages)
        prefill.release(rid)
        decode.commit_import(f"d{i}")
    decode.abort("occupier")
    run_to_end(decode)
    for i, w in enumerate(want):
        got = decode.pop_finished(f"d{i}")
        assert got.output == w.output
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(w.logprobs), atol=1e-5)
    idle = prefill.pool.idle_free_pages()
    assert prefill.pool.num_free_pages() == idle
    assert decode.pool.num_free_pages() == decode.pool.idle_free_pages()
