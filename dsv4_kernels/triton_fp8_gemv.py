"""Block-scaled FP8 projections of a few tokens as one Triton GEMV (reference: dsv4_kernels.fp8_linear.fp8_linear_ref).

Why: at batch 1 a decode step multiplies one token by V4's dense FP8 weights (26 DeepGEMM calls on the V4-Flash
slice, 308 us of a 1.37 ms step at 32K on an H100, where their ~520 MB need ~175 us at copy bandwidth). DeepGEMM's
kernels tile M by 64 and, for the small projections, start too few CTAs to keep enough bytes in flight: 9-10 us
for 4 MB (wq_a, one wo_a group), 17-20 us for 32 MB (wq_b, wo_b) after an L2 flush (BENCHMARKS.md, "FP8 dense
GEMMs"). An earlier split-K Triton GEMM (2026-12-04: K split until ~264 programs, a reducing last split) lost at
every shape. Here every program owns BLOCK_N whole weight rows and loads them, all K of them, in one load (TILE
bytes, 4 KB: one 4096-wide row), so many small programs each issue their whole tile at once and nothing is reduced
across programs: no split-K, no atomics, the same sums in the same order on every call.

The math is the reference's: y[m, n] = sum_k (xq[m, k] * xs[m, k // 128]) * (w[n, k] * ws[n // 128, k // 128])
in fp32, with the activations quantised per token in 1x128 blocks (dsv4_kernels.triton_fp8_quant, whose codes and
MN-major scales this takes as they are) and the weight's 128 x 128 block scales; here, as in DeepGEMM, each 128-wide
K block's code products are summed first (in fp32) and then scaled by xs * ws once, so the result equals the
reference's up to the order of the sums. Output bf16 rounded to nearest, as DeepGEMM's.

Grouped projections (wo_a: G groups of R rows, each over its own K features) are the same kernel: the rows of
group g read activation row g. Steps of up to GEMV_MAX_TOKENS tokens through weights of up to GEMV_MAX_WEIGHT_BYTES
take it (dsv4_kernels.deepgemm_linear; $DSV4_FP8_GEMV_MAX_TOKENS, 0 = never); each program loops over the tokens with
its tile held in registers. Measured (H100): it beats DeepGEMM on the small projections only (wq_a|wkv, 2-4 MB:
~3 us less at one token); at 8-32 MB both sit at ~1.5-1.6 TB/s and DeepGEMM is as fast or faster.
Interpreter note: FP8 bytes are loaded as uint8 and bitcast (the CPU interpreter has no fp8 tensors of its own).
"""

from __future__ import annotations

import torch

from dsv4_kernels.fp8_linear import BLOCK
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.settings import settings
from dsv4_kernels.triton_cache_codecs import tl_round_bf16
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

