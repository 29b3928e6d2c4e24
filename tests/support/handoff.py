"""The disaggregated hand-off, driven by hand: a prefill engine exports each request's pages through a real
transfer backend, a decode engine pulls them into pages of its own and finishes the requests.

`run_colocated` gives the expected outputs (one engine doing both phases); `run_handoff` the decode side's. The
decode side first admits an occupier request, so its page ids differ from the prefill side's; the prefill side
frees its held pages only from the backend's release callback (checked here: nothing held, nothing exported).
"""

from __future__ import annotations

import time

from engine.execution.sampling_params import SamplingParams
from kv_transfer.registry import make_backend


def run_to_end(engine) -> None:
    while engine.has_work:
        engine.step()


def run_colocated(engine, prompts, params) -> list:
    """Every prompt through one engine (request i seeded 100 + i) -> its finished requests, in order."""
    ids = [engine.add_request(p, params, seed=100 + i) for i, p in enumerate(prompts)]
    run_to_end(engine)
    return [engine.pop_finished(r) for r in ids]


def run_handoff(kind: str, prefill, decode, prompts, params, worker_names: tuple[str, str] | None = None) -> list:
    """Prefill on `prefill`, move the caches through backend `kind`, decode on `decode` -> the decode side's
    finished requests, in prompt order (same seeds as run_colocated)."""
    names = ({"worker_name": worker_names[0]}, {"worker_name": worker_names[1]}) if worker_names else ({}, {})
    src = make_backend(kind, prefill.pool, on_release=lambda rid, err: prefill.release(rid), **names[0])
    dst = make_backend(kind, decode.pool, **names[1])
    try:
        dst.add_peer(src.worker_name, src.metadata())
        pids = [
            prefill.add_request(p, params, request_id=f"p{i}", prefill_only=True, seed=100 + i)
            for i, p in enumerate(prompts)
        ]
        decode.reserve_import([1], SamplingParams(max_new_tokens=3), "occupier", 0, 1, 0.0)  # shift page ids
        run_to_end(prefill)
        for i, rid in enumerate(pids):
            req = prefill.held_request(rid)
            ticket = src.export(rid, req.pages, req.num_computed)
            pages = decode.reserve_import(req.prompt, params, f"d{i}", req.seed, req.output[0], req.logprobs[0])
            assert dst.pull(ticket, pages, timeout_s=10).bytes > 0
            decode.commit_import(f"d{i}")
        deadline = time.monotonic() + 5
        while src.exported() and time.monotonic() < deadline:  # confirmations arrive in-band (other threads)
            src.poll()  # runs the callback that frees the prefill pages, in this thread
            time.sleep(0.005)
        assert prefill.held == {} and src.exported() == []
        decode.abort("occupier")
        run_to_end(decode)
        return [decode.pop_finished(f"d{i}") for i in range(len(prompts))]
    finally:
        src.close()
        dst.close()


def run_streamed_handoff(kind: str, prefill, decode, prompts, params) -> tuple[list, list[dict]]:
    """`run_handoff` streamed chunk by chunk: after every prefill step, each request still prefilling exports the
    pages its finished chunks filled (`export_chunk`) and the decode side pulls them at once, into pages it
    reserved before the first chunk (its first token is set when the prefill ends); the final ticket moves the
    rest. -> (the decode side's finished requests in prompt order, per request {"chunks": pulls, "chunk_bytes",
    "final_bytes", "start_tokens"})."""
    src = make_backend(kind, prefill.pool, on_release=lambda rid, err: prefill.release(rid))
    dst = make_backend(kind, decode.pool)
    moved = [{"chunks": 0, "chunk_bytes": 0, "final_bytes": 0, "start_tokens": 0} for _ in prompts]
    try:
        dst.add_peer(src.worker_name, src.metadata())
        for i, p in enumerate(prompts):
            prefill.add_request(p, params, request_id=f"p{i}", prefill_only=True, seed=100 + i)
        decode.reserve_import([1], SamplingParams(max_new_tokens=3), "occupier", 0, 1, 0.0)  # shift page ids
        dst_pages = [decode.reserve_import(p, params, f"d{i}", 0, 0, 0.0) for i, p in enumerate(prompts)]
        while prefill.has_work:
            prefill.step()
            for i, m in enumerate(moved):
                req = prefill.requests.get(f"p{i}")  # still prefilling (held once its first token is out)
                if req is None:
                    continue
                ticket = src.export_chunk(f"p{i}", req.pages, req.num_computed, m["start_tokens"])
                if ticket is not None:
                    m["chunk_bytes"] += dst.pull(ticket, dst_pages[i], timeout_s=10).bytes
                    m["chunks"] += 1
                    m["start_tokens"] = req.num_computed
        for i, m in enumerate(moved):
            req = prefill.held_request(f"p{i}")
            ticket = src.export(f"p{i}", req.pages, req.num_computed, start_tokens=m["start_tokens"])
            m["final_bytes"] = dst.pull(ticket, dst_pages[i], timeout_s=10).bytes
            imp = decode.imports[f"d{i}"]  # the first token and seed arrive with the prefill's result
            imp.output, imp.logprobs, imp.seed = [req.output[0]], [req.logprobs[0]], req.seed
            decode.commit_import(f"d{i}")
        deadline = time.monotonic() + 5
        while src.exported() and time.monotonic() < deadline:
            src.poll()
            time.sleep(0.005)
        assert prefill.held == {} and src.exported() == []
        decode.abort("occupier")
        run_to_end(decode)
        return [decode.pop_finished(f"d{i}") for i in range(len(prompts))], moved
    finally:
        src.close()
        dst.close()
