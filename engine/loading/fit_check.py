"""Does the model fit? Checked before anything is allocated, with the numbers in the error.

need = this rank's weight bytes + the activation / CUDA-graph reserve (engine.loading.memory_plan.activation_reserve)
       + the minimum KV cache (one request of the full context: `--max-model-len`, plus the per-request
       SWA rings and compressor states of `--max-num-seqs` slots; or the `--max-cached-tokens` pool)
budget = min(utilization x device memory - what this process already holds, free device memory)

The weight bytes come from the safetensors headers alone (no tensor data is read): each tensor is laid out
as `engine.loading.weights.load_weights` returns it (dtype, FP8 / MXFP4 kept packed or dequantised) as a meta
tensor, and `engine.model.sharding.shard_weights` cuts those exactly as it cuts the real ones, so the count per
rank follows tensor and expert parallelism without a second copy of the split rules. On CUDA the budget is
read from the device; anywhere else a caller passes one (tests, planning a deployment from a laptop).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace

import torch

from engine.loading.memory_plan import DEFAULT_UTILIZATION, GIB, activation_reserve, pool_bytes
from engine.model.cache import CacheConfig
from engine.model.config import ModelConfig
from engine.model.parallel import ParallelContext


@dataclass(frozen=True)
class FitCheck:
    """One rank's memory need against its budget (bytes)."""

    weight_bytes: int
    reserve_bytes: int
    min_cache_bytes: int
    min_cache_tokens: int
    budget_bytes: int
    tp_size: int = 1
    expert_parallel: bool = False

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.reserve_bytes + self.min_cache_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.budget_bytes

    def describe(self) -> str:
        layout = f"tensor-parallel size {self.tp_size}" + (" with expert parallelism" if self.expert_parallel else "")
        return (
            f"{self.weight_bytes / GIB:.2f} GiB of weights per rank ({layout}) + {self.reserve_bytes / GIB:.2f} "
            f"GiB activation/CUDA-graph reserve + {self.min_cache_bytes / GIB:.2f} GiB minimum KV cache "
            f"({self.min_cache_tokens} tokens) = {self.need_bytes / GIB:.2f} GiB needed, "
            f"{self.budget_bytes / GIB:.2f} GiB available"
        )


