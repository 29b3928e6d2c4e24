"""Model configs the tests share: V4-Flash's real shapes (no weights), for geometry and capacity checks."""

from __future__ import annotations

from engine.model.config import ModelConfig


def flash_config(**overrides) -> ModelConfig:
    """DeepSeek V4-Flash's config.json fields that shape the caches; `overrides` replace any of them."""
    raw = {
        "vocab_size": 129280,
        "hidden_size": 4096,
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "sliding_window": 128,
        # The released list carries a trailing 0 for the MTP layer; the parser keeps the first 43.
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    }
    raw.update(overrides)
    return ModelConfig.from_dict(raw)
