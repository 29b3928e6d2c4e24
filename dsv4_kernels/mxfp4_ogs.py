"""Routed MXFP4 experts through OpenAI's triton_kernels matmul on Hopper (reference: dsv4_kernels.moe.moe_experts on
dsv4_kernels.quant.dequant_mxfp4 weights; the engine's own kernel is dsv4_kernels.triton_moe).

Mapping the checkpoint's bytes: an expert weight W [N, K] is stored as uint8 [N, K/2] (element 2j in the low
nibble of byte j, e2m1 codes) plus UE8M0 scale bytes [N, K/32]. triton_kernels wants the logical [E, K, N]
matrix quantised along K with the same nibble order and uint8 E8M0 scales [E, K/32, N]; its "K-major"
strided form stores exactly our bytes, so `W.transpose(1, 2)` wraps them without a copy, and
`convert_layout` then moves them once into the Hopper value/scale layouts its wgmma kernel reads (a one-off
copy at build; the packed originals can be dropped after).

A call: the (token, slot) pairs are sorted by expert on the device (no host sync, CUDA-graph safe; one Triton
launch up to dsv4_kernels.triton_moe_glue.MAX_SORT_PAIRS pairs, torch's argsort beyond), then
- gate+up: one ragged matmul over the fused [E, H, 2I] weights, rows gathered from x by `gather_indx`
  (bf16 activations x MXFP4 weights, fp32 accumulation) -> [P, 2I] in expert order;
- clamped SwiGLU (dsv4_kernels.moe.swiglu's function) in one Triton launch (dsv4_kernels.triton_moe_glue);
- down: one ragged matmul over [E, I, H], each row scaled by its routing weight (`gammas`) and written back to
  its pair's position (`scatter_indx`) -> [P, H]; the k rows of each token are summed (deterministic, fp32)
  and the shared expert's output added, in one Triton launch.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import torch

from dsv4_kernels.gpu import import_triton_kernels
from dsv4_kernels.settings import settings

SCALE_WARPS = 8  # warps of the kernels reading the scales (the Hopper scale layout is built for a warp count)
# Launch constraints for triton_kernels' matmul (its opt_flags: block_m/n/k, num_stages, is_persistent, ...).
# Non-persistent: on the H200 (dsv4 bench kernels moe --ogs-sweep, BENCHMARKS.md mxfp4_moe_sweep) it matched the
# heuristics' choice at 64 and 128 decode tokens (893 vs 899 us, 1141 vs 1147 us, identical outputs) and the
# slice's 8K prefill ran in 0.22 s with it against 0.35-0.40 s in the runs without. Prefill-sized calls also
# take 3 pipeline stages: at 4096 and 8192 tokens the whole MoE ran in 4124 / 6407 us against 4870 / 7551 with
# the heuristics' stages (BENCHMARKS.md, moe_prefill_sweep; identical outputs); sizes between were not measured,
# so they keep the decode choice. $DSV4_OGS_CONSTRAINTS (a JSON object; {} = triton_kernels' own heuristics)
# overrides both.
CONSTRAINTS: dict = {"is_persistent": False}
PREFILL_CONSTRAINTS: dict = {"is_persistent": False, "num_stages": 3}
PREFILL_TOKENS = 4096  # from this many tokens a call is prefill-sized


def constraints(tokens: int = 1) -> dict:
    """Launch constraints for an MoE call over `tokens` tokens."""
    override = settings().ogs_constraints  # a dict (checked when parsed) or None
    if override is None:
        return PREFILL_CONSTRAINTS if tokens >= PREFILL_TOKENS else CONSTRAINTS
    return override


def _scoped(extra: dict | None, tokens: int = 1):
    """triton_kernels' opt-flag constraints for the calls inside (a no-op when there are none)."""
    c = constraints(tokens) if extra is None else extra
    if not c:
        return contextlib.nullcontext()
    from triton_kernels.matmul_details.opt_flags import scoped_opt_flags_constraints

    return scoped_opt_flags_constraints(c)


@dataclass(frozen=True)
class OgsExperts:
    """One layer's routed experts in triton_kernels' Hopper layouts: gate+up fused along N, then down."""

    w13: object  # triton_kernels Tensor, logical [E, H, 2I] FP4
    s13: object  # its E8M0 scales, logical [E, H/32, 2I]
    w2: object  # [E, I, H] FP4
    s2: object  # [E, I/32, H]
    num_experts: int
    hidden: int
    inter: int


def _wrap(w: torch.Tensor, s: torch.Tensor):
    """uint8 [E, N, K/2] + [E, N, K/32] (checkpoint order) -> triton_kernels (value, scale) in Hopper layouts."""
    _, tensor, layout, _ = import_triton_kernels()
    value = tensor.wrap_torch_tensor(w.transpose(1, 2), dtype=tensor.FP4)  # logical [E, K, N], K contiguous
    value = tensor.convert_layout(value, layout.make_default_matmul_mxfp4_w_layout(mx_axis=-2))
    scale = tensor.wrap_torch_tensor(s.transpose(1, 2))  # logical [E, K/32, N]
    scale = tensor.convert_layout(
        scale, layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=-2, num_warps=SCALE_WARPS)
    )
    return value, scale


