"""Data-parallel attention (engine.execution.dp_attention) over gloo on the CPU equals one rank.

Two real ranks (this process and one spawned by engine.execution.tp_launch), each with whole attention weights and its own
requests (prompt i runs on rank i % 2), the routed experts split by expert parallelism and exchanged in every MoE
layer. Against a one-rank engine on the same prompts, greedy and seeded-sampling requests give the same tokens and
the same logprobs and prompt logprobs within fp32 tolerance (the routed sum is added across ranks in another
order). The prompt count is odd, and the prompts differ in length, so ranks run out of work at different steps and
join the exchanges with no tokens (idle_forward).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.llm import LLM
from engine.loading.make_model import make_model
from engine.model.parallel import ParallelContext
from tests.engine.test_tensor_parallel import TOL, _assert_close, _params, _prompts

LENS = [37, 130, 9, 2, 21]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16_experts", "packed_mxfp4_experts"])
def test_two_data_parallel_ranks_equal_one(quantized, tmp_path):
    model_dir = None
    kwargs = dict(max_batch_tokens=7, decode_mode="bucketed")
    if quantized:  # MXFP4 experts kept packed: an EP rank holds whole packed experts
        model_dir = str(tmp_path / "q")
        make_model("tiny", model_dir, seed=4, quantize=True)
        kwargs.update(keep_mxfp4_experts=True)
    one = LLM(model_dir, prefix_cache=False, **kwargs)
    prompts = _prompts(one.config.vocab_size, LENS)
    params = _params(len(prompts))
    ref = one.generate(prompts + prompts, params)
    with LLM(model_dir, tensor_parallel_size=2, expert_parallel=True, data_parallel_attention=True, **kwargs) as llm:
        model = llm.engine.model
        assert model.attn[0].num_heads == llm.config.num_heads  # whole attention on each rank
        assert len(model.moe[1].experts) == llm.config.n_routed_experts // 2  # half the routed experts
        assert llm.engine.pool is not None and not llm.engine.parallel.enabled  # it schedules as a lone engine
        outs = llm.generate(prompts + prompts, params)
        decode_steps = llm.engine.decode_runner.steps
        again = llm.generate(prompts[:1], params[:1])  # a second call, one prompt: rank 1 only serves experts
        # Decode ticks ran one agreed bucket on both ranks (EngineCore._step_lockstep): rank 1 replayed it on
        # padding rows while rank 0 decoded alone (mismatched exchanges would hang or fail, not pass)
        assert decode_steps > 0 and llm.engine.decode_runner.steps > decode_steps
    _assert_close(outs, ref, "DP attention 2 + EP 2")
    _assert_close(again, ref[:1], "DP attention, one prompt")


def test_cli_generate_data_parallel_attention():
    args = [
        "generate",
        "--device",
        "cpu",
        "--json",
        "--logprobs",
        "--ignore-eos",
        "--max-new-tokens",
        "5",
        "--max-batch-tokens",
        "11",
        "--prompt-ids",
        "5,6,7,8,9,10,11,12,13,14,15,16,17",
        "--prompt-ids",
        "3,4",
        "--prompt-ids",
        "9",
        "--temperature",
        "0.8",
        "--seed",
        "7",
    ]

    def run(extra):
        proc = subprocess.run(
            [sys.executable, "-m", "service.cli", *args, *extra], capture_output=True, text=True, cwd=ROOT, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in proc.stdout.splitlines()]

    one = run([])
    dp = run(["--tensor-parallel-size", "2", "--expert-parallel", "--data-parallel-attention"])
    assert len(one) == len(dp) == 3
    for a, b in zip(dp, one):
        assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == b["finish_reason"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= TOL


@pytest.mark.parametrize("size, ep", [(1, True), (2, False)])
def test_data_parallel_attention_needs_expert_parallel_ranks(size, ep):
    with pytest.raises(
        ValueError,
        match="data-parallel attention needs --tensor-parallel-size > 1 and "
        f"--expert-parallel.*size {size}, expert_parallel {ep}",
    ):
        ParallelContext(size, 0, ep, data_parallel_attention=True)
    with pytest.raises(ValueError, match="data-parallel attention"):
        LLM(model_dir=None, tensor_parallel_size=size, expert_parallel=ep, data_parallel_attention=True)
