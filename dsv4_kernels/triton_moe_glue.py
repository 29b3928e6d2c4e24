"""Triton kernels for the MoE block's elementwise glue around its GEMMs (one launch each instead of 4-6 torch ones).

References: `dsv4_kernels.moe.swiglu` and the torch expressions the engine used before (named per function).
- `swiglu(gate, up, limit)`: clamped SwiGLU over two [P, I] views (gate and up may be the two halves of one
  fused [P, 2I] GEMM output). Rounded as torch rounds it in a 16-bit dtype: silu(min(gate, limit)) is
  computed in fp32 and rounded to the dtype, then multiplied by clamp(up) in fp32 and rounded again.
- `combine(y, shared)`: the k-way sum of the routed rows of each token, [T, k, H] -> [T, H], summed in fp32
  in slot order and rounded to the dtype (= `y.float().sum(1).to(dtype)`), plus the shared expert's output
  `shared` [T, H] added after that rounding and rounded again (= `routed + shared` in the dtype).
- `sort_pairs(ids, weights, num_experts)`: the (token, slot) pairs of a decode-sized step grouped by expert in
  one program (= `dsv4_kernels.mxfp4_ogs.sort_pairs` + the gammas gather, its torch reference): keys
  expert * P + pair are unique, so a bitonic `tl.sort` in registers gives the stable order; `tl.histogram`
  the per-expert counts. Pairs with id -1 (another rank's expert) run on expert 0 with weight 0.
- `swiglu_quant(gate, up, limit)`: the SwiGLU above, rounded to the dtype, then quantised per token in 1x128
  FP8 blocks for the next FP8 projection (= `dsv4_kernels.triton_fp8_quant.quant_act_1x128(swiglu(gate, up))`, scales
  MN-major for DeepGEMM): the shared expert's down projection input without a separate quantiser launch.
Interpreter note (as dsv4_kernels/triton_attention_kernels.py): every load is converted to fp32 before any arithmetic.
"""

from __future__ import annotations

import torch

from dsv4_kernels.fp8_linear import BLOCK as FP8_BLOCK
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_cache_codecs import USE_HW_FP8_CAST
from dsv4_kernels.triton_fp8_quant import scale_buffer, tl_quant_1x128
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

BLOCK = 1024


