"""engine.fast_paths: the Triton switch, and the engine's Triton attention path against the reference path.

On a CUDA machine the fast path runs compiled; elsewhere it is forced onto CPU tensors with DSV4_TRITON=1
under triton's interpreter (TRITON_INTERPRET=1, set before any kernels.triton_* import). Both paths run
the tiny model in fp32 on the same prompts (chunked prefill, so window rows come from the SWA ring and
from the chunk, plus CSA and HCA entries), and must give the same greedy tokens and log-probs within 1e-4.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.fast_paths import ENV, use_triton  # noqa: E402
from kernels.gpu import has_triton, triton_enabled  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4


def test_switch_env(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert not use_triton("cpu") and not use_triton("cuda")
    monkeypatch.delenv(ENV)
    assert not use_triton("cpu"), "CPU tensors take the reference path unless forced"
    assert use_triton("cuda") == (has_triton() and torch.cuda.is_available())
    monkeypatch.setenv(ENV, "1")
    assert use_triton("cpu") == triton_enabled("cpu")


needs_triton = pytest.mark.skipif(not has_triton() or not triton_enabled(DEVICE),
                                  reason=f"triton missing or unable to run on {DEVICE} (TRITON_INTERPRET off)")


def _generate(monkeypatch, setting: str, prompts, max_batch_tokens: int):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    monkeypatch.setenv(ENV, setting)
    llm = LLM(model_dir=None, device=DEVICE, dtype="float32", max_batch_tokens=max_batch_tokens)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    return llm.generate(prompts, params)


@needs_triton
def test_engine_triton_attention_matches_reference(monkeypatch):
    import engine.attention as attention_mod

    calls = []
    real = attention_mod.AttentionBlock._attend_triton

    def spy(self, *args, **kwargs):
        calls.append(self.layer)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(attention_mod.AttentionBlock, "_attend_triton", spy)
    g = torch.Generator().manual_seed(3)
    # Window 16, ratios [0, 4, 128, 4]: 131 tokens close an HCA entry; a 23-token budget chunks the prefill
    # so later chunks read window rows from the SWA ring and from the chunk in one row tensor. The whole
    # fast path runs (norm+RoPE, compressor, indexer, attention, mHC kernels), so keep it short: the
    # interpreter is slow.
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (131, 9)]
    ref = _generate(monkeypatch, "0", prompts, 23)
    assert not calls
    fast = _generate(monkeypatch, "1", prompts, 23)
    assert calls, "the fast path was not taken"
    for a, b in zip(ref, fast):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x - y) <= TOL
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(x - y) <= TOL


def _fp8_run(monkeypatch, setting: str, prompts, budget: int, decode_mode: str):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    monkeypatch.setenv(ENV, setting)
    llm = LLM(model_dir=None, device=DEVICE, dtype="float32", max_batch_tokens=budget, kv_cache_dtype="fp8",
              decode_mode=decode_mode)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    return llm.generate(prompts, params)


@needs_triton
@pytest.mark.parametrize("decode_mode", ["eager", "bucketed"])
def test_fp8_fast_path_matches_fp8_reference(monkeypatch, decode_mode):
    """An fp8 pool on the fast path (engine.attention_fp8: dequantised stores + the Triton MQA kernel, the
    Triton quantised-entry writer, the indexer over packed keys) computes what the fp8 reference computes.
    (Here, not in test_kv_cache_fp8.py, because forcing the Triton path needs TRITON_INTERPRET set before the
    first kernels.triton_* import.) FlashMLA's decode path is checked on the GPU (tests/kernels/test_flashmla_sparse.py)."""
    import engine.attention_fp8 as fp8_mod

    calls = []
    real = fp8_mod.dequantised_attend

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_mod, "dequantised_attend", spy)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (131, 9)]
    ref = _fp8_run(monkeypatch, "0", prompts, 23, decode_mode)
    assert not calls
    fast = _fp8_run(monkeypatch, "1", prompts, 23, decode_mode)
    assert calls, "the fp8 fast path was not taken"
    for a, b in zip(ref, fast):
        assert a.token_ids == b.token_ids
        # the Triton entry writer rounds its pooled entries by bits before packing: a code on a rounding
        # boundary may land one e4m3 step apart from the torch codec's, hence a looser bound than exact rows
        for x, y in zip(a.logprobs + a.prompt_logprobs[1:], b.logprobs + b.prompt_logprobs[1:]):
            assert abs(x - y) <= 1e-3
