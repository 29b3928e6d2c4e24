"""DeepSeek V4 model configuration, parsed from a Hugging Face `config.json`.

Two spellings exist in the wild and both are accepted:
- legacy (DeepSeek's own release): `compress_ratios` (per-layer 0/1/4/128), `num_hash_layers`,
  `qk_rope_head_dim`, `rope_scaling` (YaRN for the compressed layers);
- transformers >= 5.23: `layer_types`, `mlp_layer_types`, `compress_rates`, `partial_rotary_factor`,
  `rope_parameters` (nested `main` / `compress`, or flat).
Everything downstream reads only `ModelConfig`, never the raw dict.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: plain when `yarn_factor` is None, else YaRN (DeepSeek flavour, attention factor 1)."""

    theta: float
    dim: int
    yarn_factor: float | None = None
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    norm_topk_prob: bool
    compress_ratios: tuple[int, ...]  # per layer: 0 (SWA only), 4 (CSA) or 128 (HCA); other ratios allowed
    hash_layers: tuple[bool, ...]  # per layer: MoE picks experts by tid2eid[token_id]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    swiglu_limit: float
    max_position_embeddings: int
    main_rope: RopeSpec
    compress_rope: RopeSpec
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    torch_dtype: str = "bfloat16"
    # MTP draft layers shipped with the checkpoint (`mtp.{i}.*`); their compress_ratios entries (trailing 0s
    # past num_hidden_layers) are not kept in compress_ratios: an MTP layer is always sliding-window only.
    num_nextn_predict_layers: int = 0
    quantization: dict = field(default_factory=dict, compare=False, hash=False)

    # ---- derived views -------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    def has_indexer(self, layer: int) -> bool:
        """CSA layers (overlapping windows + lightning indexer) are the ratio-4 ones."""
        return self.compress_ratios[layer] == 4

    def overlap(self, layer: int) -> bool:
        return self.has_indexer(layer)

    @property
    def ratios(self) -> tuple[int, ...]:
        """Distinct compression ratios used by any layer, sorted."""
        return tuple(sorted({r for r in self.compress_ratios if r > 1}))

    def layers_with_ratio(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio)

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.has_indexer(i))

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        return _parse(raw)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> ModelConfig:
        path = os.path.join(os.fspath(model_dir), "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json in model directory {os.fspath(model_dir)!r}")
        with open(path) as f:
            return _parse(json.load(f))


def _require(raw: dict, key: str):
    if key not in raw or raw[key] is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return raw[key]


def _layer_ratios(raw: dict, n: int) -> tuple[int, ...]:
    rates = dict(DEFAULT_COMPRESS_RATES)
    rates.update(raw.get("compress_rates") or {})
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = int(raw["compress_rate_csa"])
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = int(raw["compress_rate_hca"])
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])[:n]
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}; got {bad}")
        ratios = [0 if t == SLIDING else int(rates[t]) for t in types]
        # (the engine tells a layer's kind by its rate: 4 is CSA, with its indexer; any other rate is HCA)
        if CSA in types and int(rates[CSA]) != 4:
            raise ValueError(f"compress_rates: compressed_sparse_attention layers must use rate 4, got {rates[CSA]}")
        if HCA in types and int(rates[HCA]) == 4:
            raise ValueError(
                "compress_rates: heavily_compressed_attention layers need a rate other than 4 "
                "(4 is the compressed_sparse_attention rate)"
            )
    elif raw.get("compress_ratios") is not None:
        ratios = [int(r) for r in raw["compress_ratios"]][:n]
        ratios = [0 if r <= 1 else r for r in ratios]
    else:  # transformers' default schedule: 2x HCA, then HCA/CSA interleaved
        ratios = [rates[HCA]] * min(n, 2) + [rates[CSA] if i % 2 else rates[HCA] for i in range(max(n - 2, 0))]
    if len(ratios) != n:
        raise ValueError(f"layer schedule has {len(ratios)} entries but num_hidden_layers is {n}")
    for r in ratios:
        if r not in (0, 4) and (r < 2 or r % 2):
            raise ValueError(f"unsupported compress ratio {r}")
    return tuple(ratios)


