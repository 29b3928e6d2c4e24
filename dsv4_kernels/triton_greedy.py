"""Triton greedy pick: each row's argmax token and its log-probability in two small launches.

`engine.execution.sampling.greedy_pick` runs inside the decode CUDA graph every step. In torch it is `argmax` (a
single-block reduce per row) plus a full `log_softmax` whose only used entry is the argmax's: two passes over a
129280-wide row, each by one block at batch 1. Here the row is read once by many programs:

- stage 1, grid (N, cdiv(V, BLOCK_V)): each program reduces its slice of the row to its maximum, the first
  index attaining it, and sum(exp(x - max)) (fp32 / int32 scratch [N, nblocks]);
- stage 2, grid (N,): M = max of the block maxima, token = the smallest index among blocks whose maximum is M
  (the row's first maximum, as torch.argmax), S = sum_b s_b * exp(m_b - M), and the token's log-softmax is
  x[token] - M - log S = -log S. Written straight into the fp64 [2, N] output (tokens, log-probs).

No host sync and shapes fixed by (N, V), so it can be captured in a CUDA graph (H200, graph replay, V=129280:
3.9 us at N=1, 4.8 us at N=8, 14 us at N=64, against 62 / 63 / 84 us for the torch ops). Edge rows follow torch: a
row with a NaN picks its first NaN, log-prob NaN; an all -inf row picks 0, log-prob NaN; a row with +inf
picks its first +inf, log-prob NaN. NaN is found explicitly (x != x): tl.max need not propagate NaN on the GPU,
while the interpreter's numpy does.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

BLOCK_V = 4096


@triton.jit
def _greedy_partial_kernel(
    logits_ptr, max_ptr, idx_ptr, sum_ptr, V, stride_l, NB, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < V
    x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=float("-inf"))
    is_nan = x != x
    nan_idx = tl.min(tl.where(is_nan, cols, V), axis=0)  # V: no NaN in this block
    xs = tl.where(is_nan, float("-inf"), x)
    m = tl.max(xs, axis=0)
    i = blk * BLOCK + tl.argmax(xs, axis=0, tie_break_left=True)
    # No inf - inf: an all -inf slice sums exp(-inf) = 0; a +inf maximum makes the log-prob NaN in stage 2.
    s = tl.sum(tl.exp(xs - tl.where(tl.abs(m) == float("inf"), 0.0, m)), axis=0)
    has_nan = nan_idx < V
    m = tl.where(has_nan, float("nan"), m)
    i = tl.where(has_nan, nan_idx, i)
    out = row * NB + blk
    tl.store(max_ptr + out, m)
    tl.store(idx_ptr + out, i)
    tl.store(sum_ptr + out, s)


@triton.jit
def _greedy_combine_kernel(max_ptr, idx_ptr, sum_ptr, out_ptr, N, NB, NB_P2: tl.constexpr, PDL: tl.constexpr):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, NB_P2)
    ok = b < NB
    mb = tl.load(max_ptr + row * NB + b, mask=ok, other=float("-inf"))
    ib = tl.load(idx_ptr + row * NB + b, mask=ok, other=2147483647)
    sb = tl.load(sum_ptr + row * NB + b, mask=ok, other=0.0)
    nan_b = mb != mb
    any_nan = tl.max(nan_b.to(tl.int32), axis=0) > 0
    mf = tl.where(nan_b, float("-inf"), mb)
    big_m = tl.max(mf, axis=0)
    pick = tl.where(any_nan, nan_b, (mf == big_m) & ok)
    token = tl.min(tl.where(pick, ib, 2147483647), axis=0)
    # torch's log-prob is NaN for a row with a NaN, an all -inf row and a row with +inf; no inf - inf below.
    bad = any_nan | (tl.abs(big_m) == float("inf"))
    w = tl.where(mf == float("-inf"), 0.0, sb * tl.exp(mf - tl.where(bad, 0.0, big_m)))
    total = tl.sum(w, axis=0)  # >= 1 unless bad: the maximum's own slice holds exp(0)
    lp = tl.where(bad, float("nan"), -tl.log(tl.where(bad, 1.0, total)))
    tl.store(out_ptr + row, token.to(tl.float64))
    tl.store(out_ptr + N + row, lp.to(tl.float64))


def greedy_pick(logits: torch.Tensor, block_v: int = BLOCK_V) -> torch.Tensor:
    """logits: fp32 [N, V] (unit last stride) -> fp64 [2, N]: each row's first argmax token (exact in fp64) and
    its log-softmax, as engine.execution.sampling.greedy_pick. block_v: the stage-1 slice (a power of two; tests shrink
    it to exercise many blocks)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [N, V], got {logits.dtype} {tuple(logits.shape)}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(
            f"logits must have unit last stride, got strides {tuple(logits.stride())} for shape {tuple(logits.shape)}"
        )
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    n, vocab = logits.shape
    out = torch.empty(2, n, dtype=torch.float64, device=logits.device)
    if n == 0:
        return out
    if vocab == 0:
        raise ValueError(f"logits must have a non-empty vocabulary, got shape {tuple(logits.shape)}")
    require_triton(logits.device)
    nb = triton.cdiv(vocab, block_v)
    maxima = torch.empty(n, nb, dtype=torch.float32, device=logits.device)
    firsts = torch.empty(n, nb, dtype=torch.int32, device=logits.device)
    sums = torch.empty(n, nb, dtype=torch.float32, device=logits.device)
    _greedy_partial_kernel[(n, nb)](
        logits,
        maxima,
        firsts,
        sums,
        vocab,
        logits.stride(0),
        nb,
        BLOCK=block_v,
        num_warps=8 if block_v >= 2048 else 4,
        **pdl_kwargs(logits),
    )
    _greedy_combine_kernel[(n,)](
        maxima, firsts, sums, out, n, nb, NB_P2=max(triton.next_power_of_2(nb), 16), num_warps=1, **pdl_kwargs(maxima)
    )
    return out
