"""Overlapped speculative steps (engine.execution.spec_overlap): a greedy decode-only fixed step is launched from the
previous one's device outputs before the host reads it. Pinned on the CPU (eager bucketed, fp32) on the trained
dsv4-mini-py, whose MTP layer drafts what the model says (most drafts accepted, rejections at every depth): greedy
output equals non-speculative output token for token, steps were overlapped, and the run drains with no launched
step left; requests finishing mid-flight (max_tokens edges, a stop token, EOS) and an abort while a step is in
flight drop the launched step's rows and return every page; seeded sampled requests draw what synchronous steps draw."""

from __future__ import annotations

import os

import pytest
import torch

from engine.execution.runner import EngineCore
from engine.execution.sampling_params import SamplingParams
from engine.execution.scheduler import SchedulerConfig
from engine.loading.tokenizer import load_tokenizer
from engine.loading.weights import load_weights
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig

PROMPT_TEXTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.",
    "for i in range(10):\n",
    "    return sorted(",
]


MINI = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "models", "dsv4-mini-py"
)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_model_dir(MINI)
    return cfg, load_weights(MINI, cfg, dtype=torch.float32, device="cpu", mtp=True)


@pytest.fixture(scope="module")
def prompts(model):
    tok = load_tokenizer(MINI)
    return [tok.encode(t) for t in PROMPT_TEXTS]


def _engine(model, k, overlap, prefix=True):
    cfg, weights = model
    return EngineCore(
        cfg,
        weights,
        cache_config=CacheConfig(max_requests=8, max_tokens=4096, page_tokens=16),
        scheduler_config=SchedulerConfig(max_batch_tokens=2048, max_num_seqs=8),
        decode_mode="bucketed",
        overlap_decode=overlap,
        prefix_cache=prefix,
        speculative_tokens=k,
    )


def _run(engine, prompts, params, abort_after: dict | None = None, in_flight: list | None = None):
    """-> each request's tokens (and finish reason); abort_after: {index: n} aborts request index once it holds n;
    in_flight gets, per abort, whether a launched step was unread then."""
    ids = [engine.add_request(p, q, request_id=f"r{i}", seed=1000 + i) for i, (p, q) in enumerate(zip(prompts, params))]
    out = {}
    while engine.has_work:
        engine.step()
        for i, n in (abort_after or {}).items():
            req = engine.requests.get(ids[i])
            if req is not None and len(req.output) >= n and ids[i] not in out:
                out[ids[i]] = (list(req.output), "abort")
                if in_flight is not None:
                    in_flight.append(engine.speculator.launched is not None)
                engine.abort(ids[i])
        for rid in [r for r, req in engine.requests.items() if req.finished]:
            req = engine.pop_finished(rid)
            out[rid] = (list(req.output), req.finish_reason)
    return [out[i] for i in ids]


@pytest.mark.parametrize("k", [1, 3])
def test_overlapped_greedy_equals_non_speculative(model, prompts, k):
    free = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 9, 24, 40, 17)]
    base = _run(_engine(model, 0, overlap=False), prompts, free)
    stop = base[3][0][12]  # a token request 3 emits mid-run
    params = free[:3] + [SamplingParams(max_new_tokens=40, stop_token_ids=(stop,))] + [free[4]]
    base = _run(_engine(model, 0, overlap=False), prompts, params)
    spec = _engine(model, k, overlap=True)
    got = _run(spec, prompts, params)
    assert got == base
    s = spec.speculator.stats
    assert s["overlapped_steps"] > 0 and s["accepted"] > s["drafted"] // 3  # real drafts, mostly accepted
    assert spec.speculator.launched is None and not spec.pool.has_deferred_frees
    assert spec.pool.num_free_pages() == spec.pool.idle_free_pages()  # every page back


def test_abort_in_flight_drops_the_launched_rows_and_frees_the_pages(model, prompts):
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True) for _ in prompts]
    base = _run(_engine(model, 0, overlap=False), prompts, params)
    spec = _engine(model, 2, overlap=True)
    in_flight: list = []
    got = _run(spec, prompts, params, abort_after={1: 6}, in_flight=in_flight)
    assert in_flight == [True]  # the abort came while a launched step (holding request 1's rows) was unread
    for i, ((tokens, reason), (want, _)) in enumerate(zip(got, base)):
        if i == 1:
            assert reason == "abort" and tokens == want[: len(tokens)]
        else:
            assert (tokens, reason) == (want, "length")
    assert spec.speculator.stats["overlapped_steps"] > 0 and spec.speculator.launched is None
    assert not spec.speculator.drafts and not spec.pool.has_deferred_frees
    assert spec.pool.num_free_pages() == spec.pool.idle_free_pages()


