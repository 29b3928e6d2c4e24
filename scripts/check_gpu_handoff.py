"""Prefill on one CUDA engine, decode on another (pages copied on the device), against one engine doing both:
the engine-level hand-off on a GPU, without Ray or a transport (tests/kv_transfer/test_handoff.py on CUDA, bf16,
`mini_v4`, default fp8 KV). Prints how many outputs are identical and where the first difference is.

Usage: PYTHONPATH=. python3 scripts/check_gpu_handoff.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from engine.loading.load import load_engine
    from engine.loading.make_model import make_model
    from engine.execution.sampling_params import SamplingParams
    from tests.kv_transfer.test_handoff import copy_pages, run_to_end

    d = make_model("mini_v4", tempfile.mkdtemp(prefix="dsv4-handoff-"), quantize=True)
    kw = dict(model_dir=d, device="cuda", dtype="bfloat16", max_cached_tokens=32768, max_batch_tokens=4096)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 4000, (n,), generator=g).tolist() for n in (300, 700, 1500)]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, logprobs=True)
    status = 0
    for together in (False, True):
        colocated = load_engine(**kw)
        if together:
            ids = [colocated.add_request(p, params, seed=i) for i, p in enumerate(prompts)]
            run_to_end(colocated)
            want = [colocated.pop_finished(r) for r in ids]
        else:  # one at a time, as the service check sends them
            want = []
            for i, p in enumerate(prompts):
                rid = colocated.add_request(p, params, seed=i)
                run_to_end(colocated)
                want.append(colocated.pop_finished(rid))
        prefill, decode = load_engine(**kw), load_engine(**kw)
        for i, p in enumerate(prompts):
            prefill.add_request(p, params, request_id=f"p{i}", prefill_only=True, seed=i)
            run_to_end(prefill)
            req = prefill.held_request(f"p{i}")
            pages = decode.reserve_import(req.prompt, params, f"d{i}", req.seed, req.output[0], req.logprobs[0])
            copy_pages(prefill.pool, req.pages, decode.pool, pages)
            torch.cuda.synchronize()
            prefill.release(f"p{i}")
            decode.commit_import(f"d{i}")
            if not together:
                run_to_end(decode)
        run_to_end(decode)
        same = 0
        for i, w in enumerate(want):
            got = decode.pop_finished(f"d{i}")
            first = next((k for k, (a, b) in enumerate(zip(got.output, w.output)) if a != b), None)
            same += first is None
            print(f"[gpu handoff] {'batched' if together else 'one at a time'} prompt {i} ({len(prompts[i])} tokens): "
                  + ("identical" if first is None else f"first difference at output position {first}; ")
                  + _logprob_gap(got, w, first), flush=True)
        status |= same != len(want)
        del colocated, prefill, decode
        torch.cuda.empty_cache()
    return status


def _logprob_gap(got, want, first: int | None) -> str:
    """Whether a divergence is numerical: the largest |dlogprob| on the shared tokens before it (0.0 = the two
    runs computed the same bits until then), and both runs' logprobs of their picks at the divergence (a
    near-tie flips on tiny numerical noise; a large gap after bit-equal history points at a state bug)."""
    n = len(got.output) if first is None else first
    gap = max((abs(a - b) for a, b in zip(got.logprobs[:n], want.logprobs[:n])), default=0.0)
    text = f"max |dlogprob| on the shared tokens {gap:.3e}"
    if first is not None:
        text += (f"; at the difference: hand-off picked {got.output[first]} (logprob {got.logprobs[first]:.4f}), "
                 f"one engine picked {want.output[first]} (logprob {want.logprobs[first]:.4f})")
    return text


if __name__ == "__main__":
    sys.exit(main())
