"""Prefill indexer top-k through DeepGEMM's `fp8_mqa_logits` (Hopper): FP8 queries against one sequence's FP8 keys.

Why: at long context the indexer's scores are most of a prefill (a 1M-token prompt on the H100: 36 of 48.6 s of
kernels in the Triton prefill kernel, ~125 TFLOP/s of bf16 tensor-core dots; BENCHMARKS long_context). DeepGEMM's
kernel is the one production V4 / V3.2 servers run for it on Hopper, on FP8 operands.

The op (`dsv4_kernels.indexer.indexer_scores` on each query's visible candidates, then top-k):
    score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . key[rows[s]]) * Di^-0.5   for s < count[t], else -inf.
DeepGEMM computes logits[t, s] = sum_h w'[t, h] * ReLU(q8[t, h] . (k8[s] * k_scale[s])) over s in [ks[t], ke[t]),
-inf elsewhere (`clean_logits`). The mapping:
- keys: the sequence's candidate rows gathered from the paged FP8 index cache (e4m3 values, one fp32 scale a
  row: dsv4_kernels.geometry's fp8 IndexerKeyLayout) into contiguous [S, Di] e4m3 + [S] fp32, once per call;
- queries: quantised to e4m3 per (token, head) with a power-of-two scale (amax / 448 rounded up), and that scale
  folded into the head weight with Di^-0.5: ReLU(c x) = c ReLU(x) for c > 0, so only the query's rounding to e4m3
  changes the scores (the precision change against the engine's bf16-query kernels: scores move by ~2^-4 relative
  per term, which reorders near-ties of the top-k; what production indexers do);
- ranges: ks = 0, ke = count[t] (each token sees a prefix of its sequence's candidates).
One sequence a call (rows [1, S]): a long prompt's chunks, where the cost is. Queries go in blocks under the
scores budget (dsv4_kernels.indexer.query_blocks), as the Triton path does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_kernels.geometry import IndexerKeyLayout
from dsv4_kernels.indexer import SCORES_BUDGET, query_blocks

FP8_MAX = 448.0
KV_ALIGN = 256  # key rows padded to a multiple of this (zero rows, outside every range)
HEAD_COUNTS = (32, 64)
HEAD_DIM = 128


def unfit_reason(q: torch.Tensor, layout: IndexerKeyLayout | None, rows: torch.Tensor) -> str:
    """Why this indexer call cannot take DeepGEMM's kernel ('' when it can). Shapes and formats only: no sync."""
    t, h, d = q.shape
    if not q.is_cuda:
        return "q is not on a CUDA device"
    if layout is None or layout.fmt != "fp8":
        return "the index keys are not FP8 (DeepGEMM's MXFP4 keys need Blackwell)"
    if d != HEAD_DIM or layout.index_head_dim != HEAD_DIM:
        return f"index head_dim {d} (the kernel takes {HEAD_DIM})"
    if h not in HEAD_COUNTS:
        return f"{h} index heads (the kernel takes {HEAD_COUNTS})"
    if rows.shape[0] != 1:
        return f"{rows.shape[0]} sequences in the step (one a call)"
    return ""


def quantize_queries(q: torch.Tensor, weights: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] -> (e4m3 [T, H, D], fp32 [T, H] = weights * s * scale) with s the power-of-two per-(t, h) scale
    that puts amax at or under 448."""
    qf = q.float()
    amax = qf.abs().amax(dim=-1).clamp_min(1e-12)
    s = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q8 = (qf / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q8.contiguous(), (weights.float() * s * scale).contiguous()


def gather_keys(store: torch.Tensor, layout: IndexerKeyLayout, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged FP8 index keys uint8 [blocks, >= block bytes] (a block's value rows, then its scale rows), row ids
    int [S] (-1 = none: a zero row) -> (e4m3 [S', D], fp32 [S']) with S' = S rounded up to KV_ALIGN."""
    bs, vb, sb = layout.block_size, layout.value_bytes, layout.scale_bytes
    blocks = store.view(store.shape[0], -1)
    flat = rows.reshape(-1).to(torch.int64)
    blk, pos = flat.clamp(min=0) // bs, flat.clamp(min=0) % bs
    values = blocks[:, : bs * vb].unflatten(1, (bs, vb))[blk, pos]
    scales = blocks[:, bs * vb : bs * (vb + sb)].unflatten(1, (bs, sb))[blk, pos].contiguous().view(torch.float32)
    values = torch.where((flat >= 0).unsqueeze(1), values, torch.zeros_like(values))
    scales = torch.where(flat >= 0, scales.reshape(-1), torch.zeros_like(scales.reshape(-1)))
    pad = -flat.shape[0] % KV_ALIGN
    if pad:
        values = torch.nn.functional.pad(values, (0, 0, 0, pad))
        scales = torch.nn.functional.pad(scales, (0, pad))
    return values.contiguous().view(torch.float8_e4m3fn), scales.contiguous()


def reference_mqa_logits(
    q8: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    clean_logits: bool = True,
) -> torch.Tensor:
    """Plain torch of DeepGEMM's `fp8_mqa_logits(q8, kv, weights, ks, ke)`: -> fp32 [T, S'] (-inf outside
    [ks[t], ke[t]) when clean_logits)."""
    k = kv[0].float() * kv[1].unsqueeze(-1)
    dots = torch.einsum("thd,sd->ths", q8.float(), k)
    logits = (dots.relu() * weights.unsqueeze(-1)).sum(dim=1)
    if clean_logits:
        cols = torch.arange(k.shape[0], device=q8.device)
        inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
        logits = logits.masked_fill(~inside, float("-inf"))
    return logits


def _deep_gemm_logits() -> Callable:
    from dsv4_kernels.gpu import import_deep_gemm

    return import_deep_gemm().fp8_mqa_logits


def fp8_indexer_topk(
    q: torch.Tensor,
    store: torch.Tensor,
    layout: IndexerKeyLayout,
    rows: torch.Tensor,
    count: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    ordered: bool = True,
    budget: int = SCORES_BUDGET,
    logits_fn: Callable | None = None,
) -> torch.Tensor:
    """Top-k candidates of each query of one sequence by indexer score (module docstring).

    q: [T, H, 128] (rotated, unquantised); store, layout: the paged FP8 index keys; rows: int [1, S] the sequence's
    candidate rows; count: int [T] candidates each query sees (a prefix); weights: fp32 [T, H] head weights (the
    Di^-0.5 is applied here). logits_fn: DeepGEMM's kernel by default (tests pass `reference_mqa_logits`).
    -> int64 [T, k] candidate columns, -1 where fewer than k are visible (dsv4_kernels.indexer.topk_visible's
    contract; ordered=False: the same set in no particular order)."""
    from dsv4_kernels.triton_indexer import topk_of_scores

    t, s = q.shape[0], rows.shape[1]
    fn = logits_fn or _deep_gemm_logits()
    q8, w = quantize_queries(q, weights, q.shape[-1] ** -0.5)
    kv = gather_keys(store, layout, rows[0])
    ks = torch.zeros(t, dtype=torch.int32, device=q.device)
    ke = count.to(device=q.device, dtype=torch.int32).clamp(max=s)
    out = torch.empty(t, k, dtype=torch.int64, device=q.device)
    for t0, t1 in query_blocks(t, kv[0].shape[0], budget):
        logits = fn(q8[t0:t1], kv, w[t0:t1], ks[t0:t1], ke[t0:t1])[:, :s]
        # contiguous rows for the radix top-k kernels (small blocks of few candidates take them)
        out[t0:t1] = topk_of_scores(logits if logits.is_contiguous() else logits.contiguous(), k, ordered)
    return out
