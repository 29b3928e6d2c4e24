"""Offline entry point: load a model directory and generate for a list of prompts as one batch."""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.cache import CacheConfig
from engine.config import ModelConfig
from engine.parallel import ParallelContext
from engine.prefix_cache import STAGING_PAGES
from engine.request import GenerationOutput
from engine.runner import EngineCore
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_engine(model_dir: str | None = None, device: str = "cpu", dtype: str | torch.dtype = "float32",
                max_batch_tokens: int = 2048, max_num_seqs: int = 64, max_cached_tokens: int | None = None,
                page_tokens: int = 256, kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto",
                keep_mxfp4_experts: bool | None = None, decode_mode: str | None = None,
                keep_fp8_weights: bool | None = None, prefix_cache: bool = True,
                parallel: ParallelContext | None = None, gpu_memory_utilization: float | None = None,
                max_model_len: int | None = None, warmup: bool = False, warmup_decodes: bool = True) -> EngineCore:
    """kv_cache_dtype: "exact" (rows in `dtype`), "fp8" (production formats: fp8_ds_mla SWA and compressed KV,
    MXFP4 or FP8 indexer keys as index_cache_dtype says; see engine.cache) or "auto" (fp8 on a bf16 CUDA engine
    where FlashMLA decodes the model's geometry, else exact: engine.fast_paths.resolve_kv_cache_dtype).
    index_cache_dtype: "mxfp4", "fp8" or "auto" (FP8 keys on Hopper, else MXFP4:
    engine.fast_paths.resolve_index_cache_dtype); only fp8 caches quantise the keys.
    keep_mxfp4_experts: keep MXFP4 routed experts packed in memory (run by triton_kernels or dsv4_kernels.triton_moe,
    see engine.moe) instead of dequantising them to `dtype`; None = `engine.fast_paths.keep_mxfp4_experts` (packed
    on a bf16 CUDA engine where triton_kernels runs; $DSV4_MXFP4_MOE=1/0 forces it).
    decode_mode: see EngineCore (None = "auto": CUDA graphs on CUDA with exact caches).
    keep_fp8_weights: keep FP8 dense projections as e4m3 + block scales for DeepGEMM's FP8 GEMM (no bf16
    copy); None = wherever that path runs (`engine.fast_paths.use_fp8_gemm`: bf16 on CUDA with deep_gemm).
    prefix_cache: reuse cached prompt prefixes across requests (engine.prefix_cache); on by default.
    parallel: this rank's tensor-parallel context: the loaded weights are cut for it (engine.sharding).
    max_cached_tokens / gpu_memory_utilization: the KV pool's size (engine.memory_plan): the former if given,
    else on CUDA what `gpu_memory_utilization` (default 0.90) of the GPU leaves after the weights, else 65536.
    On CUDA, before any weight is read, engine.fit_check compares this rank's weights + reserve + the minimum
    cache with that budget and raises a ValueError with the numbers when they do not fit.
    model_dir: a directory or a Hugging Face repo id (engine.model_source; None: the built-in tiny model).
    max_model_len: the longest request (prompt + output) served, at most the model's max_position_embeddings.
    warmup: a serving engine (the workers, the local dispatcher) compiles every kernel before it is returned
    (engine.warmup: one-rank CUDA engines; $DSV4_WARMUP=0 skips it); one-shot use (LLM, `dsv4 generate`) does not.
    warmup_decodes: False for an engine that will only prefill (a prefill worker: no decode graphs captured)."""
    from engine.fast_paths import keep_mxfp4_experts as keep_default
    from engine.fast_paths import resolve_index_cache_dtype, resolve_kv_cache_dtype, use_fp8_gemm
    from engine.make_model import default_model_dir
    from engine.memory_plan import cap_context, log_plan, plan_kv_tokens
    from engine.prefix_cache import PrefixCacheConfig, default_snapshot_slots
    from engine.model_source import local_model_dir
    from engine.warmup import warm_engine, warmup_enabled
    from engine.weights import load_weights

    model_dir = local_model_dir(model_dir) or default_model_dir()  # a worker lacking the path fetches it here
    cfg = cap_context(ModelConfig.from_model_dir(model_dir), max_model_len)
    # what FlashMLA sees: a rank's heads (all of them under data-parallel attention)
    rank_heads = cfg.num_heads // parallel.attention.tp_size if parallel is not None else cfg.num_heads
    kv_cache_dtype, why = resolve_kv_cache_dtype(kv_cache_dtype, device, resolve_dtype(dtype), cfg.head_dim,
                                                 cfg.rope_dim, rank_heads)
    index_cache_dtype, index_why = resolve_index_cache_dtype(index_cache_dtype, device)
    if kv_cache_dtype == "fp8":
        logger.info("kv cache: fp8 (%s); indexer keys %s (%s)", why, index_cache_dtype, index_why)
    else:
        logger.info("kv cache: %s (%s)", kv_cache_dtype, why)
    cache_config = CacheConfig(max_requests=max_num_seqs, max_tokens=max_cached_tokens or 1, page_tokens=page_tokens,
                               kv_cache_dtype=kv_cache_dtype, index_cache_dtype=index_cache_dtype,
                               staging_pages=STAGING_PAGES if prefix_cache else 0)
    torch_dtype = resolve_dtype(dtype)
    keep = keep_default(device, torch_dtype) if keep_mxfp4_experts is None else keep_mxfp4_experts
    keep_fp8 = use_fp8_gemm(device, torch_dtype) if keep_fp8_weights is None else keep_fp8_weights
    if torch.device(device).type == "cuda":
        from engine.compile_watch import install_variant_log
        from engine.fit_check import check_fit, device_budget

        install_variant_log()  # from the first kernel on: a variant first needed while serving is named later

        fit = check_fit(model_dir, cfg, cache_config, torch_dtype, max_batch_tokens,
                        device_budget(device, gpu_memory_utilization), parallel, keep, keep_fp8, max_cached_tokens,
                        gpu_memory_utilization)
        logger.info("memory: %s", fit.describe())
    if parallel is not None and parallel.enabled:
        from engine.shard_reader import load_shard

        weights = load_shard(model_dir, cfg, parallel, torch_dtype, device, keep_mxfp4_experts=keep, keep_fp8=keep_fp8)
    else:
        weights = load_weights(model_dir, cfg, dtype=torch_dtype, device=device, keep_mxfp4_experts=keep,
                               keep_fp8=keep_fp8)
    slots = default_snapshot_slots(PrefixCacheConfig(), max_num_seqs) if prefix_cache else 0
    plan = plan_kv_tokens(cfg, cache_config, torch_dtype, device, max_batch_tokens, gpu_memory_utilization,
                          max_cached_tokens, snapshot_slots=slots)
    log_plan(plan, cfg, max_num_seqs)
    cache_config = dataclasses.replace(cache_config, max_tokens=plan.tokens)
    core = EngineCore(cfg, weights, device=device, dtype=torch_dtype, parallel=parallel,
                      cache_config=cache_config,
                      scheduler_config=SchedulerConfig(max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs),
                      decode_mode=decode_mode or "auto", prefix_cache=prefix_cache)
    if warmup and warmup_enabled(core):  # CUDA: compile before the first request waits on it (engine.warmup)
        warm_engine(core, decodes=warmup_decodes)
    return core


