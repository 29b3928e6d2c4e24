"""Offline entry point: load a model directory and generate for a list of prompts as one batch."""

from __future__ import annotations

from engine.execution.request import GenerationOutput
from engine.execution.sampling_params import SamplingParams
from engine.loading.load import EngineOptions, load_engine
from engine.model.config import ModelConfig
from engine.model.parallel import ParallelContext


class LLM:
    def __init__(
        self,
        model_dir: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_cached_tokens: int | None = None,
        kv_cache_dtype: str = "auto",
        index_cache_dtype: str = "auto",
        keep_mxfp4_experts: bool | None = None,
        decode_mode: str | None = None,
        page_tokens: int = 256,
        prefix_cache: bool = True,
        tensor_parallel_size: int = 1,
        expert_parallel: bool = False,
        keep_fp8_weights: bool | None = None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        data_parallel_attention: bool = False,
        speculative_tokens: int = 0,
        prefill_expert_format: str = "auto",
    ):
        """tensor_parallel_size > 1: this process is rank 0 and spawns the other ranks (engine.execution.tp_launch);
        expert_parallel: routed experts split by expert id across them. data_parallel_attention (with both):
        each rank keeps the whole attention and runs its share of the prompts (engine.execution.dp_attention) instead of
        splitting heads. Call `close()` (or use `with`).
        model_dir: a directory or a Hugging Face repo id, resolved (fetched) once here, before ranks spawn."""
        from engine.loading.make_model import default_model_dir
        from engine.loading.model_source import local_model_dir

        model_dir = local_model_dir(model_dir) or default_model_dir()
        options = EngineOptions(
            device=device,
            dtype=dtype,
            max_batch_tokens=max_batch_tokens,
            max_num_seqs=max_num_seqs,
            max_cached_tokens=max_cached_tokens,
            page_tokens=page_tokens,
            kv_cache_dtype=kv_cache_dtype,
            index_cache_dtype=index_cache_dtype,
            keep_mxfp4_experts=keep_mxfp4_experts,
            decode_mode=decode_mode,
            prefix_cache=prefix_cache,
            keep_fp8_weights=keep_fp8_weights,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            speculative_tokens=speculative_tokens,
            prefill_expert_format=prefill_expert_format,
        )
        self.ranks = None
        if tensor_parallel_size > 1 or expert_parallel:
            from engine.execution.tp_launch import RankGroup
            from engine.model.sharding import check_divisible

            # Before spawning: a model the group cannot split fails here with one clear ValueError.
            check_divisible(
                ModelConfig.from_model_dir(model_dir),
                ParallelContext(
                    tensor_parallel_size, 0, expert_parallel, data_parallel_attention=data_parallel_attention
                ),
            )
            self.ranks = RankGroup.start(
                tensor_parallel_size,
                device,
                expert_parallel,
                load_engine,
                dict(model_dir=model_dir, options=options),
                data_parallel_attention,
            )
            try:
                self.engine = load_engine(model_dir, options, parallel=self.ranks.context)
            except BaseException:
                self.ranks.close(None)
                raise
        else:
            self.engine = load_engine(model_dir, options)
        self.config = self.engine.cfg

    def close(self) -> None:
        """Release the other tensor-parallel ranks (nothing to do on one rank)."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close(self.engine)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[GenerationOutput]:
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
        from engine.execution.dp_attention import dp_generate

        try:
            return dp_generate(self.engine, prompts, params)
        except BaseException:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
            if self.ranks is not None:  # the other ranks may wait inside a step's exchanges: end them
                ranks, self.ranks = self.ranks, None
                ranks.close(None)
            raise