GEMV_MAX_TOKENS = settings().fp8_gemv_max_tokens
# Projections of at most this many weight bytes (one launch's: a grouped projection counts all its groups). On an
# H100 (2026-12-07, `dsv4 bench kernels fp8-gemm`, quantiser included, after an L2 flush) the GEMV took 0.66-0.71x
# DeepGEMM's time at 2-4 MB and one token, 0.89-1.16x at 8 MB and 1.05-1.11x at 32 MB.
GEMV_MAX_WEIGHT_BYTES = 6 << 20
# Weight bytes a program loads (BLOCK_N rows x K) and its warps: the best single configuration of the same H100's
# `--gemv-sweep` over V4-Flash's projections at one token.
TILE = 4096
NUM_WARPS = 2
_BLOCK_K = tl.constexpr(BLOCK)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    xq,
    xs,
    w,
    ws,
    out,
    M,
    K,
    R,
    stride_xg,
    stride_xm,
    stride_sg,
    stride_sm,
    stride_sk,
    stride_og,
    stride_om,
    BLOCK_N: tl.constexpr,
    KB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows [n0, n0 + BLOCK_N) of the stacked weight (group n0 // R, rows n0 % R.. of its output) for M tokens.
    The tile is [BLOCK_N, KB, 128]: each 128-wide K block is summed on its own, then scaled once (KB loads of
    each scale, not K)."""
    tl_pdl_wait(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    g = n0 // R
    rows = n0 + tl.arange(0, BLOCK_N)
    kb = tl.arange(0, KB)
    c = tl.arange(0, _BLOCK_K)
    kblocks = K // _BLOCK_K
    bmask = kb < kblocks
    k2 = kb[:, None] * _BLOCK_K + c[None, :]  # [KB, 128]
    codes = tl.load(w + rows[:, None, None].to(tl.int64) * K + k2[None, :, :], mask=bmask[None, :, None], other=0)
    wf = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # One weight-scale row for the whole tile: BLOCK_N divides 128 and n0 is a multiple of it.
    wscale = tl.load(ws + (n0 // _BLOCK_K) * kblocks + kb, mask=bmask, other=0.0)
    x_row = xq + g * stride_xg
    s_row = xs + g * stride_sg
    o_row = out + g * stride_og + (rows - g * R)
    for m in range(M):
        xc = tl.load(x_row + m * stride_xm + k2, mask=bmask[:, None], other=0)
        xf = xc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        part = tl.sum(wf * xf[None, :, :], axis=2)  # [BLOCK_N, KB]: code products, one K block each
        both = tl.load(s_row + m * stride_sm + kb * stride_sk, mask=bmask, other=0.0) * wscale
        y = tl.sum(part * both[None, :], axis=1)
        tl.store(o_row + m * stride_om, tl_round_bf16(y).to(tl.bfloat16))  # nearest even, the interpreter too


def takes_gemv(m: int, weight: torch.Tensor) -> bool:
    """Does a step of m tokens through this weight (one launch's, [N, K] e4m3) take the GEMV?"""
    return weight.is_cuda and 0 < m <= GEMV_MAX_TOKENS and weight.numel() <= GEMV_MAX_WEIGHT_BYTES


def block_n(k: int, tile: int = TILE) -> int:
    """Weight rows a program takes: tile bytes over K padded to a power of two (tile a power of two), 1..128."""
    return max(1, min(BLOCK, tile // triton.next_power_of_2(k)))


def fp8_gemv(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    tile: int = TILE,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """out[g] = (xq[g] * xs[g]) @ (weight's rows of group g)^T in fp32, bf16 out.

    xq: e4m3 [G, M, K] or [M, K] (unit last stride); xs: fp32 [G, M, K/128] or [M, K/128] (any strides: the
    quantisers' MN-major layout is read in place); weight: e4m3 [G * R, K] contiguous; scale: fp32 [G * R / 128,
    K / 128] contiguous; out: bf16 [G, M, R] or [M, N] (unit last stride). R and K whole 128-blocks. -> out."""
    grouped = xq.dim() == 3
    if not grouped:
        xq, xs, out = xq.unsqueeze(0), xs.unsqueeze(0), out.unsqueeze(0)
    g, m, k = xq.shape
    n = weight.shape[0]
    r = n // max(g, 1)
    if (
        weight.dim() != 2
        or weight.shape[1] != k
        or r * g != n
        or r % BLOCK
        or k % BLOCK
        or xs.shape != (g, m, k // BLOCK)
        or out.shape != (g, m, r)
        or scale.shape != (n // BLOCK, k // BLOCK)
    ):
        raise ValueError(
            f"fp8_gemv: activations {tuple(xq.shape)} / scales {tuple(xs.shape)}, weight {tuple(weight.shape)} / "
            f"{tuple(scale.shape)} and out {tuple(out.shape)} do not fit (G groups of R rows, R and K whole "
            f"{BLOCK}-blocks)"
        )
    if xq.stride(-1) != 1 or out.stride(-1) != 1 or not weight.is_contiguous() or not scale.is_contiguous():
        raise ValueError("fp8_gemv needs unit last strides and a contiguous weight and scale")
    require_triton(xq.device)
    if m == 0 or n == 0:
        return out
    bn = block_n(k, tile)
    _fp8_gemv_kernel[(n // bn,)](
        xq.view(torch.uint8),
        xs,
        weight.view(torch.uint8),
        scale,
        out,
        m,
        k,
        r,
        xq.stride(0),
        xq.stride(1),
        xs.stride(0),
        xs.stride(1),
        xs.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_N=bn,
        KB=triton.next_power_of_2(k // BLOCK),
        **({"num_warps": num_warps} if xq.is_cuda else {}),
        **pdl_kwargs(xq),
    )
    return out if grouped else out[0]
