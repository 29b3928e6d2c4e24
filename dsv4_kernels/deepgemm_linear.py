"""Block-scaled FP8 linear layers through DeepGEMM on Hopper (reference: dsv4_kernels.fp8_linear.fp8_linear_ref).

The activations are quantised per token in 1x128 blocks by dsv4_kernels.triton_fp8_quant (one fused kernel, scales
written in the MN-major layout DeepGEMM's sm90 kernels read), then `deep_gemm.fp8_gemm_nt` multiplies them with
the checkpoint's e4m3 weight and its 128x128 block scales (fp32) into a bf16 output. DeepGEMM JIT-compiles a
kernel per (N, K) and per configuration its heuristic picks for M (block sizes, stages, multicast; M itself is
a runtime argument) at first use, seconds each with the machine's nvcc. Every (N, K) this module multiplies is
recorded (`seen_shapes`), so engine.execution.warmup can run each at every M a step may have before serving starts.

The grouped output projection (wo_a: G groups, each [R, D] over its own D features) quantises its activations
[G, T, D] in one launch. Decode-sized steps (T <= GROUPED_MAX_TOKENS) then run one masked grouped GEMM
(`m_grouped_fp8_gemm_nt_masked`, every group's masked M = T): as G GEMMs, at batch 1 on an H200 V4-Flash's
8 x (4096 -> 1024) took 8 x 6.5 us where their 33.5 MB of weights need ~9 us at copy bandwidth. The masked
kernel stores whole M tiles with a 2-D TMA store that clips only at the tensor's end, so a group's rows past
its masked M would land on the next group's rows: every group gets GROUPED_ROWS rows of storage (a multiple of
any M tile), and the result is the first T of them. Longer steps keep G GEMMs (they fill the GPU anyway). If
the grouped call raises (a DeepGEMM build without it, a shape it refuses), the module says so once in the log
and keeps the G GEMMs.

Steps of up to $DSV4_FP8_GEMV_MAX_TOKENS tokens through small weights (triton_fp8_gemv.takes_gemv) run
dsv4_kernels.triton_fp8_gemv instead of DeepGEMM: the same quantised activations and function, one Triton GEMV.
"""

from __future__ import annotations

import logging

import torch

from dsv4_kernels.fp8_linear import BLOCK, Fp8Weight
from dsv4_kernels.gpu import import_deep_gemm

log = logging.getLogger(__name__)

_SEEN: set[tuple[int, int, bool, torch.device, int]] = set()  # (N, K, pow2 activation scales, device, groups):
# shapes only, so no engine's weights outlive it here; groups 1 = fp8_gemm_nt, G > 1 = the masked grouped GEMM
_GROUPED_BROKEN: list[str] = []  # why the masked grouped GEMM failed once (then G GEMMs run instead)
_MASKED_M: dict[tuple[int, int, torch.device], torch.Tensor] = {}  # the grouped GEMM's masked M tensors (_masked_m)
GROUPED_ROWS = 256  # per-group rows of the masked grouped GEMM's storage (a multiple of its M tiles)
GROUPED_MAX_TOKENS = 128  # above, G GEMMs


def _gemm(
    dg, xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pow2: bool, out: torch.Tensor
) -> None:
    from dsv4_kernels import triton_fp8_gemv as gemv  # imports triton: only on this path

    # Recorded even when the GEMV serves this call: the warm-up compiles DeepGEMM for the step sizes it does not.
    _SEEN.add((weight.shape[0], weight.shape[1], pow2, weight.device, 1))
    if gemv.takes_gemv(xq.shape[0], weight):
        gemv.fp8_gemv(xq, xs, weight, scale, out)
        return
    dg.fp8_gemm_nt((xq, xs), (weight, scale), out)


