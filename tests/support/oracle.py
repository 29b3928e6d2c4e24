"""Correctness oracle helpers (not tests).

The oracle is transformers' `DeepseekV4ForCausalLM`, always run as a FULL forward with
`use_cache=False` (its cached decode path drops the indexer's top-k on CSA layers; see
docs "Oracle pitfalls"). Everything here is fp32 on CPU.

- `make_hf_checkpoint(out_dir, seed=0, **overrides)` builds a tiny random `DeepseekV4Config`
  checkpoint whose otherwise-degenerate parameters (router bias, tid2eid, sinks, position
  biases, mHC base/scale, norm weights) are randomised, and saves it with `save_pretrained`.
- `oracle_logprobs(model_dir, ids)` -> [len(ids), vocab] log-softmax of one full forward.
- `oracle_greedy(model_dir, prompt, n)` -> n greedy tokens, each from a fresh full forward.
- `teacher_forced(model_dir, prompt, generated)` -> per-position oracle numbers for a
  continuation produced by someone else (one forward; valid because the full forward is causal).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 1: SLIDING, 4: CSA}

# Defaults for a tiny but non-degenerate model. Every key may be overridden; extra keys
# understood here (not DeepseekV4Config fields):
#   compress_ratios: per-layer 0/4/R list (R>4 means HCA with rate R; all HCA layers share R)
#   num_hash_layers: first N layers use hash routing, the rest biased top-k
#   qk_rope_head_dim: rope dims (converted to partial_rotary_factor)
#   yarn: None or dict(factor=..., original_max_position_embeddings=...) for the compressed rope
#   init_std / head_std / hc_std / gate_std: random-init scales (see _randomise)
DEFAULTS: dict = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    compress_ratios=[0, 4, 16, 4],
    num_attention_heads=4,
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    sliding_window=8,
    hc_mult=2,
    hc_sinkhorn_iters=20,
    num_hash_layers=1,
    swiglu_limit=10.0,
    rope_theta=10000.0,
    compress_rope_theta=10000.0,
    yarn=dict(factor=16.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1),
    max_position_embeddings=512,  # = yarn factor * original_max_position_embeddings
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    init_std=0.08,
    head_std=0.35,
    hc_std=0.1,
    gate_std=0.3,
)


def build_config(**overrides):
    """A `transformers.DeepseekV4Config` from DEFAULTS + overrides (see DEFAULTS for extra keys)."""
    from transformers import DeepseekV4Config

    p = dict(DEFAULTS)
    unknown = set(overrides) - set(DEFAULTS) - {"layer_types", "compress_rates", "mlp_layer_types", "rope_parameters"}
    if unknown:
        raise TypeError(f"unknown overrides {sorted(unknown)}")
    p.update(overrides)
    n = p["num_hidden_layers"]
    kw = {
        k: p[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "moe_intermediate_size",
            "routed_scaling_factor",
            "scoring_func",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "sliding_window",
            "hc_mult",
            "hc_sinkhorn_iters",
            "swiglu_limit",
            "rope_theta",
            "compress_rope_theta",
            "max_position_embeddings",
            "rms_norm_eps",
            "bos_token_id",
            "eos_token_id",
        )
    }
    if "layer_types" in p:
        kw["layer_types"] = list(p["layer_types"])
        kw["compress_rates"] = dict(p.get("compress_rates") or {CSA: 4, HCA: 128})
    else:
        ratios = list(p["compress_ratios"])
        if len(ratios) != n:
            raise ValueError(f"compress_ratios {ratios} has {len(ratios)} entries, need {n}")
        hca = sorted({r for r in ratios if r > 4})
        if len(hca) > 1:
            raise ValueError(f"all HCA layers must share one rate, got {hca}")
        kw["layer_types"] = [_RATIO_TO_TYPE.get(r, HCA) for r in ratios]
        kw["compress_rates"] = {CSA: 4, HCA: hca[0] if hca else 128}
    if "mlp_layer_types" in p:
        kw["mlp_layer_types"] = list(p["mlp_layer_types"])
    else:
        h = p["num_hash_layers"]
        kw["mlp_layer_types"] = ["hash_moe"] * min(h, n) + ["moe"] * max(0, n - h)
    kw["partial_rotary_factor"] = p["qk_rope_head_dim"] / p["head_dim"]
    if "rope_parameters" in p:
        kw["rope_parameters"] = p["rope_parameters"]
    elif p["yarn"]:
        kw["rope_parameters"] = {"rope_type": "yarn", **p["yarn"]}
    cfg = DeepseekV4Config(**kw)
    cfg.dtype = torch.float32
    cfg._attn_implementation = "eager"
    return cfg, p


@torch.no_grad()
def _randomise(model, p: dict, gen: torch.Generator) -> None:
    """Re-draw every parameter: random init leaves several of them degenerate."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    def normal_(t, std, mean=0.0):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    std = p["init_std"]
    for _, param in model.named_parameters():  # plain linears / embeddings / experts first
        normal_(param, std)
    cfg = model.config
    for mod in model.modules():
        if isinstance(mod, m.DeepseekV4RMSNorm):
            normal_(mod.weight, 0.1, 1.0)  # 1 + small noise
        elif isinstance(mod, m.DeepseekV4Attention):
            normal_(mod.sinks, 1.0)
        elif isinstance(mod, (m.DeepseekV4HCACompressor, m.DeepseekV4CSACompressor, m.DeepseekV4Indexer)):
            normal_(mod.position_bias, 0.5)
            normal_(mod.gate_proj.weight, p["gate_std"])  # peaky compressor softmax
        elif isinstance(mod, m.DeepseekV4HyperConnection):
            normal_(mod.fn, p["hc_std"])
            normal_(mod.base, 0.5)
            mod.scale.copy_(0.5 + torch.rand(mod.scale.shape, generator=gen))
        elif isinstance(mod, m.DeepseekV4HyperHead):
            normal_(mod.hc_fn, p["hc_std"])
            normal_(mod.hc_base, 0.5)
            mod.hc_scale.copy_(0.5 + torch.rand(mod.hc_scale.shape, generator=gen))
        elif isinstance(mod, m.DeepseekV4TopKRouter):
            normal_(mod.weight, 0.15)
            normal_(mod.e_score_correction_bias, 0.1)
        elif isinstance(mod, m.DeepseekV4HashRouter):
            normal_(mod.weight, 0.15)
            rows = [
                torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                for _ in range(cfg.vocab_size)
            ]
            mod.tid2eid.copy_(torch.stack(rows).to(mod.tid2eid.dtype))
    normal_(model.model.embed_tokens.weight, 1.0)
    normal_(model.lm_head.weight, p["head_std"])