@triton.jit
def _swiglu_kernel(
    gate_ptr, up_ptr, out_ptr, N, stride_g, stride_u, stride_o, limit, BLOCK_N: tl.constexpr, PDL: tl.constexpr
):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _swiglu_quant_kernel(
    gate_ptr,
    up_ptr,
    q_ptr,
    s_ptr,
    M,
    N,
    stride_g,
    stride_u,
    stride_q,
    stride_sm,
    stride_sk,
    limit,
    POW2: tl.constexpr,
    HW_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (m < M)[:, None] & (k < N)[None, :]
    m64 = m.to(tl.int64)
    g = tl.load(gate_ptr + m64[:, None] * stride_g + k[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + m64[:, None] * stride_u + k[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    sg = (g / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    x = (sg * u).to(gate_ptr.dtype.element_ty).to(tl.float32)  # the activation as the unfused path rounds it
    x = tl.where(mask, x, 0.0)
    codes, scale = tl_quant_1x128(x, POW2, HW_FP8)
    tl.store(q_ptr + m64[:, None] * stride_q + k[None, :], codes, mask=mask)
    tl.store(s_ptr + m64 * stride_sm + kb * stride_sk, scale, mask=m < M)


@triton.jit
def _combine_kernel(
    y_ptr,
    shared_ptr,
    out_ptr,
    K,
    H,
    stride_yt,
    stride_yk,
    stride_st,
    stride_ot,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(K):
        acc += tl.load(y_ptr + t * stride_yt + k * stride_yk + cols, mask=mask, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:
        sh = tl.load(shared_ptr + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + sh).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + cols, out, mask=mask)


@triton.jit(do_not_specialize=["P"])
def _sort_pairs_kernel(
    ids_ptr,
    w_ptr,
    order_ptr,
    rows_ptr,
    counts_ptr,
    gammas_ptr,
    P,
    K,
    E,
    P_BLOCK: tl.constexpr,
    E_BINS: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    p = tl.arange(0, P_BLOCK)
    pmask = p < P
    ids = tl.load(ids_ptr + p, mask=pmask, other=0).to(tl.int32)
    skip = ids < 0
    ids = tl.where(skip, 0, ids)
    # Padding lanes sort last (key >= E * P_BLOCK) and land in bin E, which is not stored.
    key = tl.where(pmask, ids * P_BLOCK + p, E * P_BLOCK + p)
    order = tl.sort(key) % P_BLOCK
    tok = order // K
    tl.store(order_ptr + p, order, mask=pmask)
    tl.store(rows_ptr + p, tok, mask=pmask)
    w = tl.load(w_ptr + order, mask=pmask, other=0.0).to(tl.float32)
    wid = tl.load(ids_ptr + order, mask=pmask, other=0)
    tl.store(gammas_ptr + p, tl.where(wid < 0, 0.0, w), mask=pmask)
    counts = tl.histogram(tl.where(pmask, ids, E), E_BINS)
    b = tl.arange(0, E_BINS)
    tl.store(counts_ptr + b, counts.to(tl.int32), mask=b < E)


# Pairs (tokens x top-k) one program sorts in registers: decode steps; larger steps take the torch sort.
MAX_SORT_PAIRS = 2048


def sort_pairs(ids: torch.Tensor, weights: torch.Tensor, num_experts: int):
    """ids: int [T, k] (-1 = not this rank's expert); weights: float [T, k] -> (order int32 [P]: pair ids by
    expert, stable; rows int32 [P]: their token; counts int32 [E]; gammas fp32 [P]: weights in that order,
    0 for -1 pairs). P = T * k <= MAX_SORT_PAIRS."""
    if ids.dim() != 2 or weights.shape != ids.shape:
        raise ValueError(f"ids and weights must both be [T, k], got {tuple(ids.shape)} and {tuple(weights.shape)}")
    t, k = ids.shape
    p = t * k
    if p > MAX_SORT_PAIRS:
        raise ValueError(f"sort_pairs takes at most {MAX_SORT_PAIRS} pairs in one program, got {p}")
    require_triton(ids.device)
    dev = ids.device
    order = torch.empty(p, dtype=torch.int32, device=dev)
    rows = torch.empty(p, dtype=torch.int32, device=dev)
    gammas = torch.empty(p, dtype=torch.float32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    # From T's power-of-two bucket, not P: then the warm-up's ladder of T = 1, 2, 4, ... meets every block size a
    # step can (engine.execution.warmup), and P itself is not specialised on
    bucket = triton.next_power_of_2(t) * k
    p_block = min(triton.next_power_of_2(MAX_SORT_PAIRS), max(16, triton.next_power_of_2(bucket)))
    bins = triton.next_power_of_2(num_experts + 1)
    extra = {"num_warps": 8} if ids.is_cuda else {}
    _sort_pairs_kernel[(1,)](
        ids.contiguous(),
        weights.contiguous(),
        order,
        rows,
        counts,
        gammas,
        p,
        k,
        num_experts,
        P_BLOCK=p_block,
        E_BINS=bins,
        **extra,
        **pdl_kwargs(ids),
    )
    return order, rows, counts, gammas


def _rows(x: torch.Tensor, name: str, dims: int) -> None:
    if x.dim() != dims or x.stride(-1) != 1:
        raise ValueError(f"{name} must be {dims}-D with a unit last stride, got {tuple(x.shape)} strides {x.stride()}")


def _check_gate_up(gate: torch.Tensor, up: torch.Tensor) -> None:
    _rows(gate, "gate", 2)
    _rows(up, "up", 2)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    require_triton(gate.device)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gate, up: [P, I] (unit last stride; any row stride) -> [P, I] in out_dtype (default gate.dtype)."""
    _check_gate_up(gate, up)
    p, n = gate.shape
    out = torch.empty(p, n, dtype=out_dtype or gate.dtype, device=gate.device)
    if p and n:
        block = min(BLOCK, triton.next_power_of_2(n))
        _swiglu_kernel[(p, triton.cdiv(n, block))](
            gate,
            up,
            out,
            n,
            gate.stride(0),
            up.stride(0),
            out.stride(0),
            float(limit),
            BLOCK_N=block,
            **pdl_kwargs(gate),
        )
    return out


def swiglu_quant(
    gate: torch.Tensor, up: torch.Tensor, limit: float, pow2: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up: [M, N] (unit last stride) -> (e4m3 [M, N], fp32 scales [M, ceil(N/128)] MN-major) =
    quant_act_1x128(swiglu(gate, up, limit), pow2) in one launch (the activation rounded to gate.dtype first)."""
    _check_gate_up(gate, up)
    m, n = gate.shape
    kb = triton.cdiv(n, FP8_BLOCK)
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=gate.device)
    s = scale_buffer(m, kb, gate.device)
    if m and n:
        block_m = 16
        _swiglu_quant_kernel[(triton.cdiv(m, block_m), kb)](
            gate,
            up,
            q.view(torch.uint8),
            s,
            m,
            n,
            gate.stride(0),
            up.stride(0),
            q.stride(0),
            s.stride(0),
            s.stride(1),
            float(limit),
            POW2=pow2,
            HW_FP8=gate.is_cuda and USE_HW_FP8_CAST,
            BLOCK_M=block_m,
            BLOCK_K=FP8_BLOCK,
            **pdl_kwargs(gate),
        )
    return q, s


def combine(y: torch.Tensor, shared: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y: [T, k, H] routed rows per (token, slot); shared: [T, H] or None -> [T, H] in out_dtype (default
    shared's dtype, else y's)."""
    _rows(y, "y", 3)
    t, k, h = y.shape
    if shared is not None:
        _rows(shared, "shared", 2)
        if shared.shape != (t, h):
            raise ValueError(f"shared must be [T={t}, H={h}], got {tuple(shared.shape)}")
    require_triton(y.device)
    dtype = out_dtype or (shared.dtype if shared is not None else y.dtype)
    out = torch.empty(t, h, dtype=dtype, device=y.device)
    if t and h:
        block = min(BLOCK, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block))](
            y,
            out if shared is None else shared,
            out,
            k,
            h,
            y.stride(0),
            y.stride(1),
            0 if shared is None else shared.stride(0),
            out.stride(0),
            HAS_SHARED=shared is not None,
            BLOCK_H=block,
            **pdl_kwargs(y),
        )
    return out