def _grouped_gemm(
    dg,
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    pow2: bool,
    out: torch.Tensor,
    m: int,
) -> None:
    """xq [G, GROUPED_ROWS, K] e4m3, xs [G, GROUPED_ROWS, K/128] (MN-major per group), weight [G, N, K], scale
    [G, N/128, K/128], out [G, GROUPED_ROWS, N] bf16: the first m rows of every group are real (masked_m = m)."""
    g = xq.shape[0]
    if xq.shape[1] != GROUPED_ROWS or out.shape[1] != GROUPED_ROWS or not 0 < m <= GROUPED_ROWS:
        raise ValueError(
            f"masked grouped GEMM storage must be [G, {GROUPED_ROWS}, .] for 0 < m <= {GROUPED_ROWS}, "
            f"got {tuple(xq.shape)}, {tuple(out.shape)}, m={m}"
        )
    _SEEN.add((weight.shape[1], weight.shape[2], pow2, weight.device, g))
    dg.m_grouped_fp8_gemm_nt_masked((xq, xs), (weight, scale), out, _masked_m(g, m, xq.device), m)


def _masked_m(g: int, m: int, device: torch.device) -> torch.Tensor:
    """int32 [g] filled with m: made once per (g, m, device) outside graph capture and kept (a fill launch fewer a
    call: a CUDA graph reads the kept tensor). During capture a new one is made and not kept: the capture does not run
    its fill, so until the graph replays it holds nothing."""
    key = (g, m, device)
    kept = _MASKED_M.get(key)
    if kept is not None:
        return kept
    made = torch.full((g,), m, dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():  # (a CPU build cannot ask)
        _MASKED_M[key] = made
    return made


def seen_shapes() -> list[tuple[int, int, bool, torch.device, int]]:
    """(N, K, power-of-two activation scales, device, groups) of every FP8 GEMM run in this process so far."""
    return sorted(_SEEN, key=str)


def warm_shape(n: int, k: int, pow2: bool, device, m_values, groups: int = 1) -> None:
    """Run an [N, K] FP8 GEMM (random weight and activations: DeepGEMM's choice of kernel depends on the shapes
    only) at each M in m_values, so every configuration its heuristic picks for them is compiled now.
    groups > 1: the masked grouped GEMM of `groups` [N, K] weights, every group M rows."""
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128, quant_act_1x128_grouped

    dg = import_deep_gemm()
    m_values = sorted(m_values)
    weight = torch.randn(groups, n, k, device=device).to(torch.float8_e4m3fn)
    scale = torch.ones(groups, -(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32, device=device)
    x = torch.randn(groups, m_values[-1], k, dtype=torch.bfloat16, device=device)
    for m in m_values:
        if groups == 1:
            xq, xs = quant_act_1x128(x[0, :m], pow2)
            dg.fp8_gemm_nt((xq, xs), (weight[0], scale[0]), torch.empty(m, n, dtype=torch.bfloat16, device=device))
        elif m <= GROUPED_MAX_TOKENS:
            xq, xs = quant_act_1x128_grouped(x[:, :m], pow2, GROUPED_ROWS)
            _grouped_gemm(
                dg,
                xq,
                xs,
                weight,
                scale,
                pow2,
                torch.empty(groups, GROUPED_ROWS, n, dtype=torch.bfloat16, device=device),
                m,
            )


def _warm_task(n: int, k: int, pow2: bool, device_index: int, m_values: list[int], groups: int) -> None:
    torch.cuda.set_device(device_index)
    warm_shape(n, k, pow2, torch.device("cuda", device_index), m_values, groups)


def warm_shapes(shapes, m_values, processes: int) -> int:
    """warm_shape for each (N, K, pow2, device) of `shapes` at every M in m_values, spread over `processes`
    spawned processes sharing this one's compile cache ($DG_JIT_CACHE_DIR): the compiles are single-threaded
    nvcc runs, seconds each, and independent. Each shape is split into its small-M and large-M halves, whose
    configurations differ. processes <= 1 runs them here. -> the number of GEMM calls made."""
    small = [m for m in m_values if m <= 128]
    # (a grouped shape runs as one masked GEMM only up to GROUPED_MAX_TOKENS: beyond, its groups are plain shapes)
    tasks = [
        (n, k, pow2, device, groups, part)
        for n, k, pow2, device, groups in shapes
        for part in (small, [m for m in m_values if m > 128] if groups == 1 else [])
        if part
    ]
    if processes <= 1 or len(tasks) <= 1:
        for n, k, pow2, device, groups, part in tasks:
            warm_shape(n, k, pow2, device, part, groups)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: a forked child cannot use CUDA once this process has
        with ProcessPoolExecutor(min(processes, len(tasks)), mp_context=multiprocessing.get_context("spawn")) as ex:
            for f in [
                ex.submit(_warm_task, n, k, pow2, torch.device(device).index or 0, part, groups)
                for n, k, pow2, device, groups, part in tasks
            ]:
                f.result()
    return sum(len(t[-1]) for t in tasks)


def supported(w: Fp8Weight) -> bool:
    """Shapes DeepGEMM's FP8 GEMM takes here: N and K whole 128-blocks (every V4 projection is)."""
    n, k = w.shape
    return n % BLOCK == 0 and k % BLOCK == 0 and w.weight.is_cuda


def fp8_gemm(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x: [M, K] bf16 -> [M, N] bf16 = quant(x) W^T (the reference's function, tensor-core accumulation)."""
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128  # imports triton: only on this path

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
    MN-major, as dsv4_kernels.triton_fp8_quant writes them; e.g. by a fused SwiGLU + quantiser) -> [M, N] bf16."""
    dg = import_deep_gemm()
    n, k = w.shape
    if xq.dim() != 2 or xq.shape[1] != k or xq.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"fp8_gemm_quantized needs e4m3 [M, {k}] for weight {tuple(w.shape)}, got {xq.dtype} {tuple(xq.shape)}"
        )
    out = torch.empty(xq.shape[0], n, dtype=torch.bfloat16, device=xq.device)
    if xq.shape[0]:
        _gemm(dg, xq, xs, w.weight, w.scale, w.pow2_act, out)
    return out


def fp8_grouped_gemm(x: torch.Tensor, w: Fp8Weight, groups: int, rope=None) -> torch.Tensor:
    """Block-diagonal projection: x [G, T, D] bf16 (unit last stride; a transposed [T, G, D] view is fine),
    w [G * R, D] -> [G, T, R] bf16 (group g uses rows gR..gR+R). One quantiser launch for all groups; rope (a
    dsv4_kernels.rope.InverseRope of the T rows) turns x's heads back in that launch first."""
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128_grouped

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
    from dsv4_kernels import triton_fp8_gemv as gemv

    if gemv.takes_gemv(t, w.weight):
        _SEEN.add((r, k, w.pow2_act, w.weight.device, g))  # as _gemm: DeepGEMM's larger steps get warmed
        xq, xs = quant_act_1x128_grouped(x, w.pow2_act, rope=rope)
        return gemv.fp8_gemv(xq, xs, w.weight, w.scale, out)
    if t <= GROUPED_MAX_TOKENS and not _GROUPED_BROKEN:
        xq, xs = quant_act_1x128_grouped(x, w.pow2_act, GROUPED_ROWS, rope)
        padded = torch.empty(g, GROUPED_ROWS, r, dtype=torch.bfloat16, device=x.device)
        try:
            _grouped_gemm(dg, xq, xs, w.weight.view(g, r, k), w.scale.view(g, rb, -1), w.pow2_act, padded, t)
            return padded[:, :t]
        except (RuntimeError, AssertionError, TypeError, AttributeError) as e:
            _GROUPED_BROKEN.append(f"{type(e).__name__}: {e}")
            log.warning(
                "DeepGEMM m_grouped_fp8_gemm_nt_masked failed for the grouped projection (%s); running %d "
                "GEMMs instead",
                _GROUPED_BROKEN[0][:300],
                g,
            )
    xq, xs = quant_act_1x128_grouped(x, w.pow2_act, rope=rope)
    for i in range(g):
        _gemm(dg, xq[i], xs[i], w.weight[i * r : (i + 1) * r], w.scale[i * rb : (i + 1) * rb], w.pow2_act, out[i])
    return out
