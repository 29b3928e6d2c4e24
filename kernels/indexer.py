"""Lightning-indexer reference: per-query scores over compressed index keys and top-k with -1 padding.

score(t, s) = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * index_head_dim^-0.5, w = weights_proj(x) * n_heads^-0.5.
Only entries visible to the query (`s < (t + 1) // 4`) compete; when fewer than k are visible the tail
of the result is -1.
"""

import torch


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
