"""The V4-Flash slice the GPU benchmark runs: its config.json, seeded random weights, the built engine.

Weights are random and seeded. Dense projections go through FP8 e4m3 128x128 UE8M0 block quantisation and
are dequantised to bf16, which is what the engine's loader does with a real checkpoint (engine/loading/weights.py).
Routed experts come in one of two formats (EXPERT_FORMATS), one engine each:
- "mxfp4": kept packed, as `load_weights(..., keep_mxfp4_experts=True)` hands them over (uint8 e2m1 bytes
  [N, K/2] + UE8M0 scale bytes [N, K/32] per expert; engine.model.moe.PackedExperts), filled with random bytes
  (every byte is a valid e2m1 pair) and one scale per tensor giving the std of the bf16 experts;
- "bf16": MXFP4-rounded (dsv4_kernels/quant.py) then dequantised to bf16, as the loader does by default;
- "fp8" (not in the default list): the "mxfp4" engine whose experts are also converted to FP8 128x128 after they
  are filled (dsv4_kernels.fp8_experts.from_packed, what `--prefill-expert-format fp8` does at load on an engine
  that decodes): steps of >= FP8_EXPERT_MIN_TOKENS tokens (the prefill) run DeepGEMM's grouped FP8 GEMM, decode
  steps keep MXFP4.
No checkpoint file is written: the weights dict is built on the device and handed to `EngineCore`, and
the caches are filled with random rows.
"""

from __future__ import annotations

import math

import torch

from benchmarks.timing import sync
from dsv4_kernels.quant import (
    E2M1_VALUES,
    UE8M0_BIAS,
    dequant_fp8_block,
    dequant_mxfp4,
    quant_fp8_block,
    quant_mxfp4,
    ue8m0_to_float,
)
from engine.execution.prefix_cache import STAGING_PAGES
from engine.execution.runner import EngineCore
from engine.execution.scheduler import SchedulerConfig
from engine.loading.make_model import (  # the release's quantisation layout
    _FP8,
    _MXFP4,
    preset_config,
)
from engine.loading.weights import expected_weight_shapes, keeps_fp32
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from engine.model.fast_paths import (
    FP8_EXPERT_MIN_TOKENS,
    mxfp4_moe_backend,
    resolve_index_cache_dtype,
    resolve_kv_cache_dtype,
    use_fp8_expert_gemm,
    use_fp8_gemm,
    use_grouped_moe,
)
from engine.model.linear import keeps_fp8, pow2_activations

QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def flash_slice_config(layers: int = 4, vocab: int = 129280) -> dict:
    """V4-Flash's config.json (../shared/docs/deepseek_v4.md) cut to `layers` layers: SWA, CSA, HCA, CSA, ..."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab,
        "hidden_size": 4096,
        "num_hidden_layers": layers,
        "compress_ratios": ([0, 4, 128, 4] * layers)[:layers],
        "num_hash_layers": 1,
        "sliding_window": 128,
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "swiglu_limit": 10.0,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0,
            "mscale_all_dim": 0,
        },
        "max_position_embeddings": 1 << 20,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": dict(QUANT_CONFIG),
    }


def smoke_config() -> dict:
    raw = preset_config("tiny")
    raw.update(torch_dtype="bfloat16", quantization_config=dict(QUANT_CONFIG))
    return raw


def _proj_std(fan_in: int) -> float:
    return min(0.1, max(0.02, 1.0 / math.sqrt(fan_in)))  # as engine.loading.make_model.random_weights


EXPERT_FORMATS = ("mxfp4", "bf16")  # the default run's formats
ALL_EXPERT_FORMATS = (*EXPERT_FORMATS, "fp8")


def experts_path(fmt: str, device, dtype) -> str:
    """What runs the routed experts of a `fmt` engine on `device` (engine.model.moe's choice), for the report."""
    if fmt == "fp8":
        prefill = "DeepGEMM grouped FP8" if use_fp8_expert_gemm(device) and dtype == torch.bfloat16 else "reference"
        return f"fp8 >= {FP8_EXPERT_MIN_TOKENS} tokens ({prefill}), else " + experts_path("mxfp4", device, dtype)
    if fmt == "mxfp4":
        return {
            "triton_kernels": "mxfp4, triton_kernels matmul",
            "marlin": "mxfp4, Marlin W4A16 grouped GEMM",
            "engine": "mxfp4, engine Triton MoE",
            "reference": "mxfp4, dequantise-on-the-fly reference",
        }[mxfp4_moe_backend(device)]
    probe = torch.empty(0, dtype=dtype, device=device)
    return "bf16, torch grouped_mm" if use_grouped_moe(probe) else "bf16, per-expert reference loop"


def mxfp4_scale_byte(std: float) -> int:
    """UE8M0 byte (127 + exponent) making uniformly random e2m1 bytes have about this std."""
    rms = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))  # of a uniform random nibble
    return UE8M0_BIAS + round(math.log2(std / rms))


