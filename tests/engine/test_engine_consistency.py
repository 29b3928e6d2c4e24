"""The engine against itself on the built-in tiny model (fp32 CPU): chunked vs unchunked prefill,
batched vs alone, sampling semantics, and input validation.

The tiny preset has window 16 and ratios [0, 4, 128, 4], so prompts of 125-131 tokens put the first
HCA entry inside prefill or inside decode, and token budgets of 5 / 7 / 13 cut chunks at positions that
are not multiples of 4, 16 or 128.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM

TOL = 1e-5


@pytest.fixture(scope="module")
def llm():
    return LLM(model_dir=None, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def vocab(llm):
    return llm.config.vocab_size


def _prompts(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True, prompt_logprobs=True, **kw)


def _assert_same(a, b, what):
    assert a.token_ids == b.token_ids, f"{what}: tokens differ\n  {a.token_ids}\n  {b.token_ids}"
    assert len(a.logprobs) == len(b.logprobs)
    for j, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        assert abs(x - y) <= TOL, f"{what}: logprob of generated token {j}: {x} vs {y}"
    if a.prompt_logprobs is not None or b.prompt_logprobs is not None:
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        for i, (x, y) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]), start=1):
            assert abs(x - y) <= TOL, f"{what}: prompt logprob {i}: {x} vs {y}"


# ---- chunked prefill ------------------------------------------------------------------------------
CHUNK_LENS = [37, 130, 125, 9, 2]


@pytest.fixture(scope="module")
def unchunked(llm, vocab):
    prompts = _prompts(CHUNK_LENS, vocab, seed=1)
    return prompts, llm.generate(prompts, _greedy(12))


@pytest.mark.parametrize("budget", [5, 7, 13])
def test_chunked_prefill_matches_unchunked(budget, unchunked):
    prompts, ref = unchunked
    outs = LLM(model_dir=None, max_batch_tokens=budget).generate(prompts, _greedy(12))
    for p, (a, b) in enumerate(zip(outs, ref)):
        assert len(a.prompt_logprobs) == len(prompts[p])
        _assert_same(a, b, f"budget {budget}, prompt {p} (len {len(prompts[p])})")


# ---- batching ---------------------------------------------------------------------------------------
BATCH_LENS = [1, 5, 16, 17, 33, 64, 100, 131]


@pytest.fixture(scope="module")
def singles(llm, vocab):
    prompts = _prompts(BATCH_LENS, vocab, seed=2)
    return prompts, [llm.generate([p], _greedy(10))[0] for p in prompts]


@pytest.mark.parametrize("budget", [2048, 7])
def test_batched_matches_alone(budget, singles):
    prompts, alone = singles
    outs = LLM(model_dir=None, max_batch_tokens=budget).generate(prompts, _greedy(10))
    assert len(outs) == len(prompts)
    for p, (a, b) in enumerate(zip(outs, alone)):
        _assert_same(a, b, f"budget {budget}, prompt {p} (len {len(prompts[p])}) batched vs alone")


def test_outputs_in_prompt_order_with_mixed_lengths(llm, vocab):
    """Different max_new_tokens per request: short ones finish first but come back in prompt order."""
    prompts = _prompts([20, 3, 50], vocab, seed=3)
    params = [_greedy(9), _greedy(2), _greedy(5)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [9, 2, 5]
    assert all(o.finish_reason == "length" for o in outs)
    for p, o in zip(prompts, outs):
        _assert_same(o, llm.generate([p], params[prompts.index(p)])[0], "mixed lengths")


def test_logprobs_only_when_asked(llm, vocab):
    prompts = _prompts([6, 20], vocab, seed=13)
    plain = llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    full = llm.generate(prompts, _greedy(4))
    for a, b in zip(plain, full):
        assert a.logprobs is None and a.prompt_logprobs is None
        assert a.token_ids == b.token_ids and a.finish_reason == "length"
        assert all(x <= 0.0 for x in b.logprobs + b.prompt_logprobs[1:])


def test_more_prompts_than_fit_one_step(vocab):
    """70 requests (more than the default number of concurrent sequences) through a 16-token budget."""
    prompts = _prompts([3 + (i % 7) for i in range(70)], vocab, seed=11)
    outs = LLM(model_dir=None, max_batch_tokens=16).generate(prompts, _greedy(3))
    assert len(outs) == 70
    ref = LLM(model_dir=None).generate(prompts[::9], _greedy(3))
    for k, r in zip(range(0, 70, 9), ref):
        _assert_same(outs[k], r, f"request {k} of 70")


def test_stops_at_eos_unless_ignored(llm, vocab, tmp_path):
    """A checkpoint whose config names, as EOS, the 4th token of a greedy continuation must stop there
    (and run on with ignore_eos): the built-in model with its config.json edited, so EOS comes from the
    checkpoint as in production, whatever the random weights say."""
    import json
    import shutil

    from engine.loading.make_model import default_model_dir

    prompt = _prompts([7], vocab, seed=4)[0]
    free = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    k = 3
    eos = free[k]
    k = free.index(eos)  # its first occurrence
    model = tmp_path / "model"
    shutil.copytree(default_model_dir(), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (model / "config.json").write_text(json.dumps(cfg))
    gen = model / "generation_config.json"
    if gen.exists():
        gen_cfg = json.loads(gen.read_text())
        gen_cfg["eos_token_id"] = eos
        gen.write_text(json.dumps(gen_cfg))
    eos_llm = LLM(model_dir=str(model), device="cpu", dtype="float32")
    assert eos in eos_llm.config.eos_token_ids
    stopped = eos_llm.generate([prompt], SamplingParams(max_new_tokens=12))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids[: k + 1] == free[: k + 1]
    assert len(stopped.token_ids) in (k, k + 1)  # with or without the EOS token itself
    ignored = eos_llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"


# ---- sampling ---------------------------------------------------------------------------------------
def _sampled(seed, n=16, **kw):
    kw.setdefault("temperature", 1.0)
    return SamplingParams(max_new_tokens=n, seed=seed, ignore_eos=True, logprobs=True, **kw)


def test_seeded_sampling_reproducible_and_seed_dependent(llm, vocab):
    prompts = _prompts([11, 40], vocab, seed=5)
    batch = [prompts[0]] * 6 + [prompts[1]] * 2
    params = [_sampled(s) for s in range(6)] + [_sampled(7), _sampled(8)]
    a = llm.generate(batch, params)
    b = llm.generate(batch, params)
    for x, y in zip(a, b):
        _assert_same(x, y, "same seeds, same batch")
    distinct = {tuple(o.token_ids) for o in a[:6]}
    assert len(distinct) >= 3, f"6 seeds gave only {len(distinct)} distinct continuations"
    greedy = llm.generate([prompts[0]], _greedy(16))[0].token_ids
    assert any(o.token_ids != greedy for o in a[:6])


def test_seeded_request_independent_of_batch(llm, vocab):
    """SamplingParams documents 'same seed, same tokens, whatever the batch'."""
    prompts = _prompts([11, 40, 7], vocab, seed=6)
    alone = llm.generate([prompts[0]], _sampled(42))[0]
    in_batch = llm.generate([prompts[1], prompts[0], prompts[2]], [_sampled(3), _sampled(42), _greedy(5)])[1]
    _assert_same(alone, in_batch, "seed 42 alone vs in a batch")


def test_top_k_1_and_tiny_top_p_equal_greedy(llm, vocab):
    prompts = _prompts([9, 30], vocab, seed=7)
    greedy = llm.generate(prompts, _greedy(12))
    for kw in (dict(top_k=1, temperature=1.0), dict(top_k=1, temperature=3.0), dict(top_p=1e-6, temperature=1.5)):
        outs = llm.generate(prompts, [_sampled(s, n=12, **kw) for s in (0, 1)])
        for g, o in zip(greedy, outs):
            assert o.token_ids == g.token_ids, kw
            assert max(abs(x - y) for x, y in zip(o.logprobs, g.logprobs)) <= TOL, kw


def _first_tokens(llm, prompt, n_seeds=48, **kw):
    outs = llm.generate([prompt] * n_seeds, [_sampled(s, n=1, **kw) for s in range(n_seeds)])
    return {o.token_ids[0]: o.logprobs[0] for o in outs}


def test_top_k_and_top_p_restrict_the_support(llm, vocab):
    prompt = _prompts([21], vocab, seed=8)[0]
    # top_k=3 at a high temperature: at most 3 distinct first tokens, yet more than one.
    seen = _first_tokens(llm, prompt, temperature=3.0, top_k=3)
    assert 2 <= len(seen) <= 3, seen
    # top_p: every sampled token lies in the nucleus (smallest top set with mass >= p), so the observed
    # set D satisfies mass(D) - min(D) < p (logprobs are under the raw distribution; temperature 1).
    for p in (0.3, 0.6):
        seen = _first_tokens(llm, prompt, temperature=1.0, top_p=p)
        probs = sorted(math.exp(v) for v in seen.values())
        assert sum(probs) - probs[0] < p + 1e-5, (p, probs)
    # Temperature flattens: more distinct tokens at T=4 than at T=0.25 (same seeds).
    hot, cold = _first_tokens(llm, prompt, temperature=4.0), _first_tokens(llm, prompt, temperature=0.25)
    assert len(hot) > len(cold), (len(hot), len(cold))


def test_logprobs_are_raw_model_logprobs(llm, vocab):
    """A token sampled at temperature 2 with top_k reports its log-prob under the untempered, unfiltered
    distribution: the same number as the prompt log-prob of that token appended to the prompt."""
    prompt = _prompts([15], vocab, seed=9)[0]
    out = llm.generate([prompt], _sampled(5, n=3, temperature=2.0, top_k=20))[0]
    check = llm.generate([prompt + out.token_ids], _greedy(1))[0]
    for j in range(3):
        assert abs(out.logprobs[j] - check.prompt_logprobs[len(prompt) + j]) <= TOL, j


# ---- input validation -------------------------------------------------------------------------------
def _raises(llm, prompts, params, *needles):
    with pytest.raises(ValueError) as exc:
        llm.generate(prompts, params)
    msg = str(exc.value)
    assert any(n in msg for n in needles), f"message {msg!r} names none of {needles}"


def test_bad_token_ids(llm, vocab):
    _raises(llm, [[1, 2, vocab]], SamplingParams(), str(vocab))
    _raises(llm, [[3, -1, 2]], SamplingParams(), "-1")
    _raises(llm, [[5, 6], [1, 10**6]], SamplingParams(), str(10**6))


def test_empty_prompt(llm):
    _raises(llm, [[]], SamplingParams(), "empty")
    _raises(llm, [[1, 2], []], SamplingParams(), "empty")


def test_too_long(llm):
    max_pos = llm.config.max_position_embeddings
    prompt = [2] * 10
    n = max_pos - len(prompt) + 1
    _raises(llm, [prompt], SamplingParams(max_new_tokens=n), str(max_pos), str(max_pos + 1))


def test_bad_sampling_params(llm):
    with pytest.raises(ValueError, match="-0.5|temperature"):
        llm.generate([[2, 3]], SamplingParams(temperature=-0.5))
    for top_p in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="top_p"):
            llm.generate([[2, 3]], SamplingParams(top_p=top_p))
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_k=-1)


def test_bad_request_rejects_whole_batch_and_engine_recovers(llm, vocab):
    good = _prompts([8], vocab, seed=10)[0]
    ref = llm.generate([good], _greedy(4))[0]
    _raises(llm, [good, [vocab + 5]], _greedy(4), str(vocab + 5))
    _assert_same(llm.generate([good], _greedy(4))[0], ref, "after a rejected batch")


def test_bfloat16_runs_close_to_float32(llm, vocab):
    """bf16 weights/activations: same contract, finite log-probs, close to fp32 on average."""
    prompts = _prompts([37, 9], vocab, seed=12)
    ref = llm.generate(prompts, _greedy(6))
    outs = LLM(model_dir=None, dtype="bfloat16").generate(prompts, _greedy(6))
    for a, b in zip(outs, ref):
        assert len(a.token_ids) == 6 and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        assert all(math.isfinite(x) for x in a.logprobs + a.prompt_logprobs[1:])
        d = [abs(x - y) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
        assert sum(d) / len(d) < 0.05, max(d)
