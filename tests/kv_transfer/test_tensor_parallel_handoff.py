"""Hand-off through the real TCP backend between engines of different tensor-parallel layouts (gloo, CPU).

A TP 2 + EP 2 prefill engine exports rank 0's pages (every rank holds the full MQA caches, so rank 0's pages
are the whole request) to a one-rank decode engine; a one-rank prefill engine exports to a TP 2 decode engine,
whose backend writes rank 0's pool and whose commit_import replicates the pages to rank 1. Both equal one
engine doing prefill and decode; the prefill side frees its pages only from the backend's release callback.
"""

import time

import torch

from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from engine.loading.load import load_engine
from kv_transfer.registry import make_backend

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True, temperature=0.9, top_p=0.9, seed=7)
PROMPTS = [list(range(3, 3 + n)) for n in (1, 23, 140)]  # 140: a closed ratio-128 window + 12 open tokens


def _drain(engine):
    while engine.has_work:
        engine.step()


def _handoff(prefill, decode, tag: str) -> list:
    src = make_backend("tcp", prefill.pool, on_release=lambda rid, err: prefill.release(rid))
    dst = make_backend("tcp", decode.pool)
    try:
        dst.add_peer(src.worker_name, src.metadata())
        for i, p in enumerate(PROMPTS):
            prefill.add_request(p, PARAMS, request_id=f"{tag}p{i}", prefill_only=True, seed=100 + i)
        _drain(prefill)
        for i in range(len(PROMPTS)):
            req = prefill.held_request(f"{tag}p{i}")
            ticket = src.export(f"{tag}p{i}", req.pages, req.num_computed)
            pages = decode.reserve_import(req.prompt, PARAMS, f"{tag}d{i}", req.seed, req.output[0], req.logprobs[0])
            assert dst.pull(ticket, pages, timeout_s=30).bytes > 0
            decode.commit_import(f"{tag}d{i}")
        deadline = time.monotonic() + 10
        while src.exported() and time.monotonic() < deadline:
            src.poll()
            time.sleep(0.005)
        assert prefill.held == {}
        _drain(decode)
        return [decode.pop_finished(f"{tag}d{i}") for i in range(len(PROMPTS))]
    finally:
        src.close()
        dst.close()


def test_tcp_handoff_between_tensor_parallel_layouts():
    colocated = load_engine(prefix_cache=False)
    ids = [colocated.add_request(p, PARAMS, seed=100 + i) for i, p in enumerate(PROMPTS)]
    _drain(colocated)
    want = [colocated.pop_finished(r) for r in ids]
    single = load_engine(max_batch_tokens=16)
    with LLM(model_dir=None, tensor_parallel_size=2, expert_parallel=True, max_batch_tokens=16) as llm:
        for prefill, decode, tag in ((llm.engine, single, "tp2->tp1"), (single, llm.engine, "tp1->tp2")):
            for got, w in zip(_handoff(prefill, decode, tag), want):
                assert got.output == w.output, tag
                assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(w.logprobs), atol=2e-5), tag
            assert prefill.pool.num_free_pages() == prefill.pool.idle_free_pages()
