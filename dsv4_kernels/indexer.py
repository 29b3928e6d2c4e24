"""Lightning-indexer reference: per-query scores over compressed index keys and top-k with -1 padding.

score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * index_head_dim^-0.5, w = weights_proj(x) * n_heads^-0.5.
Only entries visible to the query (`s < (t + 1) // 4`) compete; when fewer than k are visible the tail
of the result is -1. `quantize_query` is the query prologue of the quantised indexer (RoPE, Hadamard
rotation, MXFP4 / FP8 in the key packing), the reference of dsv4_kernels/triton_indexer_query.py.
"""

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