class LLM:
    def __init__(self, model_dir: str | None = None, device: str = "cpu", dtype: str = "float32",
                 max_batch_tokens: int = 2048, max_num_seqs: int = 64, max_cached_tokens: int | None = None,
                 kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto",
                 keep_mxfp4_experts: bool | None = None, decode_mode: str | None = None,
                 page_tokens: int = 256, prefix_cache: bool = True, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False, keep_fp8_weights: bool | None = None,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 data_parallel_attention: bool = False):
        """tensor_parallel_size > 1: this process is rank 0 and spawns the other ranks (engine.tp_launch);
        expert_parallel: routed experts split by expert id across them. data_parallel_attention (with both):
        each rank keeps the whole attention and runs its share of the prompts (engine.dp_attention) instead of
        splitting heads. Call `close()` (or use `with`).
        model_dir: a directory or a Hugging Face repo id, resolved (fetched) once here, before ranks spawn."""
        from engine.make_model import default_model_dir
        from engine.model_source import local_model_dir

        kwargs = dict(model_dir=local_model_dir(model_dir) or default_model_dir(), device=device, dtype=dtype,
                      max_batch_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                      max_cached_tokens=max_cached_tokens, page_tokens=page_tokens, kv_cache_dtype=kv_cache_dtype,
                      index_cache_dtype=index_cache_dtype, keep_mxfp4_experts=keep_mxfp4_experts,
                      decode_mode=decode_mode, prefix_cache=prefix_cache, keep_fp8_weights=keep_fp8_weights,
                      gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len)
        self.ranks = None
        if tensor_parallel_size > 1 or expert_parallel:
            from engine.sharding import check_divisible
            from engine.tp_launch import RankGroup

            # Before spawning: a model the group cannot split fails here with one clear ValueError.
            check_divisible(ModelConfig.from_model_dir(kwargs["model_dir"]),
                            ParallelContext(tensor_parallel_size, 0, expert_parallel,
                                            data_parallel_attention=data_parallel_attention))
            self.ranks = RankGroup.start(tensor_parallel_size, device, expert_parallel, load_engine, kwargs,
                                         data_parallel_attention)
            try:
                self.engine = load_engine(**kwargs, parallel=self.ranks.context)
            except BaseException:
                self.ranks.close(None)
                raise
        else:
            self.engine = load_engine(**kwargs)
        self.config = self.engine.cfg

    def close(self) -> None:
        """Release the other tensor-parallel ranks (nothing to do on one rank)."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close(self.engine)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """All prompts run as one continuous batch; outputs come back in prompt order."""
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        grouped = self.engine.parallel.enabled or self.engine.data_parallel is not None
        if grouped and self.ranks is None:
            raise RuntimeError("this LLM's tensor-parallel ranks were released (close() or a failed step)")
        for prompt, p in zip(prompts, plist):  # validate everything before anything is admitted
            self.engine.validate(list(prompt), p)
        if self.engine.data_parallel is not None:
            return self._generate_dp([list(p) for p in prompts], plist)
        ids = [self.engine.add_request(list(prompt), p) for prompt, p in zip(prompts, plist)]
        try:
            while self.engine.has_work:
                self.engine.step()
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            if self.ranks is not None:  # the other ranks may wait inside this step's collectives: end them
                ranks, self.ranks = self.ranks, None
                ranks.close(None)
            raise
        return [self.engine.pop_finished(rid).to_output() for rid in ids]

    def _generate_dp(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
        from engine.dp_attention import dp_generate

        try:
            return dp_generate(self.engine, prompts, params)
        except BaseException:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            if self.ranks is not None:  # the other ranks may wait inside a step's exchanges: end them
                ranks, self.ranks = self.ranks, None
                ranks.close(None)
            raise
