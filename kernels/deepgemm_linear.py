"""Block-scaled FP8 linear layers through DeepGEMM on Hopper (reference: kernels.fp8_linear.fp8_linear_ref).

The activations are quantised per token in 1x128 blocks by kernels.triton_fp8_quant (one fused kernel, scales
written in the MN-major layout DeepGEMM's sm90 kernels read), then `deep_gemm.fp8_gemm_nt` multiplies them with
the checkpoint's e4m3 weight and its 128x128 block scales (fp32) into a bf16 output. DeepGEMM JIT-compiles a
kernel per (N, K) and per configuration its heuristic picks for M (block sizes, stages, multicast; M itself is
a runtime argument) at first use, seconds each with the machine's nvcc. Every (N, K) this module multiplies is
recorded (`seen_shapes`), so engine.warmup can run each at every M a step may have before serving starts.

The grouped output projection (wo_a: G groups, each [R, D] over its own D features) runs as G GEMMs over one
quantised activation tensor [G, T, D].
"""

from __future__ import annotations

import torch

from kernels.fp8_linear import BLOCK, Fp8Weight
from kernels.gpu import import_deep_gemm


_SEEN: set[tuple[int, int, bool, torch.device]] = set()  # (N, K, pow2 activation scales, device): shapes only,
# so no engine's weights outlive it here


def _gemm(dg, xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool,
          out: torch.Tensor) -> None:
    _SEEN.add((weight.shape[0], weight.shape[1], pow2, weight.device))
    dg.fp8_gemm_nt((xq, xs), (weight, scale), out)


def seen_shapes() -> list[tuple[int, int, bool, torch.device]]:
    """(N, K, power-of-two activation scales, device) of every FP8 GEMM run in this process so far."""
    return sorted(_SEEN, key=str)


def warm_shape(n: int, k: int, pow2: bool, device, m_values) -> None:
    """Run an [N, K] FP8 GEMM (random weight and activations: DeepGEMM's choice of kernel depends on the shapes
    only) at each M in m_values, so every configuration its heuristic picks for them is compiled now."""
    from kernels.triton_fp8_quant import quant_act_1x128

    dg = import_deep_gemm()
    m_values = sorted(m_values)
    weight = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    scale = torch.ones(-(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32, device=device)
    x = torch.randn(m_values[-1], k, dtype=torch.bfloat16, device=device)
    out = torch.empty(m_values[-1], n, dtype=torch.bfloat16, device=device)
    for m in m_values:
        xq, xs = quant_act_1x128(x[:m], pow2)
        dg.fp8_gemm_nt((xq, xs), (weight, scale), out[:m])


def _warm_task(n: int, k: int, pow2: bool, device_index: int, m_values: list[int]) -> None:
    torch.cuda.set_device(device_index)
    warm_shape(n, k, pow2, torch.device("cuda", device_index), m_values)


def warm_shapes(shapes, m_values, processes: int) -> int:
    """warm_shape for each (N, K, pow2, device) of `shapes` at every M in m_values, spread over `processes`
    spawned processes sharing this one's compile cache ($DG_JIT_CACHE_DIR): the compiles are single-threaded
    nvcc runs, seconds each, and independent. Each shape is split into its small-M and large-M halves, whose
    configurations differ. processes <= 1 runs them here. -> the number of GEMM calls made."""
    small = [m for m in m_values if m <= 128]
    tasks = [(n, k, pow2, device, part) for n, k, pow2, device in shapes
             for part in (small, [m for m in m_values if m > 128]) if part]
    if processes <= 1 or len(tasks) <= 1:
        for n, k, pow2, device, part in tasks:
            warm_shape(n, k, pow2, device, part)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: a forked child cannot use CUDA once this process has
        with ProcessPoolExecutor(min(processes, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as ex:
            for f in [ex.submit(_warm_task, n, k, pow2, torch.device(device).index or 0, part)
                      for n, k, pow2, device, part in tasks]:
                f.result()
    return sum(len(t[-1]) for t in tasks)


def supported(w: Fp8Weight) -> bool:
    """Shapes DeepGEMM's FP8 GEMM takes here: N and K whole 128-blocks (every V4 projection is)."""
    n, k = w.shape
    return n % BLOCK == 0 and k % BLOCK == 0 and w.weight.is_cuda


def fp8_gemm(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x: [M, K] bf16 -> [M, N] bf16 = quant(x) W^T (the reference's function, tensor-core accumulation)."""
    from kernels.triton_fp8_quant import quant_act_1x128  # imports triton: only on this path

    dg = import_deep_gemm()
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"fp8_gemm needs x [M, {k}] for weight {tuple(w.shape)}, got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
    if x.shape[0] == 0:
        return out
    xq, xs = quant_act_1x128(x, w.pow2_act)
    _gemm(dg, xq, xs, w.weight, w.scale, w.pow2_act, out)
    return out


def fp8_gemm_quantized(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """fp8_gemm on activations already quantised per token in 1x128 blocks (e4m3 [M, K], fp32 scales [M, K/128]
    MN-major, as kernels.triton_fp8_quant writes them; e.g. by a fused SwiGLU + quantiser) -> [M, N] bf16."""
    dg = import_deep_gemm()
    n, k = w.shape
    if xq.dim() != 2 or xq.shape[1] != k or xq.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm_quantized needs e4m3 [M, {k}] for weight {tuple(w.shape)}, got {xq.dtype} "
                         f"{tuple(xq.shape)}")
    out = torch.empty(xq.shape[0], n, dtype=torch.bfloat16, device=xq.device)
    if xq.shape[0]:
        _gemm(dg, xq, xs, w.weight, w.scale, w.pow2_act, out)
    return out


def fp8_grouped_gemm(x: torch.Tensor, w: Fp8Weight, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x [G, T, D] bf16 (unit last stride; a transposed [T, G, D] view is fine),
    w [G * R, D] -> [G, T, R] bf16 (group g uses rows gR..gR+R). One quantiser launch for all groups."""
    from kernels.triton_fp8_quant import quant_act_1x128_grouped

    dg = import_deep_gemm()
    g, t, d = x.shape
    n, k = w.shape
    if g != groups or k != d or n % (groups * BLOCK):
        raise ValueError(f"grouped FP8 projection: x {tuple(x.shape)} vs weight {tuple(w.shape)} in {groups} groups")
    r = n // groups
    out = torch.empty(g, t, r, dtype=torch.bfloat16, device=x.device)
    if t == 0:
        return out
    rb = r // BLOCK
    xq, xs = quant_act_1x128_grouped(x, w.pow2_act)
    for i in range(g):
        _gemm(dg, xq[i], xs[i], w.weight[i * r:(i + 1) * r], w.scale[i * rb:(i + 1) * rb], w.pow2_act, out[i])
    return out