def dense_path(device, dtype, want: str = "auto") -> str:
    """'fp8' (e4m3 + block scales, DeepGEMM) where that path runs and `want` allows it, else 'bf16'."""
    return "fp8" if want in ("auto", "fp8") and use_fp8_gemm(device, dtype) else "bf16"


def build_weights(
    cfg: ModelConfig, device, dtype, gen: torch.Generator, experts: str = "bf16", dense: str = "bf16", mtp: bool = False
) -> dict:
    """Random weights shaped like a checkpoint, FP8-quantised-then-dequantised where the release is FP8
    (dense "bf16"), or kept as e4m3 + fp32 block scales as `load_weights(keep_fp8=True)` hands them over
    (dense "fp8").

    Routed experts get one small zero placeholder per (layer, w1/w2/w3) shared by all 256 names (for
    "mxfp4" a uint8 [N, K/2] weight and a uint8 [N, K/32] `.scale`, as the loader keeps them packed): the
    engine stacks them into its [E, ...] tensors and `fill_experts` then writes values into those in
    place, so the experts exist only once on the device.
    """

    def randn(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std + mean

    out, placeholders = {}, {}
    for name, shape in expected_weight_shapes(cfg, mtp).items():  # mtp: also the MTP layers (benchmarks/spec.py)
        if _MXFP4.search(name):
            key = (name.split(".experts.")[0], name.rsplit(".", 2)[-2])
            if key not in placeholders:
                n, k = shape
                placeholders[key] = (
                    (
                        torch.zeros(n, k // 2, dtype=torch.uint8, device=device),
                        torch.zeros(n, k // 32, dtype=torch.uint8, device=device),
                    )
                    if experts == "mxfp4"
                    else (torch.zeros(shape, dtype=dtype, device=device),)
                )
            out[name] = placeholders[key][0]
            if experts == "mxfp4":
                out[name[: -len(".weight")] + ".scale"] = placeholders[key][1]
            continue
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("gate.tid2eid"):
            v, k = shape
            ids = torch.rand(v, cfg.n_routed_experts, generator=gen, device=device).argsort(dim=1)[:, :k]
            out[name] = ids.to(torch.int64)
            continue
        if name == "embed.weight":
            t = randn(shape, 1.0)
        elif name.endswith("norm.weight"):
            t = randn(shape, 0.05, 1.0)
        elif name.endswith("attn_sink"):
            t = randn(shape, 0.5)
        elif name.endswith(".ape"):
            t = randn(shape, 0.2)
        elif name.endswith("gate.bias"):
            t = randn(shape, 0.1)
        elif leaf.endswith("_fn"):
            t = randn(shape, 0.02)
        elif leaf.endswith("_base"):
            t = randn(shape, 0.1)
        elif leaf.endswith("_scale"):
            t = randn(shape, 0.1, 1.0).clamp_min(0.5)
        elif name == "head.weight":
            t = randn(shape, 0.1)
        else:
            t = randn(shape, _proj_std(shape[-1]))
        if _FP8.search(name):
            q, s = quant_fp8_block(t, scale_fmt="ue8m0")
            if dense == "fp8" and keeps_fp8(name, shape, cfg.o_groups):
                out[name], out[name[: -len(".weight")] + ".scale"] = q, ue8m0_to_float(s)
                continue
            t = dequant_fp8_block(q, s)
        out[name] = t.to(torch.float32 if keeps_fp32(name) else dtype)
    return out


def fill_experts(core: EngineCore, gen: torch.Generator, chunk: int) -> None:
    """Random experts in the engine's stacked tensors, in place: packed MXFP4 gets random e2m1 bytes and a
    scale byte for std `_proj_std(K)`; bf16 gets MXFP4-rounded normals, `chunk` experts at a time."""
    for moe in core.model.moe:
        pk = moe.packed
        if pk is not None:
            for w, s in ((pk.w1, pk.s1), (pk.w2, pk.s2), (pk.w3, pk.s3)):
                w.random_(0, 256, generator=gen)
                s.fill_(mxfp4_scale_byte(_proj_std(2 * w.shape[-1])))
            continue
        for w in moe.dense or ():  # dense stacks (neither MXFP4 bytes nor FP8)
            std = _proj_std(w.shape[-1])
            for e0 in range(0, w.shape[0], chunk):
                part = w[e0 : e0 + chunk]
                t = torch.randn(part.shape, generator=gen, device=w.device, dtype=torch.float32) * std
                packed, scale = quant_mxfp4(t)
                part.copy_(dequant_mxfp4(packed, scale).to(w.dtype))
                del t, packed, scale


def add_fp8_experts(core: EngineCore, cfg: ModelConfig) -> None:
    """Each MoE layer's filled MXFP4 experts also as FP8 128x128 (before any MoE call: triton_kernels' layouts
    replace the packed bytes at the first one); the conversion's precision report is printed."""
    from dsv4_kernels.fp8_experts import from_packed
    from dsv4_kernels.mxfp4_fp8 import ConversionReport

    report = ConversionReport()
    for i, moe in enumerate(core.model.moe):
        pk = moe.packed
        if pk is None:
            raise ValueError("fp8 experts convert packed MXFP4 experts; this engine's are not packed")
        moe.fp8 = from_packed(
            pk.w1, pk.s1, pk.w2, pk.s2, pk.w3, pk.s3, report, f"layer {i} ", pow2_activations(cfg.quantization)
        )
    print(report.describe(), flush=True)


def fill_caches(core: EngineCore, gen: torch.Generator, chunk: int = 1 << 16) -> None:
    """Random rows in every cache group (SWA rings, compressed KV, indexer keys, compressor states).
    Quantised groups get packed rows of random values (random bytes would hold NaN codes and wild scales):
    `chunk` rows are encoded once and tiled over the layer."""
    for group in core.pool.groups.values():
        t = group.tensor
        for i in range(t.shape[0]):
            if group.quantised:
                rows = min(chunk, t.shape[1])
                packed = group.encode(torch.randn(rows, group.codec.dim, generator=gen, device=t.device))
                for start in range(0, t.shape[1], rows):
                    ids = torch.arange(start, min(start + rows, t.shape[1]), device=t.device)
                    group.write_packed(group.spec.layers[i], ids, packed[: ids.numel()])
                continue
            t[i].copy_(torch.randn(t[i].shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype))


def build_engine(
    raw: dict,
    device,
    dtype,
    max_requests: int,
    max_tokens: int,
    prefill_tokens: int,
    seed: int,
    expert_chunk: int,
    experts: str = "bf16",
    dense: str = "bf16",
    kv_cache: str = "auto",
    index_cache: str = "auto",
    prefill_chunk: int | None = None,
):
    """-> (cfg, EngineCore) with routed experts in format `experts` (EXPERT_FORMATS), dense projections as
    `dense` ("fp8" / "bf16", see build_weights), the KV cache as `kv_cache` resolves (`dsv4 serve`'s
    --kv-cache-dtype: auto = fp8 where FlashMLA decodes it) with indexer keys as `index_cache` resolves (auto = FP8
    on Hopper, else MXFP4), decode_mode "auto". prefill_chunk: the step's token budget (max_batch_tokens, at least
    max_requests), as a serving engine chunks a long prompt; None: the whole prefill in one step (at least 2048)."""
    budget = max(min(prefill_tokens, prefill_chunk), max_requests) if prefill_chunk else max(prefill_tokens, 2048)
    if experts not in ALL_EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {ALL_EXPERT_FORMATS}, got {experts!r}")
    cfg = ModelConfig.from_dict(raw)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = build_weights(cfg, device, dtype, gen, "mxfp4" if experts == "fp8" else experts, dense)
    kv_dtype, _ = resolve_kv_cache_dtype(kv_cache, device, dtype, cfg.head_dim, cfg.rope_dim, cfg.num_heads)
    index_dtype, _ = resolve_index_cache_dtype(index_cache, device)
    core = EngineCore(
        cfg,
        weights,
        device=device,
        dtype=dtype,
        cache_config=CacheConfig(
            max_requests=max_requests,
            max_tokens=max_tokens,
            page_tokens=256,
            kv_cache_dtype=kv_dtype,
            index_cache_dtype=index_dtype,
            staging_pages=STAGING_PAGES,
        ),
        scheduler_config=SchedulerConfig(max_batch_tokens=budget, max_num_seqs=max_requests),
    )
    del weights
    fill_experts(core, gen, expert_chunk)
    if experts == "fp8":
        add_fp8_experts(core, cfg)
    fill_caches(core, gen)
    sync(device)
    return cfg, core


def slice_description(c0: ModelConfig, dense: str = "bf16") -> str:
    """The report's one-line description of the slice."""
    return (
        f"{c0.num_layers} layers, compress_ratios {list(c0.compress_ratios)}, hash layers "
        f"{sum(c0.hash_layers)}, hidden {c0.hidden_size}, {c0.num_heads} heads x {c0.head_dim}, q_lora "
        f"{c0.q_lora_rank}, {c0.n_routed_experts} experts top-{c0.num_experts_per_tok} x "
        f"{c0.moe_intermediate_size} + {c0.n_shared_experts} shared, index {c0.index_n_heads} x "
        f"{c0.index_head_dim} top-{c0.index_topk}, window {c0.sliding_window}, vocab {c0.vocab_size}; "
        "random seeded weights: dense "
        + ("FP8, held as e4m3 + 128x128 scales (DeepGEMM)" if dense == "fp8" else "FP8-rounded, held as bf16")
        + "; routed experts as the experts column says"
    )
