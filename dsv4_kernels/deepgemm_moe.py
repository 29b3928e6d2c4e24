"""Routed FP8 experts through DeepGEMM's contiguous grouped FP8 GEMM (prefill-sized steps on Hopper; reference:
dsv4_kernels.fp8_experts.fp8_moe_ref).

One call, every step on the device; under CUDA-graph capture none reads back to the host:
1. the (token, slot) pairs sorted by expert into segments padded to DeepGEMM's M alignment
   (dsv4_kernels.fp8_experts.contiguous_layout: `m_indices` per row, -1 on padding rows), sized by the sync-free
   bound (81,792 rows at 8K tokens of V4-Flash; the kernel skips the empty tiles) unless DSV4_FP8_MOE_LAYOUT=exact
   sizes eager calls exactly after one host sync (65,536 rows under uniform routing; `exact_layout` says why bound
   is the default);
2. x quantised once per token in 1x128 blocks (dsv4_kernels.triton_fp8_quant) and its e4m3 rows and scales gathered
   into the padded order (padding rows read token 0: their products are never read);
3. gate|up: `m_grouped_fp8_gemm_nt_contiguous` over w13 [E, 2I, H] -> [M, 2I] bf16;
4. clamped SwiGLU + 1x128 quantisation in one launch (dsv4_kernels.triton_moe_glue.swiglu_quant);
5. down: the same GEMM over w2 [E, H, I] -> [M, H] bf16;
6. each token's k rows read through the layout, weighted, summed in fp32, plus the shared expert, in one launch
   (dsv4_kernels.triton_pair_combine).
Precision against the bf16 x MXFP4 path: activations are FP8 (1x128, as every dense FP8 projection of the engine)
where triton_kernels multiplies bf16 activations, and the weights are the MXFP4 values exactly where
dsv4_kernels.mxfp4_fp8 says so.
"""

from __future__ import annotations

import functools

import torch

from dsv4_kernels.fp8_experts import DEFAULT_ALIGN, Fp8Experts, contiguous_layout, padded_rows
from dsv4_kernels.gpu import import_deep_gemm

_SEEN: set[tuple[int, int, int, torch.device]] = set()  # (N, K, groups, device) run so far (warm-up)


@functools.cache
def m_alignment() -> int:
    """DeepGEMM's row alignment of each expert's segment in the contiguous layout."""
    dg = import_deep_gemm()
    for name in ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout"):
        fn = getattr(dg, name, None) or getattr(getattr(dg, "utils", None), name, None)
        if fn is not None:
            return int(fn())
    return DEFAULT_ALIGN


def grouped_gemm(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, m_indices: torch.Tensor
) -> torch.Tensor:
    """xq e4m3 [M, K], xs fp32 [M, K/128] (MN-major), w e4m3 [E, N, K], ws fp32 [E, N/128, K/128], m_indices int32
    [M] -> bf16 [M, N] (rows with m_indices -1 are left as the kernel leaves them)."""
    dg = import_deep_gemm()
    out = torch.empty(xq.shape[0], w.shape[1], dtype=torch.bfloat16, device=xq.device)
    _SEEN.add((w.shape[1], w.shape[2], w.shape[0], w.device))
    dg.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (w, ws), out, m_indices)
    return out


def seen_shapes() -> list[tuple[int, int, int, torch.device]]:
    return sorted(_SEEN, key=str)


def _gather_rows(xq: torch.Tensor, xs: torch.Tensor, src: torch.Tensor):
    """Quantised tokens -> the padded layout's rows: e4m3 [M, K] and fp32 scales [M, K/128] MN-major (M a multiple
    of 4, so the gathered [K/128, M] transpose is already DeepGEMM's TMA-aligned layout)."""
    q = xq.view(torch.uint8).index_select(0, src).view(torch.float8_e4m3fn)
    s = xs.t().index_select(1, src).t()  # [kb, T] -> [kb, M] contiguous -> MN-major [M, kb]
    return q, s


