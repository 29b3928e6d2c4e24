"""Routed MXFP4 experts through Marlin's W4A16 MoE GEMM (what vLLM and SGLang run on Hopper): a candidate measured
beside triton_kernels in `dsv4 bench kernels moe`, not yet wired into the engine.

Reference: `dsv4_kernels.moe.moe_experts` on the dequantised experts. Marlin dequantises the e2m1 weights and their
E8M0 group-32 scales in registers and multiplies bf16 activations on the tensor cores; its grouped GEMM schedules
(token, slot) routes sorted by expert in blocks of 8-64 routes (`moe_align_block_size`). Per call:
route sort -> gate|up GEMM [P, 2I] -> our clamped SwiGLU (dsv4_kernels.triton_moe_glue.swiglu) -> down GEMM with
the route weights folded in [P, H] -> our k-way sum (`combine`, which can add the shared expert).

Weights: `prepare` repacks the engine's packed experts (uint8 [E, N, K/2], element 2j in the low nibble, and
UE8M0 bytes [E, N, K/32]: the checkpoint's bytes) into Marlin's tile order once, per expert, on the GPU (the
library's `gptq_marlin_repack`: each int32 of the [K/8, N] view holds 8 consecutive K elements, element j at bits
4j, which is the checkpoint's byte order), and permutes the scales as the library's bf16 path reads them. The
repacked experts replace, not add to, the triton_kernels layout when an engine adopts this path.

The library (tokenspeed-kernel 0.1.4's `marlin_moe.so` through TVM FFI; tools/device_wheels/marlin_wheel.py) comes
through `dsv4_kernels.gpu.import_marlin_moe`; every call runs inside `tvm_ffi.use_torch_stream()` so its kernels go on
torch's current stream (CUDA-graph capture included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_kernels.gpu import import_marlin_moe

GROUP = 32  # MXFP4 scale group along K


@dataclass(frozen=True)
class MarlinExperts:
    """One layer's routed experts in Marlin's layouts: gate and up stacked along N (gate first), then down."""

    w13: torch.Tensor  # int32 [E, H/16, 2 * 2I]: Marlin tiles of [w1; w3] ([2I, H] per expert)
    s13: torch.Tensor  # float8_e8m0fnu [E, H/32, 2I], permuted
    w2: torch.Tensor  # int32 [E, I/16, 2 * H]
    s2: torch.Tensor  # float8_e8m0fnu [E, I/32, H]
    num_experts: int
    hidden: int
    inter: int


def _rows(parts: list[torch.Tensor], e: int) -> torch.Tensor:
    """Expert e's rows of `parts` ([E, N_i, ...] each) stacked along N: one expert at a time, so stacking gate and
    up never copies a whole layer's experts at once (2 GB a layer at V4-Flash)."""
    return torch.cat([p[e] for p in parts]) if len(parts) > 1 else parts[0][e].contiguous()


def _repack(marlin, parts: list[torch.Tensor], n: int, k: int) -> torch.Tensor:
    """uint8 [E, N_i, K/2] parts (sum N_i = N) -> int32 Marlin tiles [E, K/16, 2N] (one repack launch an expert)."""
    perm = torch.empty(0, dtype=torch.int32, device=parts[0].device)
    return torch.stack(
        [
            marlin.gptq_marlin_repack(
                _rows(parts, e).view(torch.int32).t().contiguous(), perm, size_k=k, size_n=n, num_bits=4
            )
            for e in range(parts[0].shape[0])
        ]
    )


def _permute_scales(mm, parts: list[torch.Tensor], n: int, k: int) -> torch.Tensor:
    """UE8M0 bytes [E, N_i, K/32] parts -> float8_e8m0fnu [E, K/32, N] in the order Marlin's bf16 path reads."""
    return torch.stack(
        [
            mm.mxfp4_marlin_process_scales(
                mm.marlin_permute_scales(_rows(parts, e).t().contiguous(), size_k=k, size_n=n, group_size=GROUP)
            )
            for e in range(parts[0].shape[0])
        ]
    )