def _hash_layers(raw: dict, n: int) -> tuple[bool, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])[:n]
        bad = [t for t in types if t not in MLP_LAYER_TYPES]
        if bad:
            raise ValueError(f"mlp_layer_types entries must be one of {MLP_LAYER_TYPES}; got {bad}")
        if len(types) != n:
            raise ValueError(f"mlp_layer_types has {len(types)} entries but num_hidden_layers is {n}")
        return tuple(t == "hash_moe" for t in types)
    n_hash = raw.get("num_hash_layers")
    n_hash = 3 if n_hash is None else int(n_hash)
    return tuple(i < n_hash for i in range(n))


def _rope_dim(raw: dict, head_dim: int) -> int:
    if raw.get("qk_rope_head_dim") is not None:
        return int(raw["qk_rope_head_dim"])
    factor = raw.get("partial_rotary_factor")
    rp = raw.get("rope_parameters") or {}
    if factor is None and isinstance(rp.get("main"), dict):
        factor = rp["main"].get("partial_rotary_factor")
    if factor is None:
        factor = 64 / 512
    return int(head_dim * float(factor))


def _ropes(raw: dict, rope_dim: int) -> tuple[RopeSpec, RopeSpec]:
    rope_theta = float(raw.get("rope_theta", 10000.0))
    compress_theta = float(raw.get("compress_rope_theta", 160000.0))
    rp = raw.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_params, compress_params = rp["main"], rp["compress"]
    else:
        scaling = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if not scaling.get("rope_type", scaling.get("type")) and raw.get("rope_scaling"):
            scaling = dict(raw["rope_scaling"])
        main_params = {"rope_type": "default", "rope_theta": rope_theta}
        compress_params = {**scaling, "rope_theta": compress_theta}
    main = RopeSpec(theta=float(main_params.get("rope_theta", rope_theta)), dim=rope_dim)
    kind = compress_params.get("rope_type", compress_params.get("type", "default"))
    theta = float(compress_params.get("rope_theta", compress_theta))
    if kind in ("yarn", "deepseek_yarn"):
        compress = RopeSpec(
            theta=theta,
            dim=rope_dim,
            yarn_factor=float(compress_params["factor"]),
            original_max_position=int(compress_params["original_max_position_embeddings"]),
            beta_fast=float(compress_params.get("beta_fast") or 32),
            beta_slow=float(compress_params.get("beta_slow") or 1),
            # DeepSeek V4 does not scale cos/sin on compressed layers (mscale = 0).
            attention_factor=float(compress_params.get("attention_factor") or 1.0),
        )
    elif kind == "default":
        compress = RopeSpec(theta=theta, dim=rope_dim)
    else:
        raise ValueError(f"unsupported rope_type {kind!r} for compressed layers")
    return main, compress


def _parse(raw: dict) -> ModelConfig:
    n = int(_require(raw, "num_hidden_layers"))
    head_dim = int(raw.get("head_dim") or _require(raw, "hidden_size") // _require(raw, "num_attention_heads"))
    rope_dim = _rope_dim(raw, head_dim)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError(f"rope dim {rope_dim} must be even and within head_dim {head_dim}")
    main_rope, compress_rope = _ropes(raw, rope_dim)
    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    cfg = ModelConfig(
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=int(_require(raw, "hidden_size")),
        num_layers=n,
        num_heads=int(_require(raw, "num_attention_heads")),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(_require(raw, "q_lora_rank")),
        o_groups=int(raw.get("o_groups", 8)),
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        n_routed_experts=int(_require(raw, "n_routed_experts")),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        num_experts_per_tok=int(_require(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(_require(raw, "moe_intermediate_size")),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        compress_ratios=_layer_ratios(raw, n),
        hash_layers=_hash_layers(raw, n),
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        sliding_window=int(raw.get("sliding_window", 128)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1 << 20)),
        main_rope=main_rope,
        compress_rope=compress_rope,
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        quantization=dict(raw.get("quantization_config") or {}),
    )
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    if cfg.num_heads % cfg.o_groups:
        raise ValueError(f"num_attention_heads {cfg.num_heads} is not divisible by o_groups {cfg.o_groups}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ValueError(
            f"num_experts_per_tok {cfg.num_experts_per_tok} exceeds n_routed_experts {cfg.n_routed_experts}"
        )
    if cfg.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ValueError(f"unsupported scoring_func {cfg.scoring_func!r}")
    if cfg.sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {cfg.sliding_window}")
