"""Prefill on one CUDA engine, decode on another (pages copied on the device), against one engine doing both: the
engine-level hand-off on a GPU, without Ray or a transport (tests/kv_transfer/test_handoff.py on CUDA, bf16,
`mini_v4` quantised, default fp8 KV), prompts one at a time and batched. GPU only.

Every output must equal the one engine's; on a difference the message says whether it is numerical: the largest
|dlogprob| on the shared tokens before it (0.0 = the same bits until then) and both runs' picks at the divergence.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU only: needs a CUDA device", allow_module_level=True)

from engine.execution.sampling_params import SamplingParams  # noqa: E402
from engine.loading.load import load_engine  # noqa: E402
from engine.loading.make_model import make_model  # noqa: E402
from tests.kv_transfer.test_handoff import copy_pages, run_to_end  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir():
    return make_model("mini_v4", tempfile.mkdtemp(prefix="dsv4-handoff-"), quantize=True)


def _colocated(kw, prompts, params, together: bool) -> list:
    colocated = load_engine(**kw)
    if together:
        ids = [colocated.add_request(p, params, seed=i) for i, p in enumerate(prompts)]
        run_to_end(colocated)
        return [colocated.pop_finished(r) for r in ids]
    want = []  # one at a time, as the service check sends them
    for i, p in enumerate(prompts):
        rid = colocated.add_request(p, params, seed=i)
        run_to_end(colocated)
        want.append(colocated.pop_finished(rid))
    return want


def _handed_off(kw, prompts, params, together: bool) -> list:
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
    return [decode.pop_finished(f"d{i}") for i in range(len(prompts))]


@pytest.mark.parametrize("together", [False, True], ids=["one_at_a_time", "batched"])
def test_gpu_handoff_equals_one_engine(model_dir, together):
    kw = dict(model_dir=model_dir, device="cuda", dtype="bfloat16", max_cached_tokens=32768, max_batch_tokens=4096)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 4000, (n,), generator=g).tolist() for n in (300, 700, 1500)]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, logprobs=True)
    want = _colocated(kw, prompts, params, together)
    got = _handed_off(kw, prompts, params, together)
    torch.cuda.empty_cache()
    bad = []
    for i, (a, w) in enumerate(zip(got, want)):
        first = next((k for k, (x, y) in enumerate(zip(a.output, w.output)) if x != y), None)
        if first is not None or a.output != w.output:
            bad.append(
                f"prompt {i} ({len(prompts[i])} tokens): first difference at output position {first}; "
                + _logprob_gap(a, w, first)
            )
    assert not bad, "\n".join(bad)


def _logprob_gap(got, want, first: int | None) -> str:
    """Whether a divergence is numerical: the largest |dlogprob| on the shared tokens before it (0.0 = the two
    runs computed the same bits until then), and both runs' logprobs of their picks at the divergence (a
    near-tie flips on tiny numerical noise; a large gap after bit-equal history points at a state bug)."""
    n = len(got.output) if first is None else first
    gap = max((abs(a - b) for a, b in zip(got.logprobs[:n], want.logprobs[:n])), default=0.0)
    text = f"max |dlogprob| on the shared tokens {gap:.3e}"
    if first is not None:
        text += (
            f"; at the difference: hand-off picked {got.output[first]} (logprob {got.logprobs[first]:.4f}), "
            f"one engine picked {want.output[first]} (logprob {want.logprobs[first]:.4f})"
        )
    return text
