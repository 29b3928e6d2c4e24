"""The engine against the transformers oracle on configs drawn at random (seeded), beyond test_oracle's five.

Each seed draws a layer mix (SWA / CSA 4 / one HCA rate of 8-128, any order), head and rope widths, query /
output LoRA ranks and groups, expert counts and top-k, hash layers, router scoring, indexer widths and top-k,
window, mHC width and Sinkhorn iterations, YaRN or not, the SwiGLU clamp, prompt lengths up to 300 and a step
budget (chunked prefill from 5 tokens a step); the judgement is test_oracle's, on the engine's own trajectory.

Index heads are 16 or 32, not fewer. The indexer scores an entry as sum_h w_h * ReLU(q_h . k): with 4 heads an
entry scores exactly 0 whenever all 4 dots are negative (1 in 16), so zeros tie at the top-k boundary and
torch.topk breaks the tie by its own algorithm, which depends on the row's length (the oracle's row is every
entry of the whole teacher-forced sequence, the engine's the entries of its step). A different pick changes
that position's hidden state and every later position that attends it: seeds with 4 index heads fail the 99%
share at 90-97% here, and pass at 100% with the same seeds at 32 heads (V4-Flash has 64 index heads, and so
no such ties in fp32).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.test_oracle import assert_engine_matches_oracle
from tests.support.oracle import make_hf_checkpoint

SEEDS = range(24)


def draw_config(rng: random.Random) -> tuple[dict, list[int], int]:
    """-> (make_hf_checkpoint overrides, prompt lengths, engine token budget per step)."""
    layers = rng.randint(2, 5)
    hca = rng.choice([8, 16, 32, 128])
    heads = rng.choice([2, 4, 8])
    head_dim = rng.choice([16, 32, 48, 64])
    experts = rng.choice([4, 8, 16])
    overrides = dict(
        num_hidden_layers=layers,
        compress_ratios=[rng.choice([0, 4, hca]) for _ in range(layers)],
        hidden_size=rng.choice([32, 64, 96]),
        num_attention_heads=heads,
        head_dim=head_dim,
        qk_rope_head_dim=rng.choice([d for d in (4, 8, 16) if d < head_dim]),
        o_groups=rng.choice([g for g in (1, 2, 4) if heads % g == 0]),
        o_lora_rank=rng.choice([8, 16]),
        q_lora_rank=rng.choice([16, 32, 48]),
        n_routed_experts=experts,
        num_experts_per_tok=rng.randint(1, min(4, experts)),
        index_n_heads=rng.choice([16, 32]),
        index_head_dim=rng.choice([16, 32, 64]),
        index_topk=rng.randint(1, 8),
        sliding_window=rng.choice([4, 8, 16, 32]),
        hc_mult=rng.choice([1, 2, 4]),
        num_hash_layers=rng.randint(0, min(2, layers)),
        scoring_func=rng.choice(["sqrtsoftplus", "sigmoid"]),
        routed_scaling_factor=rng.choice([1.0, 1.5, 2.5]),
        hc_sinkhorn_iters=rng.choice([3, 20]),
        moe_intermediate_size=rng.choice([16, 32]),
    )
    if rng.random() < 0.5:
        overrides["yarn"] = None
    if rng.random() < 0.3:
        overrides["swiglu_limit"] = rng.choice([1.0, 7.0])
    longest = 300 if hca == 128 else 120
    lens = [rng.randint(1, longest) for _ in range(rng.randint(1, 4))]
    return overrides, lens, rng.choice([5, 13, 61, 128, 2048])


@pytest.mark.parametrize("seed", SEEDS)
def test_engine_matches_oracle_on_a_random_config(seed, tmp_path, capsys):
    overrides, lens, budget = draw_config(random.Random(seed))
    model_dir = make_hf_checkpoint(tmp_path, seed=200 + seed, **overrides)
    g = torch.Generator().manual_seed(300 + seed)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lens]
    assert_engine_matches_oracle(
        f"random seed {seed} {overrides} prompts {lens} budget {budget}", model_dir, prompts, budget, capsys
    )
