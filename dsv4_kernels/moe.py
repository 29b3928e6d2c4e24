"""MoE references: sqrt-softplus routing (biased top-k or hash table) and clamped SwiGLU experts."""

import torch
import torch.nn.functional as F


def score_experts(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """logits: fp32 [T, E] -> fp32 [T, E] affinity scores."""
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    top_k: int,
    scaling: float,
    scoring_func: str = "sqrtsoftplus",
    bias: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H]; gate: [E, H]. Hash layers pass tid2eid [V, k] and token_ids [T]; others pass bias [E].

    -> (weights fp32 [T, k], expert ids int64 [T, k]). Selection uses scores + bias; weights are the
    unbiased scores of the picked experts, renormalised, times `scaling`.
    """
    logits = x.float() @ gate.float().t()
    scores = score_experts(logits, scoring_func)
    if tid2eid is not None:
        ids = tid2eid[token_ids].long()
    else:
        biased = scores if bias is None else scores + bias.float()
        ids = biased.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit). V4 always clamps (limit 10 in real configs)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    """One SwiGLU expert. x: [N, H]; w1, w3: [I, H]; w2: [H, I] -> [N, H]."""
    return swiglu(x @ w1.t(), x @ w3.t(), limit) @ w2.t()


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Routed experts, grouped by expert (sort tokens, one matmul per used expert).

    x: [T, H]; weights: [T, k]; ids: [T, k]; w1, w3: [E, I, H]; w2: [E, H, I] -> [T, H].
    An id of -1 (a pair routed to an expert another expert-parallel rank holds) is skipped.
    """
    t, k = ids.shape
    e = w1.shape[0]
    flat_ids = torch.where(ids >= 0, ids, e).reshape(-1)  # skipped pairs sort after every expert's
    order = flat_ids.argsort(stable=True)
    token_of = order // k
    counts = torch.bincount(flat_ids, minlength=e + 1)[:e].tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        y = expert_mlp(x[rows], w1[expert], w2[expert], w3[expert], limit)
        y = y * weights.reshape(-1)[order[start : start + n]].unsqueeze(-1).to(y.dtype)
        out.index_add_(0, rows, y.to(out.dtype))
        start += n
    return out


def moe_experts_grouped(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """`moe_experts` without a host sync or a Python loop: tokens sorted by expert, three grouped GEMMs.

    Same shapes and semantics as `moe_experts` (-1 ids skipped). Every shape depends only on T and k (the
    per-expert split travels as device offsets), so the call can be captured in a CUDA graph. Needs
    `torch._grouped_mm` (bf16 on Hopper; fp32 on the CPU).
    """
    t, k = ids.shape
    e = w1.shape[0]
    flat = torch.where(ids >= 0, ids, e).reshape(-1)  # skipped pairs sort last, past the last group
    order = flat.argsort(stable=True)
    rows = order // k
    # scatter_add, not bincount: bincount reads its max back to the host on CUDA (breaks graph capture).
    counts = torch.zeros(e + 1, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts[:e], 0, dtype=torch.int32)
    xs = x.index_select(0, rows)
    gate = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)
    up = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(swiglu(gate, up, limit).to(x.dtype), w2.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(y.dtype)
    # Rows past the last group's offset (skipped pairs) are not written by the grouped GEMMs: select, not scale.
    y = torch.where((flat.index_select(0, order) < e).unsqueeze(-1), y, 0)
    # Each pair back to its (token, slot) row, then one sum over the k slots: deterministic (CUDA's index_add_
    # adds with atomics in no fixed order, so two runs of one prompt could round apart) and one rounding a token.
    pairs = torch.empty((t * k, x.shape[1]), dtype=y.dtype, device=x.device).index_copy_(0, order, y)
    return pairs.view(t, k, -1).sum(1).to(x.dtype)


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")
