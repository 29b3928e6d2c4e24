"""Triton router logits for decode-sized steps: x [T, H] @ gate [E, H]^T as split-K partials on FMAs.

Reference: `dsv4_kernels.moe.route`'s x.float() @ gate.float().t(). For steps of up to GEMV_MAX_TOKENS tokens
`dsv4_kernels.triton_moe.route` takes the logits as this module's partials, fp32 [splits, T, E], and its routing
kernel adds them up while loading its scores, so the router is two launches. cuBLAS's split-K GEMM for one token
(V4-Flash: 256 x 4096 bf16, 2 MB) was two launches of its own before the routing kernel (4.5 + 1.7 us a layer on an
H100, BENCHMARKS.md `decode_launches`).

Each program owns BLOCK_E experts x BLOCK_H features of the gate: it loads that tile once (fp32 in registers) and
writes one partial a token. bf16 x bf16 products are exact in fp32, so the logits are the fp32 matmul's up to
summation order, as cuBLAS's split-K is.
Interpreter note: every load is converted to fp32 before any arithmetic (see dsv4_kernels/triton_attention_kernels.py).
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.settings import settings
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

# Steps of up to this many tokens take the GEMV (each program loops over the tokens); longer ones cuBLAS.
# $DSV4_ROUTER_GEMV_MAX_TOKENS overrides (0: never).
GEMV_MAX_TOKENS = settings().router_gemv_max_tokens  # 8
# A program's gate tile: 32 experts x 256 features (16 KB of bf16): V4-Flash's 256 x 4096 gate is 128 programs.
BLOCK_E = 32
BLOCK_H = 256


@triton.jit(do_not_specialize=["T", "stride_ps"])  # (stride_ps = T x E: no variant a step size)
def _router_gemv_kernel(
    x_ptr,
    gate_ptr,
    part_ptr,
    T,
    E,
    H,
    stride_x,
    stride_g,
    stride_ps,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    emask = e < E
    hmask = h < H
    w = tl.load(gate_ptr + e[:, None].to(tl.int64) * stride_g + h[None, :], mask=emask[:, None] & hmask[None, :])
    w = tl.where(emask[:, None] & hmask[None, :], w.to(tl.float32), 0.0)
    out = part_ptr + tl.program_id(1) * stride_ps
    for t in range(T):
        x = tl.load(x_ptr + t * stride_x + h, mask=hmask, other=0.0).to(tl.float32)
        tl.store(out + t * E + e, tl.sum(w * x[None, :], axis=1), mask=emask)


def takes_gemv(x: torch.Tensor) -> bool:
    """Does a step of these activations [T, H] take the GEMV on this device?"""
    return x.is_cuda and 0 < x.shape[0] <= GEMV_MAX_TOKENS


def router_partials(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H] (unit last stride), gate [E, H] (unit last stride; bf16 or fp32) -> fp32 [splits, T, E] whose sum over
    splits is x.float() @ gate.float().t() (splits = ceil(H / BLOCK_H))."""
    if x.dim() != 2 or gate.dim() != 2 or gate.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, H] and gate [E, H], got {tuple(x.shape)} and {tuple(gate.shape)}")
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("router_partials needs x and gate with a unit last stride")
    require_triton(x.device)
    t, h = x.shape
    e = gate.shape[0]
    splits = triton.cdiv(h, BLOCK_H)
    parts = torch.empty(splits, t, e, dtype=torch.float32, device=x.device)
    if t and e:
        _router_gemv_kernel[(triton.cdiv(e, BLOCK_E), splits)](
            x,
            gate,
            parts,
            t,
            e,
            h,
            x.stride(0),
            gate.stride(0),
            parts.stride(0),
            BLOCK_E=BLOCK_E,
            BLOCK_H=BLOCK_H,
            **({"num_warps": 4} if x.is_cuda else {}),
            **pdl_kwargs(x),
        )
    return parts