def prepare(w1, s1, w2, s2, w3, s3) -> MarlinExperts:
    """Packed experts as engine.model.moe.PackedExperts holds them -> MarlinExperts (new tensors; inputs untouched).

    w1, w3: uint8 [E, I, H/2], s1, s3: uint8 [E, I, H/32]; w2: [E, H, I/2], s2: [E, H, I/32] (CUDA tensors)."""
    tvm_ffi, marlin, mm = import_marlin_moe()
    e, inter, half_h = w1.shape
    hidden = 2 * half_h
    if hidden % 256 or inter % 64:  # Marlin's tile constraints (K in 128s, N in 64s, groups of 32)
        raise ValueError(f"Marlin MoE needs hidden % 256 == 0 and moe_inter % 64 == 0, got {hidden}, {inter}")
    if w2.shape != (e, hidden, inter // 2) or w3.shape != w1.shape:
        raise ValueError(f"expert shapes disagree: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}")
    with tvm_ffi.use_torch_stream():
        w13 = _repack(marlin, [w1, w3], 2 * inter, hidden)
        wd = _repack(marlin, [w2], hidden, inter)
    s13 = _permute_scales(mm, [s1, s3], 2 * inter, hidden)
    sd = _permute_scales(mm, [s2], hidden, inter)
    return MarlinExperts(w13, s13, wd, sd, e, hidden, inter)


def block_size_m(tokens: int, top_k: int, num_experts: int) -> int:
    """Routes a scheduled block holds: the smallest of 8-64 that leaves each expert under ~0.9 blocks of routes
    (the library's own rule: tight blocks for decode, wide ones for prefill)."""
    for block in (8, 16, 32, 48, 64):
        if tokens * top_k / num_experts / block < 0.9:
            return block
    return 64


def marlin_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    ex: MarlinExperts,
    limit: float,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """= moe_experts(x, weights, ids, W1, W2, W3, limit) on the dequantised experts. x: [T, H] bf16; weights:
    [T, k] float; ids: int [T, k] (all in [0, E): no expert parallelism here) -> [T, H] bf16; shared: [T, H]
    added in the k-way sum."""
    from dsv4_kernels import triton_moe_glue  # Triton SwiGLU and k-way sum

    tvm_ffi, _, mm = import_marlin_moe()
    t, k = ids.shape
    if x.shape != (t, ex.hidden) or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [T={t}, H={ex.hidden}], got {x.dtype} {tuple(x.shape)}")
    if t == 0:
        return torch.zeros_like(x) if shared is None else shared.clone()
    block = block_size_m(t, k, ex.num_experts)
    gammas = weights.float().contiguous()
    x = x.contiguous()
    with tvm_ffi.use_torch_stream():
        sorted_ids, expert_ids, padded = mm.moe_align_block_size(
            ids.to(torch.int32).contiguous(), block, ex.num_experts
        )
        workspace = mm.marlin_make_workspace(x.device)  # per call: graphs must not share its locks
        h = mm.moe_wna16_marlin_gemm(
            x,
            None,
            ex.w13,
            ex.s13,
            workspace,
            sorted_ids,
            expert_ids,
            padded,
            gammas,
            moe_block_size=block,
            top_k=k,
            mul_topk_weights=False,
            is_ep=False,
            size_m=t,
            size_n=2 * ex.inter,
            size_k=ex.hidden,
        )  # [P, 2I], route order
        act = triton_moe_glue.swiglu(h[:, : ex.inter], h[:, ex.inter :], limit, x.dtype)
        y = mm.moe_wna16_marlin_gemm(
            act,
            None,
            ex.w2,
            ex.s2,
            workspace,
            sorted_ids,
            expert_ids,
            padded,
            gammas,
            moe_block_size=block,
            top_k=1,
            mul_topk_weights=True,
            is_ep=False,
            size_m=t * k,
            size_n=ex.hidden,
            size_k=ex.inter,
        )  # [P, H], weighted
    return triton_moe_glue.combine(y.view(t, k, ex.hidden), shared, x.dtype)