def prepare(w1, s1, w2, s2, w3, s3) -> OgsExperts:
    """Packed experts as engine.model.moe.PackedExperts holds them -> OgsExperts (new tensors; inputs untouched).

    w1, w3: uint8 [E, I, H/2], s1, s3: [E, I, H/32]; w2: [E, H, I/2], s2: [E, H, I/32].
    """
    e, inter, half_h = w1.shape
    w13, s13 = _wrap(torch.cat([w1, w3], dim=1), torch.cat([s1, s3], dim=1))
    wd, sd = _wrap(w2, s2)
    return OgsExperts(w13, s13, wd, sd, e, 2 * half_h, inter)


def sort_pairs(ids: torch.Tensor, num_experts: int):
    """ids [T, k] -> (order int32 [P]: pair ids by expert, stable; rows int32 [P]: their token; counts int32 [E])."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # no host sync (bincount has one)
    return order.to(torch.int32), (order // ids.shape[1]).to(torch.int32), counts


def _spec_class(v: int) -> str:
    """How Triton specialises an integer argument: == 1, divisible by 16, or neither."""
    return "1" if v == 1 else ("16" if v % 16 == 0 else "-")


def _ragged_blocks(n_slices: int, rows: int, block: int) -> int:
    """triton_kernels' RaggedTensorMetadata.n_blocks: the row blocks a ragged matmul's grid covers (its grid_m)."""
    return rows if rows <= n_slices else n_slices - 1 - ((n_slices - rows - 1) // block)


def variant_key(tokens: int, num_experts: int, top_k: int) -> tuple:
    """What decides which compiled variant of triton_kernels' two matmuls `ogs_moe` over `tokens` tokens runs.

    The matmul picks block_m from the pairs per expert (P // E, P = tokens * top_k, through its power of two),
    and passes its row-block count (grid_m) and the write-back size (P) as integers Triton specialises on == 1 and
    divisibility by 16; the launch constraints change with `constraints(tokens)`, and the pair sort with P's size.
    The key holds each of these (grid_m's class at every block_m it may pick): a superset of what the library's
    choice depends on, so one call per key compiles every variant (engine.execution.warmup's MoE sweep)."""
    p = tokens * top_k
    per_expert = max(1, p // max(1, num_experts))
    return (
        json.dumps(constraints(tokens), sort_keys=True),
        1 << (per_expert - 1).bit_length(),
        _spec_class(p),
        tuple(_spec_class(_ragged_blocks(num_experts, p, b)) for b in (16, 32, 64, 128)),
        p <= _max_sort_pairs(),
    )


def _max_sort_pairs() -> int:
    from dsv4_kernels.triton_moe_glue import MAX_SORT_PAIRS  # imports triton: only where the kernels run

    return MAX_SORT_PAIRS


def variant_tokens(max_tokens: int, num_experts: int, top_k: int) -> list[int]:
    """The smallest token count of every `variant_key` class in 1..max_tokens (a few hundred at V4-Flash's 256
    experts top-6 and 8192 tokens: 156 calls summing to 348K tokens)."""
    first: dict[tuple, int] = {}
    for t in range(1, max_tokens + 1):
        first.setdefault(variant_key(t, num_experts, top_k), t)
    return sorted(first.values())


def ogs_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    ex: OgsExperts,
    limit: float,
    opt_constraints: dict | None = None,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """= moe_experts(x, weights, ids, W1, W2, W3, limit) on the dequantised experts. x: [T, H] bf16;
    weights: [T, k] float; ids: int [T, k] (-1 = not this rank's expert, contributes nothing) -> [T, H] in x.dtype.
    opt_constraints: triton_kernels launch constraints for this call (None = `constraints(T)`).
    shared: [T, H] added to the result (the shared expert's output) in the k-way sum's kernel."""
    from dsv4_kernels import triton_moe_glue  # Triton SwiGLU and k-way sum (one launch each)

    matmul, tensor, _, precision = import_triton_kernels()
    t, k = ids.shape
    if x.shape != (t, ex.hidden):
        raise ValueError(f"x must be [T={t}, H={ex.hidden}], got {tuple(x.shape)}")
    if t == 0:
        return torch.zeros_like(x) if shared is None else shared.clone()
    # Expert parallelism marks pairs routed to another rank's experts with id -1: run them on expert 0 with
    # routing weight 0 (shapes stay fixed for CUDA graphs; the wasted rows are few).
    p = t * k
    if p <= triton_moe_glue.MAX_SORT_PAIRS:  # decode: sort, counts and gammas in one launch
        order, rows, counts, gammas = triton_moe_glue.sort_pairs(ids, weights, ex.num_experts)
    else:
        skip = ids < 0
        ids, weights = ids.clamp_min(0), weights.masked_fill(skip, 0.0)
        order, rows, counts = sort_pairs(ids, ex.num_experts)
        gammas = weights.reshape(-1).float().index_select(0, order.long())
    meta = tensor.make_ragged_tensor_metadata(counts, p)
    x = x.contiguous()
    with _scoped(opt_constraints, t):
        h = matmul.matmul(
            x,
            ex.w13,
            None,
            a_ragged_metadata=meta,
            gather_indx=rows,
            precision_config=precision(b_mx_scale=ex.s13, b_microblock_size=32),
        )  # [P, 2I]
        act = triton_moe_glue.swiglu(h[:, : ex.inter], h[:, ex.inter :], limit, x.dtype)
        y = matmul.matmul(
            act,
            ex.w2,
            None,
            a_ragged_metadata=meta,
            scatter_indx=order,
            gammas=gammas,
            precision_config=precision(b_mx_scale=ex.s2, b_microblock_size=32),
        )  # [P, H], pair order
    return triton_moe_glue.combine(y.view(t, k, ex.hidden), shared, x.dtype)
