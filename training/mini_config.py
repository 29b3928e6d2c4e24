"""The config of dsv4-mini-py, the small DeepSeek V4 trained on the Python standard library.

Every layer kind of V4 at small widths: SWA-only layers (ratio 0), CSA layers (ratio 4, lightning indexer with
16 heads, top-16), HCA layers (ratio 128: a 1024-token training context gives 8 entries), mHC with V4's 4
streams and 20 Sinkhorn iterations, two hash-routed MoE layers then score-routed ones, one shared expert, YaRN
on the compressed layers. Every projection the release stores in FP8 is a whole number of 128x128 blocks
(hidden 256, q_lora 128, 4 heads x 128, o_groups 2 x 128, index 16 x 64, expert width 128), and expert rows
are whole 32-element MXFP4 blocks. Written in DeepSeek's legacy spelling, which both our loader and
transformers' DeepseekV4Config read.
"""

from __future__ import annotations

import copy

VOCAB_SIZE = 4096

MINI_PY: dict = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "compress_ratios": [0, 4, 128, 0, 4, 128],
    "num_hash_layers": 2,
    "sliding_window": 64,
    "num_attention_heads": 4,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 16,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "swiglu_limit": 10.0,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 4096,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0,
        "mscale_all_dim": 0,
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}


def mini_config() -> dict:
    """A deep copy of the config.json dict (callers may add quantization_config)."""
    return copy.deepcopy(MINI_PY)
