"""Probabilistic drafts and the rejection-sampling verify of speculative decoding (sampled requests).

A sampled request (temperature > 0) drafts token i from q_i, the MTP layer's distribution under the request's
own temperature / top-k / top-p, and keeps q_i. The verify step's target distribution p_i (same filters) then
accepts draft d_i with probability min(1, p_i(d_i) / q_i(d_i)); the first rejected row emits a draw from
norm(max(p_i - q_i, 0)), and when every draft is accepted the row after them emits a draw from p (the bonus).
Whatever q is, each emitted token is distributed exactly as the non-speculative draw from p
(tests/engine/test_spec_sampling.py: chi-square on a small vocabulary, and a wrong sampler failing it).

Randomness is counter-based like engine.execution.sampling: every draw is keyed by (request seed, index of the
output token it decides, purpose), never by batch position, so a seeded request is reproducible whatever shares
its batch and however the prefill/decode hand-off splits it. Purposes: the draft itself (DRAFT), the
acceptance uniform (ACCEPT), and the emitted residual / bonus draw, which uses the plain per-token key
draw_seed(seed, index). A key may be drawn again for the same index after a rejection discarded the chain that
used it: nothing emitted so far depended on it, so the fresh use is still independent of the history.
All rows of a step run as one batch of tensor ops; the host reads (accepted, token, log-prob) per row once.
"""

from __future__ import annotations

import torch

from engine.execution.sampling import draw_seed, exp_noise_rows, exponential_race, filtered_probs, sampling_inputs

DRAFT, ACCEPT = 1, 2  # key purposes besides the plain per-token draw


def spec_seed(seed: int, index: int, purpose: int) -> int:
    """Draw seed for `purpose` (DRAFT, ACCEPT) of output token `index` of a request seeded with `seed`."""
    return draw_seed(draw_seed(seed, -1 - purpose), index)


def row_inputs(requests: list, device):
    """Per-row sampling parameters of `requests` (one a row) on `device` -> (temperature, top_k, top_p, filtered)."""
    params = [r.params for r in requests]
    t, k, p, _ = sampling_inputs(
        [q.temperature for q in params], [q.top_k for q in params], [q.top_p for q in params], [0] * len(params), device
    )
    return t, k, p, any(q.top_k > 0 or q.top_p < 1.0 for q in params)


def draw_drafts(logits: torch.Tensor, requests: list, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits fp32 [N, V] of sampled requests, row i deciding output token indices[i] of requests[i]
    -> (int64 [N] drafts drawn from q, fp32 [N, V] q: the request's filtered distribution of the draft logits)."""
    return draw_drafts_seeded(logits, requests, [spec_seed(r.seed, i, DRAFT) for r, i in zip(requests, indices)])


def draw_drafts_seeded(
    logits: torch.Tensor, requests: list, seeds: list[int] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_drafts` with the rows' DRAFT seeds given (a list, or int64 [N] on the device when the output index they
    key depends on this step's acceptance, still on the device: engine.execution.spec_fixed)."""
    t, k, p, filtered = row_inputs(requests, logits.device)
    q = filtered_probs(logits, t, k, p, filtered)
    return exponential_race(q, seeds), q


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution (unnormalised) a rejected row emits from: max(p - q, 0). A rejection has probability
    sum(max(p - q, 0)), so an all-zero row (p == q up to rounding) is never meant to emit; p stands in there."""
    r = (p - q).clamp_min(0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def verify_sampled(
    logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, requests: list, indices: list[int]
) -> torch.Tensor:
    """Rejection sampling over verify rows. logits: the target's fp32 [R, V]; drafts: int64 [R] (the draft row i
    verifies; -1 on a bonus row, the one after a request's drafts); q: fp32 [R, V] (the drafts' q; zeros on bonus
    rows); requests[i] / indices[i]: row i's request and the output index it decides.
    -> fp64 [3, R]: accepted (1/0; 0 on bonus rows), the token the row emits if it is reached (the draft when
    accepted, else the residual / bonus draw), that token's log-prob under the raw target logits. A request
    emits its rows up to and including its first row not accepted."""
    accept = [spec_seed(r.seed, i, ACCEPT) for r, i in zip(requests, indices)]
    return verify_sampled_seeded(
        logits, drafts, q, requests, accept, [draw_seed(r.seed, i) for r, i in zip(requests, indices)]
    )


def verify_sampled_seeded(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor,
    requests: list,
    accept_seeds: list[int] | torch.Tensor,
    emit_seeds: list[int] | torch.Tensor,
) -> torch.Tensor:
    """`verify_sampled` with each row's ACCEPT and emit seeds given (lists, or int64 [R] on the device when the output
    index they key is known only there: engine.execution.spec_fixed's overlapped steps)."""
    t, k, top_p, filtered = row_inputs(requests, logits.device)
    p = filtered_probs(logits, t, k, top_p, filtered)
    bonus = drafts < 0
    d = drafts.clamp_min(0).unsqueeze(1)
    pd, qd = p.gather(1, d).squeeze(1), q.gather(1, d).squeeze(1)
    u = torch.exp(-exp_noise_rows(accept_seeds, 1, logits.device)[:, 0])  # U(0, 1]
    accepted = (u * qd <= pd) & (pd > 0) & ~bonus  # probability min(1, p(d) / q(d))
    emit = exponential_race(residual(p, q), emit_seeds)
    tokens = torch.where(accepted, drafts, emit)
    lps = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return torch.stack([accepted.double(), tokens.double(), lps.double()])


def accepted_prefix(accepted: list[float], first: int, n: int) -> int:
    """Rows first .. first + n - 1 of one request (its drafts) -> how many lead accepted (host side, <= K)."""
    a = 0
    while a < n and accepted[first + a]:
        a += 1
    return a
