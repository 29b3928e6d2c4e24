"""Sparse MQA attention reference over gathered keys with a per-head sink.

V4 attends from every query head to one shared latent that is both K and V. The keys of a query are
[its SWA window of raw KV | its selected or visible compressed entries]; the caller gathers them and
passes a validity mask. The sink is one extra logit per head whose probability mass is discarded.
"""

import torch


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [T, H, D]; kv: [T, K, D]; valid: bool [T, K]; sink: fp32 [H] -> [T, H, D] in q.dtype.

    Logits and softmax run in fp32; a query with no valid key returns the zero vector (all mass on the sink).
    """
    logits = torch.einsum("thd,tkd->thk", q.float(), kv.float()) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sinks = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    combined = torch.cat([logits, sinks], dim=-1)
    probs = combined.softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, kv.float()).to(q.dtype)


def grouped_output_projection(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, groups: int) -> torch.Tensor:
    """o: [T, H, D]; wo_a: [G * R, H * D / G]; wo_b: [hidden, G * R] -> [T, hidden].

    Heads are split into G groups; each group's H*D/G features are projected to R by its own slice of
    wo_a (a block-diagonal matmul), then wo_b mixes the G*R features.
    """
    t = o.shape[0]
    x = o.reshape(t, groups, -1).transpose(0, 1)  # [G, T, H*D/G]
    w = wo_a.view(groups, -1, wo_a.shape[-1]).transpose(1, 2)  # [G, H*D/G, R]
    y = torch.bmm(x, w).transpose(0, 1).reshape(t, -1)  # [T, G*R]
    return y @ wo_b.t()