def test_sampled_requests_overlap_with_the_draws_of_synchronous_steps(model, prompts):
    """Seeded sampled requests beside greedy ones: overlapped steps key every draw (drafts, acceptance, residual and
    plain draws) by the output index the synchronous step would, so each request's tokens are the same."""
    params = [
        SamplingParams(max_new_tokens=20, ignore_eos=True),
        SamplingParams(max_new_tokens=24, temperature=0.8, ignore_eos=True),
        SamplingParams(max_new_tokens=18, temperature=1.0, top_k=40, ignore_eos=True),
        SamplingParams(max_new_tokens=22, temperature=0.6, top_p=0.9, ignore_eos=True),
    ]
    sync = _engine(model, 2, overlap=False)
    want = _run(sync, prompts[:4], params)
    spec = _engine(model, 2, overlap=True)
    assert _run(spec, prompts[:4], params) == want
    s = spec.speculator.stats
    assert s["overlapped_steps"] > 0 and 0 < s["accepted"] < s["drafted"]  # acceptances and rejections
    assert sync.speculator.stats["overlapped_steps"] == 0


def _logprobs(engine, prompt: list[int], n: int) -> list[float]:
    """The greedy log-probs of n tokens after `prompt`."""
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    while engine.has_work:
        engine.step()
    return engine.pop_finished(rid).logprobs


def test_snapshots_taken_between_overlapped_steps_serve_later_hits(model, prompts):
    """Decode-time prefix-cache snapshots (a block boundary past the prompt) are taken while steps overlap around
    them: a later prompt extending the finished request's output hits one, and its log-probs are a fresh
    non-speculative run's (a snapshot holding a launched step's ring rows would not be)."""
    spec = _engine(model, 2, overlap=True)
    ((first, _),) = _run(spec, prompts[2:3], [SamplingParams(max_new_tokens=300, ignore_eos=True)])
    assert spec.prefix.stats.snapshots_taken > 0 and spec.speculator.stats["overlapped_steps"] > 50
    longer = prompts[2] + first[:290]
    got = _logprobs(spec, longer, 4)
    assert spec.prefix.stats.hit_tokens >= spec.prefix.block  # a snapshot past the prompt was used
    want = _logprobs(_engine(model, 0, overlap=False, prefix=False), longer, 4)
    # fp32 rounding between the two paths: ~3e-7; a snapshot holding the next step's rows: ~4e-4
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: overlapped speculative steps under CUDA graphs")
@pytest.mark.parametrize("k", [1, 2])
def test_graph_overlapped_steps_equal_eager_bucketed(prompts, k):
    """bf16 on CUDA: with the warm-up's graphs and overlapped steps (the production setting) the trained model emits
    the tokens that synchronous eager bucketed steps emit, steps were overlapped, nothing was captured mid-run and
    every page came back."""
    from engine.execution.warmup import warm_engine

    cfg = ModelConfig.from_model_dir(MINI)
    gpu = (cfg, load_weights(MINI, cfg, dtype=torch.bfloat16, device="cuda", mtp=True))

    def engine(mode, overlap):
        return EngineCore(
            cfg,
            gpu[1],
            device="cuda",
            dtype=torch.bfloat16,
            cache_config=CacheConfig(max_requests=8, max_tokens=4096, page_tokens=16),
            scheduler_config=SchedulerConfig(max_batch_tokens=2048, max_num_seqs=8),
            decode_mode=mode,
            overlap_decode=overlap,
            speculative_tokens=k,
        )

    graphs = engine("graphs", True)
    warm_engine(graphs, sweep_gemms=False, decodes=True)
    captured = len(graphs.speculator.verify.graphs) + len(graphs.speculator.mtp.graphs)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 9, 24, 40, 17)]
    want = _run(engine("bucketed", False), prompts, params)
    assert _run(graphs, prompts, params) == want
    assert graphs.speculator.stats["overlapped_steps"] > 0
    assert len(graphs.speculator.verify.graphs) + len(graphs.speculator.mtp.graphs) == captured
    assert graphs.pool.num_free_pages() == graphs.pool.idle_free_pages()
