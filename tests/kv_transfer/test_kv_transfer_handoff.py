"""End to end through a real transfer backend: prefill engine -> export -> decode pulls -> same output as one engine.

Like tests/kv_transfer/test_handoff.py, but the caches move through kv_transfer (plan + backend) instead of a plain page
copy, and the prefill side frees its held pages only from the backend's release callback.
"""

import time

import pytest
import torch

from engine.llm import load_engine
from engine.sampling_params import SamplingParams
from kv_transfer import make_backend
from tests.support.backends import BACKEND_NAMES as KINDS
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True, temperature=0.9, top_p=0.9, seed=7)
PROMPTS = [list(range(3, 3 + n)) for n in (1, 23, 41, 140)]  # 140: a closed ratio-128 window + 12 open tokens


def run_to_end(engine):
    while engine.has_work:
        engine.step()


@pytest.fixture(scope="module")
def colocated():
    engine = load_engine(max_batch_tokens=2048)
    ids = [engine.add_request(p, PARAMS, seed=100 + i) for i, p in enumerate(PROMPTS)]
    run_to_end(engine)
    return [engine.pop_finished(r) for r in ids]


@pytest.mark.parametrize("kind", KINDS)
def test_handoff_through_backend_equals_colocated(kind, colocated):
    prefill = load_engine(max_batch_tokens=16)
    decode = load_engine(max_batch_tokens=64, max_num_seqs=16)  # other pool size: other page ids and strides
    src = make_backend(kind, prefill.pool, on_release=lambda rid, err: prefill.release(rid))
    dst = make_backend(kind, decode.pool)
    try:
        dst.add_peer(src.worker_name, src.metadata())
        pids = [prefill.add_request(p, PARAMS, request_id=f"p{i}", prefill_only=True, seed=100 + i)
                for i, p in enumerate(PROMPTS)]
        decode.reserve_import([1], SamplingParams(max_new_tokens=3), "occupier", 0, 1, 0.0)  # shift page ids
        run_to_end(prefill)
        for i, rid in enumerate(pids):
            req = prefill.held_request(rid)
            ticket = src.export(rid, req.pages, req.num_computed)
            pages = decode.reserve_import(req.prompt, PARAMS, f"d{i}", req.seed, req.output[0], req.logprobs[0])
            stats = dst.pull(ticket, pages, timeout_s=10)
            assert stats.bytes > 0
            decode.commit_import(f"d{i}")
        deadline = time.monotonic() + 5
        while src.exported() and time.monotonic() < deadline:  # confirmations arrive in-band (other threads)
            src.poll()  # runs the callback that frees the prefill pages, in this thread
            time.sleep(0.005)
        assert prefill.held == {} and src.exported() == []
        decode.abort("occupier")
        run_to_end(decode)
        for i, want in enumerate(colocated):
            got = decode.pop_finished(f"d{i}")
            assert got.output == want.output
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
        assert prefill.pool.num_free_pages() == prefill.pool.idle_free_pages()
    finally:
        src.close()
        dst.close()