def make_hf_checkpoint(out_dir, seed: int = 0, **overrides) -> str:
    """Build a tiny random fp32 DeepSeek V4 checkpoint with transformers and save it to out_dir."""
    from transformers import DeepseekV4ForCausalLM

    cfg, p = build_config(**overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    _randomise(model, p, gen)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "oracle_params.json"), "w") as f:  # for humans / debugging
        json.dump({"seed": seed, **{k: v for k, v in p.items()}}, f, indent=1, default=str)
    _MODELS.pop(os.path.realpath(out_dir), None)
    return out_dir


_MODELS: dict[str, torch.nn.Module] = {}


def load_oracle(model_dir):
    key = os.path.realpath(os.fspath(model_dir))
    if key not in _MODELS:
        from transformers import DeepseekV4ForCausalLM

        model = DeepseekV4ForCausalLM.from_pretrained(key, dtype=torch.float32, attn_implementation="eager")
        _MODELS[key] = model.eval()
    return _MODELS[key]


@torch.no_grad()
def oracle_logprobs(model_dir, ids) -> torch.Tensor:
    """[len(ids), vocab] fp32 log-softmax of one full forward with use_cache=False."""
    model = load_oracle(model_dir)
    x = torch.tensor([list(ids)], dtype=torch.long)
    out = model(input_ids=x, use_cache=False)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def oracle_greedy(model_dir, prompt, n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens, each from a fresh full no-cache forward on prompt + generated so far."""
    seq = list(prompt)
    toks, lps = [], []
    for _ in range(n):
        lp = oracle_logprobs(model_dir, seq)[-1]
        t = int(torch.argmax(lp))
        toks.append(t)
        lps.append(float(lp[t]))
        seq.append(t)
    return toks, lps


@dataclass
class ForcedEval:
    """Oracle view of a prompt + a continuation chosen by someone else."""

    prompt_lp: list  # [None, lp(prompt[1] | prompt[:1]), ...]
    gen_lp: list  # oracle lp of each generated token given the (engine's) prefix
    gen_top: list  # oracle argmax at each generated position
    gen_gap: list  # oracle lp(argmax) - lp(engine's token) (0 where they agree)
    gen_top2_gap: list  # oracle lp(top1) - lp(top2)


def teacher_forced(model_dir, prompt, generated) -> ForcedEval:
    """One full forward on prompt + generated[:-1]: since the no-cache forward is causal this
    gives the oracle's distribution at every position of the engine's own trajectory."""
    prompt, generated = list(prompt), list(generated)
    seq = prompt + generated[:-1] if generated else prompt
    lp = oracle_logprobs(model_dir, seq)
    prompt_lp = [None] + [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    gen_lp, gen_top, gen_gap, gen_top2 = [], [], [], []
    for j, t in enumerate(generated):
        row = lp[len(prompt) - 1 + j]
        top2 = torch.topk(row, 2)
        gen_lp.append(float(row[t]))
        gen_top.append(int(top2.indices[0]))
        gen_gap.append(float(top2.values[0] - row[t]))
        gen_top2.append(float(top2.values[0] - top2.values[1]))
    return ForcedEval(prompt_lp, gen_lp, gen_top, gen_gap, gen_top2)


def share_within(diffs, tol: float) -> float:
    diffs = [d for d in diffs if d is not None]
    if not diffs:
        return 1.0
    return sum(1 for d in diffs if d <= tol) / len(diffs)


def finite(x) -> bool:
    return x is not None and math.isfinite(x)
