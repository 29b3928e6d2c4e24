"""Lightning-indexer reference: per-query scores over compressed index keys and top-k with -1 padding.

score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * index_head_dim^-0.5, w = weights_proj(x) * n_heads^-0.5.
Only entries visible to the query (`s < (t + 1) // 4`) compete; when fewer than k are visible the tail
of the result is -1.

Candidates are passed per request, never per token: rows [B, S] (request b's entries 0..S-1 as key rows), each
token's request seg [T] and its visible count [T] (= (position + 1) // 4): token t sees rows[seg[t], :count[t]].
A [T, S] list would be 32 GiB of int64 at a 128K-token step of a 128K context. The scores of a long step are
made a query block at a time (`query_blocks`), each block's fp32 [block, S] within a byte budget, then top-k'd:
no step holds more than SCORES_BUDGET bytes of scores whatever its length or context. `quantize_query` is the query prologue of the quantised indexer (RoPE, Hadamard
rotation, MXFP4 / FP8 in the key packing), the reference of dsv4_kernels/triton_indexer_query.py.
"""

from collections.abc import Callable

import torch

from dsv4_kernels import geometry
from dsv4_kernels.hadamard import hadamard
from dsv4_kernels.rope import apply_rope


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q: [T, H, D]; keys: [T, S, D] (each query's gathered candidates); weights: [T, H] -> fp32 [T, S]."""
    dots = torch.einsum("thd,tsd->tsh", q.float(), keys.float())
    scale = q.shape[-1] ** -0.5
    return (torch.relu(dots) * scale * weights.float().unsqueeze(1)).sum(dim=-1)


def topk_visible(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores: [T, S]; visible: bool [T, S] -> int64 [T, k] candidate slots, -1 where fewer than k visible."""
    t, s = scores.shape
    if s < k:  # pad the candidate axis so topk always returns k columns
        scores = torch.nn.functional.pad(scores, (0, k - s), value=float("-inf"))
        visible = torch.nn.functional.pad(visible, (0, k - s), value=False)
    masked = scores.masked_fill(~visible, float("-inf"))
    top = masked.topk(k, dim=-1)
    picked_visible = visible.gather(1, top.indices)
    return torch.where(picked_visible, top.indices, torch.full_like(top.indices, -1))


def quantize_query(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, hadamard_rotate: bool = True):
    """Indexer query prologue: RoPE, Hadamard rotation, MXFP4 / FP8 quantisation in the indexer-key packing.

    q: [T, Hi, Di]; cos, sin: fp32 [T, rope_dim // 2]; layout: geometry.IndexerKeyLayout (index_head_dim >= Di,
    the extra channels zero). -> (values uint8 [T, Hi, layout.value_bytes], scales [T, Hi, layout.num_scales]
    (UE8M0 uint8 for mxfp4, fp32 for fp8), rotated q [T, Hi, Di] in q.dtype). Rotation and quantisation are
    those of the keys (dsv4_kernels.hadamard, geometry.pack_rows), so dequantised q . k approximates q . k.
    """
    x = apply_rope(q, cos, sin)
    if hadamard_rotate:
        x = hadamard(x)
    t, h, d = x.shape
    flat = torch.nn.functional.pad(x.reshape(t * h, d).float(), (0, layout.index_head_dim - d))
    rows = geometry.pack_rows(layout, flat)
    values = rows[:, : layout.value_bytes].reshape(t, h, -1)
    scales = rows[:, layout.value_bytes :].contiguous()
    scales = scales if layout.fmt == "mxfp4" else scales.view(torch.float32)
    return values, scales.reshape(t, h, -1), x


# Bytes of fp32 scores a step may hold at once (the kernels' and the reference's query blocks). V4-Flash at 1M
# context (S = 262144 index entries): 256 queries a block; at 128K (S = 32768): 2048.
SCORES_BUDGET = 256 << 20


def query_blocks(num_tokens: int, candidates: int, budget: int = SCORES_BUDGET) -> list[tuple[int, int]]:
    """[(t0, t1)] consecutive query ranges whose fp32 scores [t1 - t0, candidates] fit `budget` bytes (at least
    one query a block). Host ints only: the same split for the same shapes (CUDA graphs)."""
    per_block = max(1, budget // max(1, 4 * candidates))
    return [(t0, min(t0 + per_block, num_tokens)) for t0 in range(0, num_tokens, per_block)]


def check_candidates(rows: torch.Tensor, num_tokens: int, seg: torch.Tensor | None, count: torch.Tensor | None):
    """ValueError unless rows is int [R, S] and seg / count (when given) are int [T]; without seg, R == T."""
    if rows.dim() != 2 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32/int64 [R, S], got {rows.dtype} {tuple(rows.shape)}")
    if seg is None and rows.shape[0] != num_tokens:
        raise ValueError(f"rows must be [T={num_tokens}, S] without seg, got {tuple(rows.shape)}")
    for name, v in (("seg", seg), ("count", count)):
        if v is not None and (v.shape != (num_tokens,) or v.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name} must be int [T={num_tokens}], got {v.dtype} {tuple(v.shape)}")


def token_candidates(rows: torch.Tensor, num_tokens: int, seg: torch.Tensor | None, count: torch.Tensor | None):
    """(seg, count) with their defaults filled in (arange(T); S each), int64 contiguous, on rows' device."""
    dev = rows.device
    seg = torch.arange(num_tokens, device=dev) if seg is None else seg.to(dev, torch.int64).contiguous()
    count = (
        torch.full((num_tokens,), rows.shape[1], device=dev, dtype=torch.int64)
        if count is None
        else count.to(dev, torch.int64).contiguous()
    )
    return seg, count


def visible_topk(
    q: torch.Tensor,
    read_keys: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    seg: torch.Tensor,
    count: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    budget: int = SCORES_BUDGET,
) -> torch.Tensor:
    """The reference indexer over per-request candidates, a query block at a time (module docstring).

    q: [T, H, D]; read_keys: key rows [N] -> [N, D]; rows: int [B, S]; seg, count: int [T]; weights: [T, H].
    -> int64 [T, k] candidate columns, best first, -1 where fewer than k are visible (topk_visible's contract).
    Each block gathers its keys [block, S, D] and scores [block, S]: both bounded by the budget's block size."""
    t, s = q.shape[0], rows.shape[1]
    out = torch.full((t, k), -1, dtype=torch.int64, device=q.device)
    cols = torch.arange(s, device=q.device)
    for t0, t1 in query_blocks(t, s, budget):
        block_rows = rows[seg[t0:t1]]
        scores = indexer_scores(q[t0:t1], read_keys(block_rows.reshape(-1)).view(t1 - t0, s, -1), weights[t0:t1])
        out[t0:t1] = topk_visible(scores, cols < count[t0:t1].unsqueeze(1), k)
        del block_rows, scores  # before the next block's: one block's keys and scores alive at a time
    return out
