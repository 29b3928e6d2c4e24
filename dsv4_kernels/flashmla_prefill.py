"""Sparse MQA attention of prefill-shaped steps through FlashMLA's sparse prefill kernel (sm90).

The op is the engine's Triton `dsv4_kernels.triton_attention.sparse_mqa_attention_multi` (reference:
`dsv4_kernels.attention.sparse_attention`): query token t attends, with all H heads, to the rows `rows[t]` of the
row concatenation of 1-3 bf16 stores (the dequantised SWA ring, this step's own kv rows, the dequantised entry rows:
engine.model.attention_fp8.dequantised_attend builds them); -1 = skip; one sink logit per head; V = K (the 512-wide
latent). FlashMLA's `flash_mla_sparse_fwd(q [T, H, 512], kv [S, 1, 512], indices [T, 1, K], scale, 512, attn_sink)`
takes exactly that once the stores are one tensor (a copy of the step's bf16 rows: ~1 KB a row, a few us at 8K
rows), the heads are 64 or 128 (fewer are padded with zero queries whose outputs are dropped), and K is a multiple
of 128 (padded with -1).

Precision: FlashMLA rounds the softmax weights to bf16 before the P.V product, as the Triton kernel's bf16
tensor-core path does; both accumulate in fp32. A query with no valid row returns zeros (all mass on the sink), as
the reference does.
"""

from __future__ import annotations

import torch

from dsv4_kernels.flashmla_sparse import HEAD_COUNTS, HEAD_DIM, pad_topk, padded_heads

TOPK_MULTIPLE = 128  # the sm90 kernel takes top-k in pairs of its 64-row blocks (2 * B_TOPK)


def unfit_reason(q: torch.Tensor, stores: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> str:
    """Why FlashMLA's sparse prefill cannot run this call ('' when it can). Shapes and dtypes only: no sync."""
    t, h, d = q.shape
    if not q.is_cuda:
        return "q is not on a CUDA device"
    if q.dtype != torch.bfloat16 or any(s.dtype != torch.bfloat16 for s in stores):
        return f"q and the stores must be bf16 (q is {q.dtype})"
    if d != HEAD_DIM or any(s.shape[-1] != HEAD_DIM for s in stores):
        return f"head_dim {d} (FlashMLA's sparse prefill takes {HEAD_DIM})"
    if h > max(HEAD_COUNTS):
        return f"{h} query heads (FlashMLA takes up to {max(HEAD_COUNTS)})"
    return ""


def padded_rows(rows: torch.Tensor) -> torch.Tensor:
    """int [T, K] -> int32 [T, 1, K'] with K' the next multiple of 128 (-1 padding), FlashMLA's indices."""
    return pad_topk(rows, TOPK_MULTIPLE).unsqueeze(1)


def sparse_prefill(
    q: torch.Tensor,
    stores: list[torch.Tensor] | tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: bf16 [T, H, 512]; stores: 1-3 bf16 [R_i, 512]; rows: int [T, K] ids into their row concatenation, -1 =
    skip; sink: [H]. -> bf16 [T, H, 512], = sparse_mqa_attention_multi(q, stores, rows, sink, scale) up to bf16
    rounding of the softmax weights."""
    from dsv4_kernels.gpu import import_flash_mla

    reason = unfit_reason(q, stores)
    if reason:
        raise ValueError(f"FlashMLA sparse prefill cannot run q {q.dtype} {tuple(q.shape)}: {reason}")
    if not 1 <= len(stores) <= 3:
        raise ValueError(f"1 to 3 kv stores, got {len(stores)}")
    flash_mla = import_flash_mla()
    t, h, d = q.shape
    kv = stores[0] if len(stores) == 1 else torch.cat(list(stores))
    hp = padded_heads(h)
    sink = sink.float()
    if hp != h:
        q = torch.cat([q, q.new_zeros(t, hp - h, d)], dim=1)
        sink = torch.cat([sink, sink.new_zeros(hp - h)])
    out, _, _ = flash_mla.flash_mla_sparse_fwd(
        q.contiguous(), kv.contiguous().unsqueeze(1), padded_rows(rows), scale, HEAD_DIM, sink.contiguous()
    )
    return out[:, :h]
