"""How each weight of a loaded DeepSeek V4 checkpoint is split across tensor-parallel ranks.

`shard_weights(weights, cfg, ctx, dtype)` takes what `engine.weights.load_weights` returns (original
names; FP8 projections possibly kept as e4m3 `X.weight` + fp32 `X.scale`; MXFP4 experts possibly kept
as uint8 bytes + UE8M0 `X.scale`) and returns this rank's dict, same names, local shapes. The split
follows the production V4 model (TokenSpeed's `deepseek_v4.py`):

- attention heads: `wq_b` column-parallel (rank r keeps heads [r H/tp, (r+1) H/tp)), `attn_sink` sliced
  alike; the grouped output projection keeps whole groups: `wo_a` column-parallel by group (o_groups / tp
  groups a rank, exactly the groups of its heads), `wo_b` row-parallel (its input is those groups'
  outputs), so a rank's attention output is a partial sum: one all-reduce (ParallelContext.all_reduce).
- replicated: `wq_a`, `q_norm`, `wkv` + `norm` (the MQA KV latent: one K=V row shared by every head),
  the compressor and the whole indexer (its heads score entries for all query heads together), mHC,
  norms, the router (gate, bias, tid2eid). So every rank computes and caches the same compressed KV,
  indexer keys and compressor state: the KV cache is NOT split by TP (see engine.tp_executor).
- shared expert: `w1`/`w3` column-parallel, `w2` row-parallel (its partial sum joins the MoE block's).
- routed experts: with expert parallelism rank r keeps whole experts [r E/tp, (r+1) E/tp) (the others are
  dropped); without it every expert is split like the shared one (intermediate dim, vLLM's TP MoE).
  Either way the MoE block's output is a partial sum: one all-reduce per block.
- vocab: `embed` and `head` split by rows (ceil(V/tp) a rank): a masked lookup + all-reduce for the
  embedding, local logits + all-gather for the head.

Quantised tensors are cut on their block grid: FP8 along 128-blocks (weight rows/cols and the matching
scale blocks), MXFP4 along 32-element blocks of K. A split that does not fall on block boundaries
dequantises that one tensor to `dtype` first (correct, but it loses the compact format; a ValueError
would stop models the engine can run).
"""

from __future__ import annotations

import re

import torch

from engine.config import ModelConfig
from engine.parallel import ParallelContext
from kernels.fp8_linear import BLOCK as FP8_BLOCK, Fp8Weight
from kernels.quant import MXFP4_BLOCK, dequant_mxfp4

# (pattern, dim): split on `dim` into tp equal contiguous parts.
_COLUMN = re.compile(r"\.attn\.(?:wq_b|wo_a)\.weight$|\.attn\.attn_sink$|\.shared_experts\.w[13]\.weight$")
_ROW = re.compile(r"\.attn\.wo_b\.weight$|\.shared_experts\.w2\.weight$")
_INDEXER = re.compile(r"\.attn\.indexer\.")
_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_VOCAB = ("embed.weight", "head.weight")


def check_divisible(cfg: ModelConfig, ctx: ParallelContext) -> None:
    """ValueError naming the first dimension the group size does not split."""
    ctx.local(cfg.num_heads, "num_attention_heads")
    ctx.local(cfg.o_groups, "o_groups")
    if cfg.n_shared_experts:
        ctx.local(cfg.moe_intermediate_size * cfg.n_shared_experts, "shared expert intermediate size")
    if ctx.expert_parallel:
        ctx.local(cfg.n_routed_experts, "n_routed_experts")
    else:
        ctx.local(cfg.moe_intermediate_size, "moe_intermediate_size")


