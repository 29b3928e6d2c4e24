"""The CUDA engine (Triton fast paths, CUDA-graph decode) against transformers and against itself.

Skipped without a CUDA device (CI has none; run on the GPU machine). What runs:
- every config of tests/engine/test_oracle.py on the GPU in fp32 and bf16, judged by the fp32 CPU oracle on the
  engine's own trajectory (teacher forcing), with dtype-keyed tolerances: fp32 as tight as the CPU
  engine's test; bf16 by the share of positions within 0.1 nats and the mean |dlogprob|;
- decode under CUDA graphs vs the same engine without them, in bf16 (graphs need 16-bit weights: fp32
  decodes eagerly): tokens up to the first divergence, logprobs there within bf16 noise.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU only: needs a CUDA device", allow_module_level=True)

from engine.execution.runner import EngineCore  # noqa: E402
from engine.execution.sampling_params import SamplingParams  # noqa: E402
from engine.loading.make_model import default_model_dir  # noqa: E402
from engine.loading.weights import load_weights  # noqa: E402
from engine.model.cache import CacheConfig  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from tests.engine.test_decode_overlap import _spy_lookahead  # noqa: E402
from tests.engine.test_oracle import CONFIGS, N_GEN, _prompts, checkpoints  # noqa: E402, F401 (fixture)
from tests.support.oracle import teacher_forced  # noqa: E402

# dtype -> (|dlogprob| tolerance, share of positions within it, bound on the mean |dlogprob|)
ORACLE_TOL = {"float32": (2e-3, 0.99, 1e-3), "bfloat16": (0.1, 0.95, 0.03)}


@pytest.mark.parametrize("dtype", list(ORACLE_TOL))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_engine_matches_oracle(name, dtype, checkpoints):  # noqa: F811 - the imported fixture
    _check_against_oracle(name, dtype, checkpoints)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_split_topk_engine_matches_oracle(name, checkpoints, monkeypatch):  # noqa: F811 - the imported fixture
    """Every decode step's indexer top-k through the split radix kernel (dsv4_kernels.triton_topk_split; by
    default only from 4096 candidates, contexts of 16K and more), bf16 under CUDA graphs. The rank-counting and
    bitonic sort kernels, which take these short rows by default (the other tests: the rank kernel), are off."""
    from dsv4_kernels import settings, triton_indexer

    monkeypatch.setattr(triton_indexer, "TOPK_SPLIT_MIN_CANDIDATES", 1)
    monkeypatch.setenv(settings.TOPK_SORT_MAX_CANDIDATES, "0")
    monkeypatch.setenv(settings.TOPK_RANK_MAX_WORK, "0")
    settings.reload()
    try:
        _check_against_oracle(name, "bfloat16", checkpoints)
    finally:
        monkeypatch.undo()
        settings.reload()


def _check_against_oracle(name, dtype, checkpoints):  # noqa: F811 - the imported fixture
    from engine.llm import LLM

    spec = CONFIGS[name]
    model_dir = checkpoints(name)
    prompts = _prompts(spec)
    llm = LLM(model_dir=model_dir, device="cuda", dtype=dtype, max_batch_tokens=spec["max_batch_tokens"])
    graphs = dtype != "float32"  # fp32 decodes eagerly (see EngineCore._resolve_decode_mode)
    assert llm.engine.decode_mode == ("graphs" if graphs else "eager")
    params = SamplingParams(max_new_tokens=N_GEN, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    outs = llm.generate(prompts, params)
    diffs = []
    for prompt, out in zip(prompts, outs):
        ref = teacher_forced(model_dir, prompt, out.token_ids)
        diffs += [
            abs(e - o) if math.isfinite(e) else math.inf for e, o in zip(out.prompt_logprobs[1:], ref.prompt_lp[1:])
        ]
        diffs += [abs(e - o) if math.isfinite(e) else math.inf for e, o in zip(out.logprobs, ref.gen_lp)]
    tol, share_min, mean_max = ORACLE_TOL[dtype]
    share = sum(d <= tol for d in diffs) / len(diffs)
    mean = sum(min(d, 10.0) for d in diffs) / len(diffs)
    print(
        f"[gpu oracle] {name} {dtype}: {len(diffs)} positions, {share:.4f} within {tol}, mean {mean:.2e}, "
        f"max {max(diffs):.2e}"
    )
    assert share >= share_min and mean <= mean_max, (share, mean)
    if graphs:
        assert llm.engine.decode_runner.graphs, "no decode step ran under a CUDA graph"


def _engine(dtype, mode) -> EngineCore:
    model_dir = default_model_dir()
    cfg = ModelConfig.from_model_dir(model_dir)
    weights = load_weights(model_dir, cfg, dtype=dtype, device="cuda")
    return EngineCore(
        cfg,
        weights,
        device="cuda",
        dtype=dtype,
        cache_config=CacheConfig(max_requests=16, max_tokens=8192),
        decode_mode=mode,
    )


def _generate(engine: EngineCore, prompts, n: int):
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
    return [engine.pop_finished(r) for r in ids]


def test_graph_decode_matches_eager():
    """bf16 (graphs need 16-bit): the padded GEMMs may round differently, so tokens are compared up to the
    first divergence and logprobs there within bf16 noise. CPU tests pin exactness of the padded batch."""
    g = torch.Generator().manual_seed(5)
    graphs, eager = _engine(torch.bfloat16, "graphs"), _engine(torch.bfloat16, "eager")
    prompts = [torch.randint(2, graphs.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 40, 125, 131, 260)]
    got, want = _generate(graphs, prompts, 48), _generate(eager, prompts, 48)
    assert graphs.decode_runner.graphs, "no step was replayed from a graph"
    agree = total = 0
    diffs = []
    for a, b in zip(got, want):
        total += len(b.output)
        for x, y, lx, ly in zip(a.output, b.output, a.logprobs, b.logprobs):
            if x != y:
                break
            agree += 1
            diffs.append(abs(lx - ly))
    print(
        f"[graphs vs eager] bf16 agreement before first divergence: {agree / total:.3f}, "
        f"max |dlogprob| {max(diffs):.2e}"
    )
    assert agree / total >= 0.8 and max(diffs) < 0.1


def test_graphs_refuse_fp32():
    with pytest.raises(ValueError, match="bfloat16"):
        _engine(torch.float32, "graphs")


def test_overlapped_graph_decode_equals_synchronous(monkeypatch):
    """Overlapped greedy decode (engine.execution.decode_overlap) under CUDA graphs runs the same kernels on the same inputs
    as the synchronous graph path, so tokens and log-probs are bit-equal; and the overlap must actually engage."""
    g = torch.Generator().manual_seed(7)
    overlapped, synchronous = _engine(torch.bfloat16, "graphs"), _engine(torch.bfloat16, "graphs")
    synchronous.overlap_decode = False
    assert overlapped.overlap_decode, "overlap is the default with graphs"
    launched = _spy_lookahead(monkeypatch, overlapped)
    prompts = [torch.randint(2, overlapped.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 64, 200)]
    got, want = _generate(overlapped, prompts, 40), _generate(synchronous, prompts, 40)
    assert launched, "no step was launched ahead of its predecessor's read-back"
    for a, b in zip(got, want):
        assert a.output == b.output
        assert a.logprobs == b.logprobs
    assert overlapped.pool.num_free_pages() == overlapped.pool.idle_free_pages()  # deferred frees returned