def loaded_meta(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    dtype: torch.dtype,
    keep_mxfp4_experts: bool,
    keep_fp8: bool,
    fp8_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """What load_weights would return, as meta tensors (names, shapes, dtypes) read from the headers only."""
    return meta_from_stored(stored_tensors(model_dir), cfg, dtype, keep_mxfp4_experts, keep_fp8, fp8_experts)


def stored_tensors(model_dir: str | os.PathLike) -> dict[str, tuple]:
    """{original name: (safetensors dtype, stored shape)} from the checkpoint's headers (scales as `X.scale`)."""
    from safetensors import safe_open

    from engine.loading.weights import canonical_name, checkpoint_files

    stored: dict[str, tuple] = {}
    with contextlib.ExitStack() as stack:
        for path in checkpoint_files(model_dir):
            handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for raw in handle.keys():
                name = canonical_name(raw)
                if name is not None:
                    sl = handle.get_slice(raw)
                    stored[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    return stored


def meta_from_stored(
    stored: dict[str, tuple],
    cfg: ModelConfig,
    dtype: torch.dtype,
    keep_mxfp4_experts: bool,
    keep_fp8: bool,
    fp8_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """load_weights' output layout for checkpoint tensors `stored` (see stored_tensors), as meta tensors.
    fp8_experts: packed MXFP4 experts counted as the FP8 128x128 experts they convert to
    (engine.model.fp8_expert_weights: e4m3 [N, K] + fp32 [N/128, K/128], 2x the MXFP4 bytes), under the same
    names, so engine.model.sharding cuts them as it cuts FP8 weights."""
    from engine.loading.weights import expected_weight_shapes, keeps_fp32
    from engine.model.linear import keeps_fp8

    block = tuple(cfg.quantization.get("weight_block_size") or (128, 128))
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(cfg).items():
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        kind = _stored_kind(stored.get(name), shape) if base is not None and f"{base}.scale" in stored else None
        if kind == "mxfp4" and keep_mxfp4_experts and fp8_experts and _routed(name):
            out[name] = _meta(shape, torch.float8_e4m3fn)
            out[f"{base}.scale"] = _meta((math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)), torch.float32)
        elif kind == "mxfp4" and keep_mxfp4_experts and ".experts." in name and ".shared_experts." not in name:
            out[name] = _meta((shape[0], shape[1] // 2), torch.uint8)  # packed e2m1 bytes + UE8M0 scales
            out[f"{base}.scale"] = _meta((shape[0], shape[1] // 32), torch.uint8)
        elif kind == "fp8" and keep_fp8 and block == (128, 128) and keeps_fp8(name, shape, cfg.o_groups):
            out[name] = _meta(shape, torch.float8_e4m3fn)
            out[f"{base}.scale"] = _meta((math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)), torch.float32)
        elif name.endswith(".tid2eid"):
            out[name] = _meta(shape, torch.int64)
        else:
            out[name] = _meta(shape, torch.float32 if keeps_fp32(name) else dtype)
    return out


def _routed(name: str) -> bool:
    """A main layer's routed expert (the MTP layer's keep their format: engine.model.fp8_expert_weights)."""
    return name.startswith("layers.") and ".experts." in name and ".shared_experts." not in name


def _stored_kind(entry: tuple | None, shape: tuple) -> str | None:
    """A weight stored with a scale companion: "fp8" (e4m3, or bytes of the full shape) or "mxfp4"."""
    if entry is None or len(shape) != 2:
        return None
    dtype, stored = entry
    if dtype == "F8_E4M3" or (dtype in ("U8", "I8") and stored == shape):
        return "fp8"
    return "mxfp4" if dtype == "F4" or (dtype in ("U8", "I8") and stored == (shape[0], shape[1] // 2)) else None


def _meta(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def weight_bytes_per_rank(
    model_dir,
    cfg: ModelConfig,
    ctx: ParallelContext | None,
    dtype: torch.dtype,
    keep_mxfp4_experts: bool = False,
    keep_fp8: bool = False,
    meta: dict | None = None,
) -> int:
    """Bytes of the weights rank `ctx.rank` holds on its device (every rank holds the same amount)."""
    from engine.model.sharding import shard_weights

    meta = meta if meta is not None else loaded_meta(model_dir, cfg, dtype, keep_mxfp4_experts, keep_fp8)
    if ctx is not None and ctx.enabled:
        meta = shard_weights(meta, cfg, ctx, dtype)
    return sum(t.numel() * t.element_size() for t in meta.values())


def device_budget(device, utilization: float | None) -> int:
    """min(utilization x total - held by this process, free) of a CUDA device, in bytes."""
    util = DEFAULT_UTILIZATION if utilization is None else utilization
    if not 0.0 < util <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    dev = torch.device(device)
    free, total = torch.cuda.mem_get_info(dev)
    return int(min(util * total - torch.cuda.memory_allocated(dev), free))


def check_fit(
    model_dir,
    cfg: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    max_batch_tokens: int,
    budget_bytes: int,
    ctx: ParallelContext | None = None,
    keep_mxfp4_experts: bool = False,
    keep_fp8: bool = False,
    max_cached_tokens: int | None = None,
    utilization: float | None = None,
    meta: dict | None = None,
    expert_format: str = "mxfp4",
    speculative_tokens: int = 0,
) -> FitCheck:
    """-> the FitCheck when the model fits `budget_bytes`; else a ValueError with the numbers and what to change.
    `cfg.max_position_embeddings` is the context a request may reach (already capped by --max-model-len).
    meta: the loaded layout (loaded_meta / meta_from_stored) when known; default: read from model_dir.
    expert_format: "mxfp4", "fp8" (packed experts held as FP8 instead) or "both" (FP8 beside MXFP4)."""
    if meta is None:
        meta = loaded_meta(model_dir, cfg, dtype, keep_mxfp4_experts, keep_fp8, expert_format == "fp8")
    tp, ep = (ctx.tp_size, ctx.expert_parallel) if ctx is not None else (1, False)
    tokens = max_cached_tokens or cfg.max_position_embeddings
    weights = weight_bytes_per_rank(model_dir, cfg, ctx, dtype, meta=meta)
    if expert_format == "both":  # the FP8 copy beside the MXFP4 bytes: its experts' bytes on top
        fp8 = loaded_meta(model_dir, cfg, dtype, keep_mxfp4_experts, keep_fp8, True)
        weights += _expert_bytes(fp8, cfg, ctx, dtype)
    check = FitCheck(
        weights,
        activation_reserve(cfg, max_batch_tokens, cache.max_requests, expert_format != "mxfp4", speculative_tokens),
        pool_bytes(cfg, replace(cache, max_tokens=tokens), dtype),
        tokens,
        int(budget_bytes),
        tp,
        ep,
    )
    if check.fits:
        return check
    util = DEFAULT_UTILIZATION if utilization is None else utilization
    raise ValueError(
        f"the model does not fit: {check.describe()} (--gpu-memory-utilization {util:.2f}). "
        + _advice(check, meta, cfg, dtype, max_cached_tokens)
    )


def _expert_bytes(meta: dict, cfg: ModelConfig, ctx: ParallelContext | None, dtype: torch.dtype) -> int:
    """Bytes of the main layers' routed experts alone of a loaded layout, on this rank."""
    experts = {n: t for n, t in meta.items() if _routed(n)}
    return weight_bytes_per_rank(None, cfg, ctx, dtype, meta=experts)


def _advice(check: FitCheck, meta: dict, cfg: ModelConfig, dtype: torch.dtype, max_cached_tokens: int | None) -> str:
    """What would make it fit: more ranks (the smallest group that holds the weights), a shorter context, fewer
    sequences, FP8 caches, a higher utilization."""
    rest = check.reserve_bytes + check.min_cache_bytes
    tips, note = [], ""
    if rest >= check.budget_bytes:  # more ranks cut only the weights: each keeps the whole cache and reserve
        note = (
            " More ranks would not help: the reserve and the minimum cache alone exceed the budget, and every "
            "rank keeps both."
        )
    else:
        tips.append(_smallest_group(check, meta, cfg, dtype, rest))
    tips.append(
        f"a smaller --max-cached-tokens than {max_cached_tokens}"
        if max_cached_tokens
        else f"a shorter --max-model-len than {cfg.max_position_embeddings}"
    )
    tips.append(
        "fewer --max-num-seqs or --max-batch-tokens, --kv-cache-dtype fp8, or a higher --gpu-memory-utilization"
    )
    return "Try " + "; or ".join(tips) + "." + note


def _smallest_group(check: FitCheck, meta: dict, cfg: ModelConfig, dtype: torch.dtype, rest: int) -> str:
    """The smallest tensor-parallel size (with expert parallelism) whose per-rank weights fit beside `rest`."""
    from engine.model.sharding import check_divisible

    for tp in (2, 4, 8, 16, 32, 64):
        if tp <= check.tp_size:
            continue
        ctx = ParallelContext(tp, 0, True)
        try:
            check_divisible(cfg, ctx)
        except ValueError:
            continue
        if weight_bytes_per_rank(None, cfg, ctx, dtype, meta=meta) + rest <= check.budget_bytes:
            return f"--tensor-parallel-size {tp} --expert-parallel (one GPU a rank)"
    return "--tensor-parallel-size / --expert-parallel over more GPUs"


__all__ = [
    "FitCheck",
    "check_fit",
    "device_budget",
    "loaded_meta",
    "meta_from_stored",
    "stored_tensors",
    "weight_bytes_per_rank",
]
