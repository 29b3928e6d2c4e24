"""A tensor-parallel rank's weights read straight from the checkpoint: only its shard of each tensor.

For every tensor the rank keeps, `engine.model.sharding.cut_of` gives the cut (the one rule the in-memory
`shard_weights` applies too); the rank reads that cut widened to the stored block grid (FP8 128x128 scale
blocks, MXFP4 32-value blocks along K: `Checkpoint.grid`) through safetensors' `get_slice`, converts the
window exactly as a whole-tensor load would (dequantise, or keep e4m3 / packed MXFP4 bytes), and finishes it
with `engine.model.sharding.cut_tensor`. Elementwise conversions commute with slicing, so the result equals
`shard_weights(load_weights(...))` bit for bit, while a rank reads about 1/tp of the split tensors
(column cuts - wo_b, w2 - are strided reads of each row's part). Replicated tensors are read whole; routed
experts another expert-parallel rank holds are never touched. safetensors cannot slice float4 (F4)
tensors, so those (not the release format: DeepSeek stores MXFP4 experts as int8 bytes) are read whole.
"""

from __future__ import annotations

import os

import torch

from engine.loading.load_progress import LoadProgress
from engine.loading.weights import Checkpoint, open_checkpoint
from engine.model.config import ModelConfig
from engine.model.parallel import ParallelContext
from engine.model.sharding import check_divisible, cut_heads_of_group, cut_of, cut_tensor, owns, scale_name


def load_shard(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    ctx: ParallelContext,
    dtype: torch.dtype,
    device,
    keep_mxfp4_experts: bool = False,
    keep_fp8: bool = False,
    progress: bool | None = None,
) -> dict:
    """This rank's weights -> {original name: tensor on `device`}, equal to `shard_weights(load_weights(...))`.

    Windows are read into host memory, moved to `device`, converted and cut there, so a GPU holds its shard
    plus at most one tensor's window at a time. progress: engine.loading.load_progress, on rank 0 only."""
    check_divisible(cfg, ctx)
    with open_checkpoint(model_dir, cfg, dtype, device, keep_mxfp4_experts, keep_fp8) as ckpt:
        names = [n for n in ckpt.names if owns(n, cfg, ctx)]
        out: dict = {}
        what = f"loading rank {ctx.rank}/{ctx.tp_size} shard" if ctx.enabled else "loading weights"
        with LoadProgress(len(names), what, enabled=progress if ctx.is_driver else False) as bar:
            for name in names:
                out.update(read_cut(ckpt, name, ctx, dtype))
                bar.advance(ckpt.bytes_read)
        return out


def read_cut(ckpt: Checkpoint, name: str, ctx: ParallelContext, dtype: torch.dtype) -> dict:
    """One tensor's part for this rank (with its scale companion when kept quantised), read as a window."""
    shape, o_groups = ckpt.expected[name], ckpt.cfg.o_groups
    cut = cut_of(name, shape, ctx, o_groups)
    if cut is None:
        part = ckpt.read(name)
        return cut_tensor(name, part[name], part.get(scale_name(name)), None, dtype)
    lo, hi = cut.covering(ckpt.grid(name, cut.dim))
    part = ckpt.read(name, (cut.dim, lo, hi))
    part = cut_tensor(name, part[name], part.get(scale_name(name)), cut, dtype, offset=lo)
    return cut_heads_of_group(name, part, shape, ctx, o_groups, dtype)
