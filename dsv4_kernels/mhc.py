"""Manifold-constrained hyper-connections (mHC) reference.

The residual is `hc` parallel streams. From the RMS-normalised flattened streams one linear map gives
pre (hc), post (hc) and comb (hc x hc) logits: pre = sigmoid + eps, post = 2 * sigmoid,
comb = softmax(rows) + eps then Sinkhorn (a column normalisation, then iters-1 x (row, column)).
Block input = sum_i pre_i * stream_i; new streams = post * block_out + comb^T @ streams.
All mixing weights are computed in fp32.
"""

import torch

from dsv4_kernels.norm import unweighted_rms_norm


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb: [..., hc, hc] positive -> approximately doubly stochastic [..., hc, hc]."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
):
    """streams: [T, hc, D]; fn: [(2+hc)*hc, hc*D]; base: [(2+hc)*hc]; scale: [3].

    -> (collapsed [T, D] in streams.dtype, post fp32 [T, hc], comb fp32 [T, hc, hc]).
    """
    t, hc, _ = streams.shape
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    mixes = flat @ fn.float().t()
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(t, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = sinkhorn(comb, iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """block_out: [T, D]; streams: [T, hc, D]; post: [T, hc]; comb: [T, hc, hc] -> [T, hc, D]."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


def hc_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Collapse the streams before the final norm. streams: [T, hc, D]; fn: [hc, hc*D] -> [T, D]."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    pre = torch.sigmoid((flat @ fn.float().t()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