def shard_weights(weights: dict, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> dict:
    """Full loaded weights -> this rank's weights (see the module docstring). tp_size 1: returned as is."""
    if not ctx.enabled:
        return weights
    check_divisible(cfg, ctx)
    keep_experts = ctx.expert_range(cfg.n_routed_experts)
    out: dict = {}
    for name, t in weights.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in weights:
            continue  # cut together with its weight below
        m = _EXPERT.match(name)
        if m is not None and int(m.group(1)) not in keep_experts:
            continue
        dim = _split_dim(name, m is not None, ctx)
        if name in _VOCAB:
            out[name] = _vocab_rows(t, ctx)
        elif dim is None:
            out[name] = t
            scale = _scale_name(name)
            if scale in weights:
                out[scale] = weights[scale]
        else:
            out.update(_cut(name, t, weights.get(_scale_name(name)), dim, ctx, dtype))
    return out


def skips_unowned(cfg: ModelConfig, ctx: ParallelContext):
    """For `load_weights(skip=...)`: True for the routed experts this rank does not hold (never read), so an
    expert-parallel rank loads 1/tp of the experts, which are nearly all of V4's bytes. None = read all."""
    owned = ctx.expert_range(cfg.n_routed_experts)
    if len(owned) == cfg.n_routed_experts:
        return None

    def skip(name: str) -> bool:
        m = _EXPERT.match(name)
        return m is not None and int(m.group(1)) not in owned

    return skip


def load_shard(model_dir, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, device, **load_kwargs) -> dict:
    """This rank's weights, read from the checkpoint: the routed experts of other expert-parallel ranks are never
    read; the rest is read into host memory, cut (`shard_weights`) and only the cut moves to `device`, so a GPU
    never holds more than its shard. load_kwargs: `engine.weights.load_weights` options (keep_fp8, ...)."""
    from engine.weights import load_weights

    host = load_weights(model_dir, cfg, dtype=dtype, device="cpu", skip=skips_unowned(cfg, ctx), **load_kwargs)
    return {name: t.to(device) for name, t in shard_weights(host, cfg, ctx, dtype).items()}


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def _split_dim(name: str, is_expert: bool, ctx: ParallelContext) -> int | None:
    if _INDEXER.search(name):
        return None
    if is_expert:
        if ctx.expert_parallel:
            return None  # whole experts; the ones this rank does not own were dropped
        return 1 if name.endswith("w2.weight") else 0
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def _vocab_rows(t: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """This rank's ceil(V/tp) rows, zero-padded past the vocab so every rank's shard has one shape."""
    v = t.shape[0]
    rows = ctx.padded_range(v)
    width = -(-v // ctx.tp_size)
    local = t[rows.start:rows.stop]
    if local.shape[0] < width:
        local = torch.cat([local, local.new_zeros(width - local.shape[0], *t.shape[1:])])
    return local.contiguous()


def _slice(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    n = t.shape[dim] // parts
    return t.narrow(dim, rank * n, n).contiguous()


def _cut(name: str, t: torch.Tensor, scale: torch.Tensor | None, dim: int, ctx: ParallelContext,
         dtype: torch.dtype) -> dict:
    """One tensor (and its scale companion) -> this rank's part on `dim`, on the block grid when quantised."""
    tp, r = ctx.tp_size, ctx.rank
    if t.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of {tuple(t.shape)} is not divisible by tensor parallel size {tp}")
    local = t.shape[dim] // tp
    if scale is None:
        return {name: _slice(t, dim, r, tp)}
    sname = _scale_name(name)
    if t.dtype == torch.float8_e4m3fn:
        if local % FP8_BLOCK == 0:
            return {name: _slice(t, dim, r, tp), sname: _slice(scale, dim, r, tp)}
        return {name: _slice(Fp8Weight(t, scale.float()).dequant(dtype), dim, r, tp)}
    if t.dtype == torch.uint8:  # MXFP4 bytes [N, K/2] + UE8M0 scales [N, K/32]: two values a byte on K
        if dim == 0 or (2 * local) % MXFP4_BLOCK == 0:
            return {name: _slice(t, dim, r, tp), sname: _slice(scale, dim, r, tp)}
        return {name: _slice(dequant_mxfp4(t, scale).to(dtype), dim, r, tp)}
    raise ValueError(f"{name}: cannot shard a {t.dtype} tensor with a scale companion")
