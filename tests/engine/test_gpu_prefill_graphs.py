"""Prefill steps under CUDA graphs (engine.execution.prefill_graphs) on a GPU: against the same padded steps run
eagerly, against content-sized eager prefill, and against transformers' fp32 oracle.

Skipped without a CUDA device. The CPU twin (tests/engine/test_prefill_buckets.py) pins the padded batch itself;
here the capture runs: a host sync anywhere in the captured forward fails the capture, and the replayed graph
must give what its eager padded step gives. bf16 (graphs need 16-bit weights).
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU only: needs a CUDA device", allow_module_level=True)

from engine.execution.runner import EngineCore  # noqa: E402
from engine.execution.sampling_params import SamplingParams  # noqa: E402
from engine.execution.scheduler import SchedulerConfig  # noqa: E402
from engine.loading.make_model import default_model_dir  # noqa: E402
from engine.loading.weights import load_weights  # noqa: E402
from engine.model.cache import CacheConfig  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from tests.engine.test_oracle import CONFIGS, N_GEN, _prompts, checkpoints  # noqa: E402, F401 (fixture)
from tests.support.oracle import teacher_forced  # noqa: E402

pytestmark = pytest.mark.gpu

LENS = (3, 40, 125, 131, 260, 700)  # no bucket size; 700 runs as chunks of the 256-token budget


def _engine(prefill_mode: str, kv_cache_dtype: str = "auto") -> EngineCore:
    model_dir = default_model_dir()
    cfg = ModelConfig.from_model_dir(model_dir)
    weights = load_weights(model_dir, cfg, dtype=torch.bfloat16, device="cuda")
    return EngineCore(
        cfg,
        weights,
        device="cuda",
        dtype=torch.bfloat16,
        cache_config=CacheConfig(max_requests=16, max_tokens=8192, kv_cache_dtype=kv_cache_dtype),
        scheduler_config=SchedulerConfig(max_batch_tokens=256, max_num_seqs=16),
        decode_mode="graphs",
        prefill_mode=prefill_mode,
        prefill_min_tokens=64,
        prefix_cache=False,
    )


def _generate(engine: EngineCore, prompts, n: int):
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
    return [engine.pop_finished(r) for r in ids]


def _prompt_set(vocab: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in LENS]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefill_graphs_match_padded_eager(kv_cache_dtype):
    """The replayed graph computes its bucket's padded step: the same kernels on the same shapes as the eager padded
    run ("bucketed"), so the same tokens and log-probs, and the same cache pages (the scratch page aside)."""
    graphs, padded = _engine("graphs", kv_cache_dtype), _engine("bucketed", kv_cache_dtype)
    prompts = _prompt_set(graphs.cfg.vocab_size)
    got, want = _generate(graphs, prompts, 8), _generate(padded, prompts, 8)
    runner = graphs.prefill_runner
    assert runner is not None and runner.graphs and runner.steps >= 3, "no prefill step replayed a graph"
    assert [r.output for r in got] == [r.output for r in want]
    worst = max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs))
    print(f"[prefill graphs vs padded eager] {kv_cache_dtype}: {len(runner.graphs)} graphs, max |dlogprob| {worst:.2e}")
    assert worst < 1e-2
    for name, group in graphs.pool.groups.items():
        rows = group.spec.page_rows
        a, b = group.tensor[:, rows:], padded.pool.groups[name].tensor[:, rows:]
        differ = (a != b).float().mean().item()
        assert differ < 1e-3, f"{name}: {differ:.2%} of the cache differs"


def test_prefill_graphs_match_eager():
    """Against content-sized eager prefill: the padded shapes may round differently in bf16 (the padding tokens join
    the experts' groups; longer masked lists), so tokens are compared up to the first divergence."""
    graphs, eager = _engine("graphs"), _engine("eager")
    prompts = _prompt_set(graphs.cfg.vocab_size)
    got, want = _generate(graphs, prompts, 32), _generate(eager, prompts, 32)
    assert graphs.prefill_runner is not None and graphs.prefill_runner.graphs
    assert eager.prefill_runner is None
    agree = total = 0
    diffs = []
    for a, b in zip(got, want):
        total += len(b.output)
        for x, y, lx, ly in zip(a.output, b.output, a.logprobs, b.logprobs):
            if x != y:
                break
            agree += 1
            diffs.append(abs(lx - ly))
    print(f"[prefill graphs vs eager] bf16 agreement before first divergence {agree / total:.3f}, max {max(diffs):.2e}")
    assert agree / total >= 0.8 and max(diffs) < 0.1


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_graphs_match_oracle(name, checkpoints, monkeypatch):  # noqa: F811 - the imported fixture
    """$DSV4_PREFILL_GRAPHS=1 through LLM (the setting's own path), small buckets so the oracle prompts are padded:
    the generated tokens' log-probs against transformers' fp32 model, teacher-forced on the engine's trajectory,
    within the bf16 tolerance of tests/engine/test_gpu_engine.py (no prompt log-probs: those steps run eagerly)."""
    from dsv4_kernels import settings
    from engine.llm import LLM

    monkeypatch.setenv(settings.PREFILL_GRAPHS, "1")
    monkeypatch.setenv(settings.PREFILL_GRAPH_MIN_TOKENS, "16")
    settings.reload()
    try:
        spec = CONFIGS[name]
        model_dir = checkpoints(name)
        prompts = _prompts(spec)
        llm = LLM(model_dir=model_dir, device="cuda", dtype="bfloat16", max_batch_tokens=spec["max_batch_tokens"])
        runner = llm.engine.prefill_runner
        assert runner is not None and runner.mode == "graphs"
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=N_GEN, ignore_eos=True, logprobs=True))
        assert runner.graphs and runner.steps > 0, "no prefill step replayed a graph"
        diffs = []
        for prompt, out in zip(prompts, outs):
            ref = teacher_forced(model_dir, prompt, out.token_ids)
            diffs += [abs(e - o) if math.isfinite(e) else math.inf for e, o in zip(out.logprobs, ref.gen_lp)]
        share = sum(d <= 0.1 for d in diffs) / len(diffs)
        mean = sum(min(d, 10.0) for d in diffs) / len(diffs)
        print(f"[prefill graphs oracle] {name}: {len(diffs)} positions, {share:.4f} within 0.1, mean {mean:.2e}")
        assert share >= 0.95 and mean <= 0.03
    finally:
        monkeypatch.undo()
        settings.reload()
