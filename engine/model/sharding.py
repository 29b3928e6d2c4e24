"""How each weight of a loaded DeepSeek V4 checkpoint is split across tensor-parallel ranks.

The rules live here once: `cut_of(name, shape, ctx, o_groups)` says which part of a tensor a rank keeps (a
`Cut`: one dimension's [start, stop), in logical elements) and `owns` which routed experts it holds.
Two callers apply them: `shard_weights` cuts tensors already in memory, and `engine.loading.shard_reader` reads
only the cut (widened to the on-disk block grid) from the safetensors files, then finishes it with the
same `cut_tensor`, so both give identical tensors.

`shard_weights(weights, cfg, ctx, dtype)` takes what `engine.loading.weights.load_weights` returns (original
names; FP8 projections possibly kept as e4m3 `X.weight` + fp32 `X.scale`; MXFP4 experts possibly kept
as uint8 bytes + UE8M0 `X.scale`) and returns this rank's dict, same names, local shapes. The split
follows the production V4 model (TokenSpeed's `deepseek_v4.py`):

- attention heads: `wq_b` column-parallel (rank r keeps heads [r H/tp, (r+1) H/tp)), `attn_sink` sliced
  alike; the grouped output projection keeps whole groups: `wo_a` column-parallel by group (o_groups / tp
  groups a rank, exactly the groups of its heads), `wo_b` row-parallel (its input is those groups'
  outputs), so a rank's attention output is a partial sum: one all-reduce (ParallelContext.all_reduce).
  With fewer groups than ranks (o_groups divides tp) a group's heads span tp / o_groups ranks: a rank keeps
  its group's rows of `wo_a` and, of those, the columns of its own heads (a second cut, `head_cut_of`), and
  its group's columns of `wo_b`; nothing nonlinear lies between the two, so the partial sums still add up.
- replicated: `wq_a`, `q_norm`, `wkv` + `norm` (the MQA KV latent: one K=V row shared by every head),
  the compressor and the whole indexer (its heads score entries for all query heads together), mHC,
  norms, the router (gate, bias, tid2eid). So every rank computes and caches the same compressed KV,
  indexer keys and compressor state: the KV cache is NOT split by TP (see engine.execution.tp_executor).
- shared expert: `w1`/`w3` column-parallel, `w2` row-parallel (its partial sum joins the MoE block's).
- routed experts: with expert parallelism rank r keeps whole experts [r E/tp, (r+1) E/tp) (the others are
  dropped); without it every expert is split like the shared one (intermediate dim, vLLM's TP MoE).
  Either way the MoE block's output is a partial sum: one all-reduce per block.
- vocab: `embed` and `head` split by rows (ceil(V/tp) a rank): a masked lookup + all-reduce for the
  embedding, local logits + all-gather for the head.
- data-parallel attention (ParallelContext.data_parallel_attention, engine.execution.dp_attention): nothing is cut;
  each rank keeps every tensor whole except the routed experts of the other ranks.

Quantised tensors are cut on their block grid: FP8 along 128-blocks (weight rows/cols and the matching
scale blocks), MXFP4 along 32-element blocks of K. A split that does not fall on block boundaries
dequantises that one tensor to `dtype` first (correct, but it loses the compact format; a ValueError
would stop models the engine can run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dsv4_kernels.fp8_linear import BLOCK as FP8_BLOCK
from dsv4_kernels.fp8_linear import Fp8Weight
from dsv4_kernels.quant import MXFP4_BLOCK, dequant_mxfp4
from engine.model.config import ModelConfig
from engine.model.parallel import ParallelContext

_COLUMN = re.compile(r"\.attn\.(?:wq_b|wo_a)\.weight$|\.attn\.attn_sink$|\.shared_experts\.w[13]\.weight$")
_ROW = re.compile(r"\.attn\.wo_b\.weight$|\.shared_experts\.w2\.weight$")
_GROUPED = re.compile(r"\.attn\.wo_[ab]\.weight$")
_INDEXER = re.compile(r"\.attn\.indexer\.")
_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_VOCAB = ("embed.weight", "head.weight")


@dataclass(frozen=True)
class Cut:
    """A rank's part of one tensor: [start, stop) of dimension `dim` (length `size`), zero-padded to `width`
    rows (only the vocab's last rank pads). Counted in logical elements: an MXFP4 tensor's K counts values,
    not packed bytes."""

    dim: int
    start: int
    stop: int
    size: int
    width: int

    def on_grid(self, block: int) -> bool:
        """Quantised bytes and their scales cut exactly: the cut starts and spans whole `block`s, no padding."""
        length = self.stop - self.start
        return self.start % block == 0 and length % block == 0 and self.width == length

    def per(self, unit: int) -> Cut:
        """The same cut counted in units of `unit` elements (packed bytes: 2, scale blocks: the block)."""
        return Cut(self.dim, self.start // unit, self.stop // unit, -(-self.size // unit), self.width // unit)

    def covering(self, block: int) -> tuple[int, int]:
        """The smallest [lo, hi) on whole `block`s (the last one may be ragged) that contains the cut."""
        return self.start // block * block, min(self.size, -(-self.stop // block) * block)

    def take(self, t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The cut of `t`, where t holds elements [offset, ...) of the dimension (the whole tensor: 0)."""
        local = t.narrow(self.dim, self.start - offset, self.stop - self.start)
        short = self.width - local.shape[self.dim]
        if short:
            pad = list(local.shape)
            pad[self.dim] = short
            local = torch.cat([local, local.new_zeros(pad)], dim=self.dim)
        return local.contiguous()


def check_divisible(cfg: ModelConfig, ctx: ParallelContext) -> None:
    """ValueError naming the first dimension the group size does not split."""
    if ctx.data_parallel_attention:  # only the routed experts are split
        ctx.local(cfg.n_routed_experts, "n_routed_experts")
        return
    ctx.local(cfg.num_heads, "num_attention_heads")
    ctx.local_groups(cfg.o_groups, "o_groups")
    if cfg.n_shared_experts:
        ctx.local(cfg.moe_intermediate_size * cfg.n_shared_experts, "shared expert intermediate size")
    if ctx.expert_parallel:
        ctx.local(cfg.n_routed_experts, "n_routed_experts")
    else:
        ctx.local(cfg.moe_intermediate_size, "moe_intermediate_size")


# ---- the rules ----------------------------------------------------------------------------------
def owns(name: str, cfg: ModelConfig, ctx: ParallelContext) -> bool:
    """False only for a routed expert tensor (weight or scale) of an expert another rank holds."""
    m = _EXPERT.match(name)
    return m is None or int(m.group(1)) in ctx.expert_range(cfg.n_routed_experts)


def cut_of(name: str, shape: tuple[int, ...], ctx: ParallelContext, o_groups: int = 0) -> Cut | None:
    """This rank's cut of weight `name` of logical `shape` (dequantised shape; see `logical_shape`);
    None = the rank keeps it whole (replicated, or one of its whole experts). Under data-parallel attention
    every tensor a rank keeps is whole: the routed experts are split by id alone (`owns`). o_groups: the
    model's output groups (wo_a / wo_b are cut by group when there are fewer groups than ranks)."""
    if not ctx.enabled or ctx.data_parallel_attention:
        return None
    if _spans_ranks(o_groups, ctx) and _GROUPED.search(name):
        gdim = 0 if name.endswith("wo_a.weight") else 1  # wo_a: the group's rows; wo_b: its input columns
        width = shape[gdim] // o_groups
        group = ctx.rank // (ctx.tp_size // o_groups)
        return Cut(gdim, group * width, (group + 1) * width, shape[gdim], width)
    if name in _VOCAB:
        rows = ctx.padded_range(shape[0])
        return Cut(0, rows.start, rows.stop, shape[0], -(-shape[0] // ctx.tp_size))
    dim = _split_dim(name, _EXPERT.match(name) is not None, ctx)
    if dim is None:
        return None
    if shape[dim] % ctx.tp_size:
        raise ValueError(f"{name}: dim {dim} of {tuple(shape)} is not divisible by tensor parallel size {ctx.tp_size}")
    local = shape[dim] // ctx.tp_size
    return Cut(dim, ctx.rank * local, (ctx.rank + 1) * local, shape[dim], local)


def head_cut_of(name: str, shape: tuple[int, ...], ctx: ParallelContext, o_groups: int) -> Cut | None:
    """wo_a's second cut when a group spans ranks: of the group's input columns (its heads x head_dim), the
    ones of this rank's heads. None otherwise."""
    if (
        not ctx.enabled
        or ctx.data_parallel_attention
        or not _spans_ranks(o_groups, ctx)
        or not name.endswith(".attn.wo_a.weight")
    ):
        return None
    parts = ctx.tp_size // o_groups
    width = shape[1] // parts
    part = ctx.rank % parts
    return Cut(1, part * width, (part + 1) * width, shape[1], width)


def _spans_ranks(o_groups: int, ctx: ParallelContext) -> bool:
    return 0 < o_groups < ctx.tp_size and ctx.tp_size % o_groups == 0


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


def scale_name(name: str) -> str:
    """`X.weight` -> `X.scale`, the companion holding a quantised weight's block scales."""
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def logical_shape(t: torch.Tensor, scale: torch.Tensor | None) -> tuple[int, ...]:
    """A loaded tensor's dequantised shape: MXFP4 bytes kept packed hold two values a byte on K."""
    if scale is not None and t.dtype == torch.uint8:
        return (*t.shape[:-1], 2 * t.shape[-1])
    return tuple(t.shape)


# ---- applying a cut ---------------------------------------------------------------------------------
def cut_tensor(
    name: str, t: torch.Tensor, scale: torch.Tensor | None, cut: Cut | None, dtype: torch.dtype, offset: int = 0
) -> dict:
    """One loaded tensor (and its scale companion) -> this rank's entries, on the block grid when quantised.

    t may be a window of the whole tensor holding elements [offset, ...) of `cut.dim` (engine.loading.shard_reader
    reads the cut widened to whole blocks); a window must start on the block grid of the stored format.
    """
    sname = scale_name(name)
    if cut is None:
        return {name: t} if scale is None else {name: t, sname: scale}
    if scale is None:
        return {name: cut.take(t, offset)}
    if t.dtype == torch.float8_e4m3fn:  # e4m3 [N, K] + fp32 scales [N/128, K/128]
        if cut.on_grid(FP8_BLOCK):
            return {name: cut.take(t, offset), sname: cut.per(FP8_BLOCK).take(scale, offset // FP8_BLOCK)}
        return {name: cut.take(Fp8Weight(t, scale.float()).dequant(dtype), offset)}
    if t.dtype == torch.uint8:  # MXFP4 bytes [N, K/2] + UE8M0 scales [N, K/32]: two values a byte on K
        on_k = cut.dim == t.dim() - 1
        block, unit = (MXFP4_BLOCK, 2) if on_k else (1, 1)
        if cut.on_grid(block):
            return {name: cut.per(unit).take(t, offset // unit), sname: cut.per(block).take(scale, offset // block)}
        return {name: cut.take(dequant_mxfp4(t, scale).to(dtype), offset)}
    raise ValueError(f"{name}: cannot shard a {t.dtype} tensor with a scale companion")


def shard_weights(weights: dict, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype) -> dict:
    """Full loaded weights -> this rank's weights (see the module docstring). tp_size 1: returned as is."""
    if not ctx.enabled:
        return weights
    check_divisible(cfg, ctx)
    out: dict = {}
    for name, t in weights.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in weights:
            continue  # cut together with its weight below
        if not owns(name, cfg, ctx):
            continue
        scale = weights.get(scale_name(name))
        shape = logical_shape(t, scale)
        part = cut_tensor(name, t, scale, cut_of(name, shape, ctx, cfg.o_groups), dtype)
        out.update(cut_heads_of_group(name, part, shape, ctx, cfg.o_groups, dtype))
    return out


def cut_heads_of_group(
    name: str, part: dict, shape: tuple[int, ...], ctx: ParallelContext, o_groups: int, dtype: torch.dtype
) -> dict:
    """`part` (cut_tensor's entries for `name`) after `head_cut_of`'s second cut, where there is one."""
    cut = head_cut_of(name, shape, ctx, o_groups)
    if cut is None:
        return part
    return cut_tensor(name, part[name], part.get(scale_name(name)), cut, dtype)


def skips_unowned(cfg: ModelConfig, ctx: ParallelContext):
    """For `load_weights(skip=...)`: True for the routed experts this rank does not hold (never read), so an
    expert-parallel rank loads 1/tp of the experts, which are nearly all of V4's bytes. None = read all."""
    if len(ctx.expert_range(cfg.n_routed_experts)) == cfg.n_routed_experts:
        return None
    return lambda name: not owns(name, cfg, ctx)
