"""Block-scaled FP8 GEMM for decode-sized M (1-16 rows), split over K (Triton); reference:
`dsv4_kernels.fp8_linear.fp8_linear_ref` on the same quantised activations.

Why: DeepGEMM's sm90 FP8 GEMM tiles M by 64 and N by 128 or more, so at batch 1 a projection runs on N / 128
programs that each stream all of K: V4-Flash's q_a (4096 -> 1024) on 8 SMs took 12.6 us on the H200 for 4 MB
of weights (~1 us at copy bandwidth), and the batch-1 step's 26 dense GEMMs summed 264 us against ~100 us of
weight reads (BENCHMARKS.md, the slice's batch-1 profile). Here a program takes BLOCK_N output columns and one
range of K blocks, so q_a runs as 32 x 8 programs; a split's fp32 partial tile goes to a workspace and the last
split of its column block to arrive (an atomic counter, reset by that program: nothing to clear between calls,
so it runs inside CUDA graphs) adds the partials and writes the bf16 output.

Math, as DeepGEMM and the reference: y[m, n] = sum over 128-wide K blocks b of
(sum_{k in b} xq[m, k] * w[n, k]) * xs[m, b] * ws[n // 128, b], the e4m3 operands widened to bf16 (exact) for
the tensor cores, fp32 accumulation; outputs equal DeepGEMM's up to the order of the fp32 sums.
"""

from __future__ import annotations

import torch

from dsv4_kernels.fp8_linear import BLOCK
from dsv4_kernels.gpu import import_triton, require_triton

triton, tl = import_triton()

MAX_M = 16  # rows a call takes (one M tile); DeepGEMM runs the rest
TARGET_PROGRAMS = 264  # about two programs an SM on an H200 (132 SMs)
MIN_K_BLOCKS = 4  # K blocks a split streams at least (fewer: the partials' traffic outweighs the reads)
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device: one int32 arrival counter a column block


# M, the split sizes and the scales' strides (MN-major: M padded to 4) vary per step: none adds a compiled variant.
@triton.jit(do_not_specialize=["M", "KB", "splits", "kb_per_split", "stride_xs_m", "stride_xs_k"])
def _fp8_skinny_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr, M, N, KB, splits, kb_per_split,
                       stride_xq, stride_xs_m, stride_xs_k, stride_w, stride_ws, stride_o,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BF16_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, 128)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w + c[None, :]
    x_rows = xq_ptr + rows.to(tl.int64)[:, None] * stride_xq + c[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    kb_lo = split * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, KB)
    for kb in range(kb_lo, kb_hi):
        x = tl.load(x_rows + kb * 128, mask=rmask[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        w = tl.load(w_rows + kb * 128).to(tl.float8e4nv, bitcast=True)
        if BF16_DOT:
            d = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        else:
            d = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        sx = tl.load(xs_ptr + rows * stride_xs_m + kb * stride_xs_k, mask=rmask, other=0.0)
        sw = tl.load(ws_ptr + (pid_n * BLOCK_N // 128) * stride_ws + kb)
        acc += d * (sx[:, None] * sw)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    if splits == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
    else:
        tile = rows[:, None] * N + cols[None, :]  # workspace [splits, BLOCK_M, N] fp32
        tl.store(part_ptr + split * BLOCK_M * N + tile, acc)
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")  # releases this tile, acquires the others'
        if arrived == splits - 1:  # the last split of this column block: add them up, reset the counter
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, splits):
                total += tl.load(part_ptr + s * BLOCK_M * N + tile, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def plan(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, splits, K blocks a split) for an [M <= MAX_M, K] x [N, K]^T product: column blocks of 32 (16
    where that leaves fewer than TARGET_PROGRAMS / 4 of them), then K split until about TARGET_PROGRAMS programs
    run, each split streaming at least MIN_K_BLOCKS blocks."""
    kb = k // BLOCK
    block_n = 32 if n // 32 >= TARGET_PROGRAMS // 4 else 16
    n_blocks = n // block_n
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, n_blocks), kb // MIN_K_BLOCKS))
    per = triton.cdiv(kb, splits)
    return block_n, triton.cdiv(kb, per), per


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on device, allocated once (outside CUDA-graph capture: engine warm-up
    runs every decode shape eagerly first) and left zero by every call."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8_skinny_gemm: first call inside CUDA-graph capture; run the shape eagerly first")
        have = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def fp8_skinny_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """xq: e4m3 [M <= MAX_M, K] (unit last stride), xs: fp32 [M, K/128] (any strides: DeepGEMM's MN-major ones
    are fine), weight: e4m3 [N, K] contiguous, scale: fp32 [N/128, K/128] contiguous; N, K whole 128-blocks.
    -> bf16 [M, N] (into `out` when given)."""
    m, k = xq.shape
    n = weight.shape[0]
    if not 0 < m <= MAX_M or xq.dtype != torch.float8_e4m3fn or xq.stride(1) != 1:
        raise ValueError(f"fp8_skinny_gemm takes e4m3 [1..{MAX_M}, K] activations with a unit last stride, got "
                         f"{xq.dtype} {tuple(xq.shape)}")
    if weight.shape != (n, k) or n % BLOCK or k % BLOCK or not weight.is_contiguous() \
            or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_skinny_gemm needs a contiguous e4m3 weight [N, {k}] of whole 128-blocks, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if xs.shape != (m, k // BLOCK) or scale.shape != (n // BLOCK, k // BLOCK) or not scale.is_contiguous():
        raise ValueError(f"scales must be [{m}, {k // BLOCK}] and contiguous [{n // BLOCK}, {k // BLOCK}], got "
                         f"{tuple(xs.shape)}, {tuple(scale.shape)}")
    require_triton(xq.device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=xq.device) if out is None else out
    block_n, splits, per = plan(n, k)
    n_blocks = n // block_n
    part = torch.empty(splits if splits > 1 else 1, MAX_M, n if splits > 1 else 1, dtype=torch.float32,
                       device=xq.device)
    cnt = _counters(xq.device, n_blocks) if splits > 1 else part
    extra = {"num_warps": 4, "num_stages": 3} if xq.is_cuda else {}
    _fp8_skinny_kernel[(n_blocks, splits)](
        xq.view(torch.uint8), xs, weight.view(torch.uint8), scale, out, part, cnt, m, n, k // BLOCK, splits, per,
        xq.stride(0), xs.stride(0), xs.stride(1), weight.stride(0), scale.stride(0), out.stride(0),
        BLOCK_M=MAX_M, BLOCK_N=block_n, BF16_DOT=xq.is_cuda, **extra)
    return out