def exact_layout(ids: torch.Tensor) -> bool:
    """Size the layout exactly (one host sync) only with DSV4_FP8_MOE_LAYOUT=exact and outside a CUDA-graph capture.
    The sync drains the launch queue, so the GPU idles while the host issues the layer's next launches: on the
    H200's 8K slice prefill the bound layout's extra tiles cost 1.6 ms of GEMM time and the syncs ~5 ms of wall
    (50 vs 55 ms; BENCHMARKS prefill_formats)."""
    from dsv4_kernels.settings import settings

    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return settings().fp8_moe_layout == "exact"


def deepgemm_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    ex: Fp8Experts,
    limit: float,
    shared: torch.Tensor | None = None,
    exact: bool | None = None,
) -> torch.Tensor:
    """= fp8_moe_ref(x, weights, ids, ex, limit, shared). x: [T, H] bf16 CUDA; weights float [T, k]; ids int [T, k]
    (-1 = another rank's expert, contributes nothing); shared: [T, H] or None -> [T, H] bf16. exact: the layout's
    row count (None: `exact_layout`; True under capture fails on the sync)."""
    from dsv4_kernels import triton_moe_glue, triton_pair_combine  # import triton: only on this path
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128

    t, k = ids.shape
    if x.shape != (t, ex.hidden):
        raise ValueError(f"x must be [T={t}, H={ex.hidden}], got {tuple(x.shape)}")
    if t == 0:
        return torch.zeros_like(x) if shared is None else shared.clone()
    layout = contiguous_layout(ids, ex.num_experts, m_alignment(), exact_layout(ids) if exact is None else exact)
    xq, xs = _gather_rows(*quant_act_1x128(x.contiguous(), ex.pow2_act), layout.src_token)
    h = grouped_gemm(xq, xs, ex.w13, ex.s13, layout.m_indices)  # [M, 2I]
    del xq, xs
    aq, as_ = triton_moe_glue.swiglu_quant(h[:, : ex.inter], h[:, ex.inter :], limit, ex.pow2_act)
    del h
    y = grouped_gemm(aq, as_, ex.w2, ex.s2, layout.m_indices)  # [M, H]
    return triton_pair_combine.gather_combine(y, layout.pair_row.view(t, k), weights, shared, x.dtype)


def warm_m_values(max_tokens: int, top_k: int, num_experts: int, align: int) -> list[int]:
    """Every row count M a layout of a step of up to max_tokens tokens can have, exact or bound: each multiple of
    the alignment up to the bound (DeepGEMM's configuration follows M through its count of M blocks)."""
    return list(range(align, padded_rows(max_tokens * top_k, num_experts, align) + 1, align))


def warm(ex: Fp8Experts, max_tokens: int, top_k: int) -> int:
    """Run both grouped GEMMs (w13, w2) at every M of `warm_m_values`: DeepGEMM compiles a kernel per (N, K) and
    per configuration its heuristic picks for M, seconds each, and an exact layout's M follows the routing; do it
    before timing or serving. Zero operands (only the shapes matter); one GEMM's largest buffers live at a time
    (the input rows and the output: at most what a step of max_tokens holds). -> GEMM calls made."""
    align, dev, e = m_alignment(), ex.w13.device, ex.num_experts
    ms = warm_m_values(max_tokens, top_k, e, align)
    experts = (torch.arange(ms[-1], device=dev) // align % e).to(torch.int32)  # one expert per aligned tile
    for w, ws in ((ex.w13, ex.s13), (ex.w2, ex.s2)):
        k = w.shape[2]
        xq = torch.zeros(ms[-1], k, dtype=torch.float8_e4m3fn, device=dev)
        for m in ms:
            xs = torch.ones(k // 128, m, device=dev).t()  # MN-major scales of m rows
            grouped_gemm(xq[:m], xs, w, ws, experts[:m])
        del xq
    return 2 * len(ms)
