"""Load one engine: resolve the model, size the caches, read the weights, build the `EngineCore`, warm it up.

`EngineOptions` is every setting a caller chooses (the CLI, the workers' `engine_options`, tests); `load_engine`
takes it (or field overrides) plus this rank's `ParallelContext`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from engine.execution.prefix_cache import STAGING_PAGES
from engine.execution.runner import EngineCore
from engine.execution.scheduler import SchedulerConfig
from engine.execution.spec_policy import DEFAULT_MAX_BATCH, SpecPolicy
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from engine.model.parallel import ParallelContext

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineOptions:
    """What one engine is built with (the model directory and the rank's parallel context aside).

    kv_cache_dtype: "exact" (rows in `dtype`), "fp8" (production formats: fp8_ds_mla SWA and compressed KV,
    MXFP4 or FP8 indexer keys as index_cache_dtype says; see engine.model.cache) or "auto" (fp8 on a bf16 CUDA
    engine where FlashMLA decodes the model's geometry, else exact: engine.model.fast_paths.resolve_kv_cache_dtype).
    index_cache_dtype: "mxfp4", "fp8" or "auto" (FP8 keys on Hopper, else MXFP4:
    engine.model.fast_paths.resolve_index_cache_dtype); only fp8 caches quantise the keys.
    keep_mxfp4_experts: keep MXFP4 routed experts packed in memory (run by triton_kernels or
    dsv4_kernels.triton_moe, see engine.model.moe) instead of dequantising them to `dtype`; None =
    `engine.model.fast_paths.keep_mxfp4_experts` (packed on a bf16 CUDA engine where triton_kernels runs).
    decode_mode: see EngineCore (None = "auto": CUDA graphs on CUDA with exact caches).
    keep_fp8_weights: keep FP8 dense projections as e4m3 + block scales for DeepGEMM's FP8 GEMM (no bf16
    copy); None = wherever that path runs (`engine.model.fast_paths.use_fp8_gemm`: bf16 on CUDA with deep_gemm).
    prefix_cache: reuse cached prompt prefixes across requests (engine.execution.prefix_cache); on by default.
    max_cached_tokens / gpu_memory_utilization: the KV pool's size (engine.loading.memory_plan): the former if
    given, else on CUDA what `gpu_memory_utilization` (default 0.90) of the GPU leaves after the weights, else
    65536. On CUDA, before any weight is read, engine.loading.fit_check compares this rank's weights + reserve +
    the minimum cache with that budget and raises a ValueError with the numbers when they do not fit.
    max_model_len: the longest request (prompt + output) served, at most the model's max_position_embeddings.
    warmup: a serving engine (the workers, the local dispatcher) compiles every kernel before it is returned
    (engine.execution.warmup: one-rank CUDA engines); one-shot use (LLM, `dsv4 generate`) does not.
    warmup_decodes: False for an engine that will only prefill (a prefill worker: no decode graphs captured).
    prefill_expert_format: "auto" | "mxfp4" | "fp8": the routed experts' format for prefill
    (engine.model.fast_paths.resolve_prefill_expert_format). "auto" converts packed MXFP4 experts to FP8 128x128 at
    load on a prefill-only engine (`warmup_decodes` False: the prefill worker's mark) of bf16 on CUDA with DeepGEMM,
    for its contiguous grouped FP8 GEMM (2x the expert bytes, counted by the fit check and the KV plan); "fp8" on an
    engine that decodes keeps both (FP8 for steps of >= FP8_EXPERT_MIN_TOKENS tokens).
    speculative_tokens: K draft tokens a step from the checkpoint's MTP layer (engine.execution.speculative;
    0 = off, 1..3); loads `mtp.*` only when on; steps made only of decode / verify chunks run the fixed-shape
    bucketed verify step (under CUDA graphs where decode_mode resolves to graphs; no overlapped decode).
    speculative_max_batch / speculative_min_acceptance: draft only in steps with at most this many decoding
    requests and while the acceptance estimate is at least this (engine.execution.spec_policy; the default batch
    comes from BENCHMARKS.md bench_spec). speculative_compare_rates: also draft only while drafting steps measure
    more tokens a second than plain ones at the same batch size (probing the other mode now and then).
    """

    device: str = "cpu"
    dtype: str | torch.dtype = "float32"
    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    max_cached_tokens: int | None = None
    page_tokens: int = 256
    kv_cache_dtype: str = "auto"
    index_cache_dtype: str = "auto"
    keep_mxfp4_experts: bool | None = None
    decode_mode: str | None = None
    keep_fp8_weights: bool | None = None
    prefix_cache: bool = True
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    warmup: bool = False
    warmup_decodes: bool = True
    speculative_tokens: int = 0
    speculative_max_batch: int = DEFAULT_MAX_BATCH
    speculative_min_acceptance: float = 0.0
    speculative_compare_rates: bool = True
    prefill_expert_format: str = "auto"


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_engine(
    model_dir: str | None = None,
    options: EngineOptions | None = None,
    *,
    parallel: ParallelContext | None = None,
    **fields,
) -> EngineCore:
    """Build one engine from `options` (default EngineOptions()) with `fields` overriding its fields by name
    (an unknown name is a TypeError naming it).
    model_dir: a directory or a Hugging Face repo id (engine.loading.model_source; None: the built-in model).
    parallel: this rank's tensor-parallel context: the loaded weights are cut for it (engine.model.sharding)."""
    o = dataclasses.replace(options or EngineOptions(), **fields)
    return _build(model_dir, o, parallel)


def _build(model_dir: str | None, o: EngineOptions, parallel: ParallelContext | None) -> EngineCore:
    from engine.execution.prefix_cache import PrefixCacheConfig, default_snapshot_slots
    from engine.execution.warmup import warm_engine, warmup_enabled
    from engine.loading.make_model import default_model_dir
    from engine.loading.memory_plan import cap_context, log_plan, plan_kv_tokens
    from engine.loading.model_source import local_model_dir
    from engine.loading.weights import load_weights
    from engine.model.fast_paths import keep_mxfp4_experts as keep_default
    from engine.model.fast_paths import (
        resolve_index_cache_dtype,
        resolve_kv_cache_dtype,
        resolve_prefill_expert_format,
        use_fp8_gemm,
    )

    model_dir = local_model_dir(model_dir) or default_model_dir()  # a worker lacking the path fetches it here
    cfg = cap_context(ModelConfig.from_model_dir(model_dir), o.max_model_len)
    torch_dtype = resolve_dtype(o.dtype)
    # what FlashMLA sees: a rank's heads (all of them under data-parallel attention)
    rank_heads = cfg.num_heads // parallel.attention.tp_size if parallel is not None else cfg.num_heads
    kv_cache_dtype, why = resolve_kv_cache_dtype(
        o.kv_cache_dtype, o.device, torch_dtype, cfg.head_dim, cfg.rope_dim, rank_heads
    )
    index_cache_dtype, index_why = resolve_index_cache_dtype(o.index_cache_dtype, o.device)
    if kv_cache_dtype == "fp8":
        logger.info("kv cache: fp8 (%s); indexer keys %s (%s)", why, index_cache_dtype, index_why)
    else:
        logger.info("kv cache: %s (%s)", kv_cache_dtype, why)
    cache_config = CacheConfig(
        max_requests=o.max_num_seqs,
        max_tokens=o.max_cached_tokens or 1,
        page_tokens=o.page_tokens,
        kv_cache_dtype=kv_cache_dtype,
        index_cache_dtype=index_cache_dtype,
        staging_pages=STAGING_PAGES if o.prefix_cache else 0,
    )
    keep = keep_default(o.device, torch_dtype) if o.keep_mxfp4_experts is None else o.keep_mxfp4_experts
    keep_fp8 = use_fp8_gemm(o.device, torch_dtype) if o.keep_fp8_weights is None else o.keep_fp8_weights
    expert_format, expert_why = resolve_prefill_expert_format(
        o.prefill_expert_format, o.device, torch_dtype, not o.warmup_decodes, keep
    )
    logger.info("routed experts: %s (%s)", expert_format, expert_why)
    if torch.device(o.device).type == "cuda":
        from engine.loading.fit_check import check_fit, device_budget
        from engine.telemetry.compile_watch import install_variant_log

        install_variant_log()  # from the first kernel on: a variant first needed while serving is named later

        fit = check_fit(
            model_dir,
            cfg,
            cache_config,
            torch_dtype,
            o.max_batch_tokens,
            device_budget(o.device, o.gpu_memory_utilization),
            parallel,
            keep,
            keep_fp8,
            o.max_cached_tokens,
            o.gpu_memory_utilization,
            expert_format=expert_format,
            speculative_tokens=o.speculative_tokens,
        )
        logger.info("memory: %s", fit.describe())
    if parallel is not None and parallel.enabled:
        from engine.loading.shard_reader import load_shard

        weights = load_shard(
            model_dir, cfg, parallel, torch_dtype, o.device, keep_mxfp4_experts=keep, keep_fp8=keep_fp8
        )
    else:
        weights = load_weights(
            model_dir,
            cfg,
            dtype=torch_dtype,
            device=o.device,
            keep_mxfp4_experts=keep,
            keep_fp8=keep_fp8,
            mtp=o.speculative_tokens > 0,
        )
    if expert_format != "mxfp4":  # before the KV plan: it sizes the pool from what the weights leave
        from engine.model.fp8_expert_weights import convert_expert_weights
        from engine.model.linear import pow2_activations

        convert_expert_weights(weights, cfg, expert_format, pow2_activations(cfg.quantization))
    slots = default_snapshot_slots(PrefixCacheConfig(), o.max_num_seqs) if o.prefix_cache else 0
    plan = plan_kv_tokens(
        cfg,
        cache_config,
        torch_dtype,
        o.device,
        o.max_batch_tokens,
        o.gpu_memory_utilization,
        o.max_cached_tokens,
        snapshot_slots=slots,
        fp8_experts=expert_format != "mxfp4",
        speculative_tokens=o.speculative_tokens,
    )
    log_plan(plan, cfg, o.max_num_seqs)
    cache_config = dataclasses.replace(cache_config, max_tokens=plan.tokens)
    scheduler_config = SchedulerConfig(max_batch_tokens=o.max_batch_tokens, max_num_seqs=o.max_num_seqs)
    core = EngineCore(
        cfg,
        weights,
        device=o.device,
        dtype=torch_dtype,
        parallel=parallel,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        decode_mode=o.decode_mode or "auto",
        prefix_cache=o.prefix_cache,
        speculative_tokens=o.speculative_tokens,
        speculative_policy=SpecPolicy(
            o.speculative_max_batch, o.speculative_min_acceptance, compare_rates=o.speculative_compare_rates
        ),
    )
    if o.warmup and warmup_enabled(
        core
    ):  # CUDA: compile before the first request waits on it (engine.execution.warmup)
        warm_engine(core, decodes=o.warmup_decodes)
    return core
