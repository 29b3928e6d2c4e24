"""Top-k columns of short rows of fp32 scores by a bitonic sort in registers, one program a row (Triton).

Why: the radix select (dsv4_kernels.triton_topk) spends its time in five dependent passes, each a 512-bin
histogram, a scan and a reduction over the whole row, whatever the row's length. A row that fits one program's
registers can instead be sorted outright: each score and its column are packed into one 64-bit key, Triton's
bitonic `tl.topk` keeps the k largest (triton >= 3.4; older builds leave every row to the radix kernels), and the
columns are unpacked from the low half. There is no histogram and no pass over global memory after the first load. The sort's work grows as
n log^2 n, so it wins only on short rows: on an H100 (`dsv4 bench kernels topk`, 512 picks) 8.9 us against the
radix kernel's 11.4 at 1,024 candidates (1.59x torch.topk), 9.5 against 11.9 at 64 rows of 1,024; at 2,048 it
loses (19.2 against 15.9), at 8,192 by 2x. triton_indexer.topk_of_scores sends it rows of at most
$DSV4_TOPK_SORT_MAX_CANDIDATES (1,024) candidates.

Contract: the same as dsv4_kernels.triton_topk's (int64 [T, k], the k largest scores' columns as a set; ties at the
k-th value go to the lowest columns, -0.0 below +0.0; -1 where the pick is -inf and past the row's length when
S < k). The picks come out in descending score order, which the contract does not promise.

Packing: the high 32 bits are the score's order key (triton_topk.order_keys: unsigned order = float order), the low
32 bits 0xFFFFFFFF - column, so among equal scores the lowest column sorts highest, and every packed key of a row
is distinct. Lanes past the row's end pack to 0, below every real key (the -inf key is 0x007FFFFF << 32).
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait
from dsv4_kernels.triton_topk import NEG_INF_KEY, order_keys, topk_arguments

triton, tl = import_triton()

SORT_MAX_CANDIDATES = 8192  # the longest row a program sorts (64-bit keys: 64 KB of registers at 8192)
HAS_TOPK = hasattr(tl, "topk")  # triton >= 3.4; on older builds the radix kernels take every row


@triton.jit
def _flip(x):
    """0xFFFFFFFF - x as uint32 (its own inverse): the column half of a packed key."""
    return x.to(tl.uint32) ^ tl.full(x.shape, 0xFFFFFFFF, tl.uint32)


@triton.jit
def _topk_sort_kernel(scores, out, S, K, stride_s, stride_o, BLOCK: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    """One row: BLOCK (>= S, >= KP) lanes; KP = k rounded up to a power of two (<= BLOCK)."""
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < S
    key = order_keys(tl.load(scores + row * stride_s + offs, mask=inside, other=0.0))
    packed = tl.where(inside, (key.to(tl.uint64) << 32) | _flip(offs).to(tl.uint64), 0)
    top = tl.topk(packed, KP)  # the KP largest packed keys, largest first
    slot = tl.arange(0, KP)
    col = _flip(top.to(tl.uint32)).to(tl.int64)  # the low half (a uint64 -> uint32 cast truncates)
    real = (top >> 32) > NEG_INF_KEY  # -inf picks and padding lanes have keys at or below it
    tl.store(out + row * stride_o + slot, tl.where(real, col, -1), mask=slot < K)


def sort_block(candidates: int, k: int) -> int:
    """The lanes a row of `candidates` takes: a power of two holding the row and k (at least 16)."""
    return triton.next_power_of_2(max(candidates, k, 16))


def topk_columns_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: fp32 [T, S] with S <= SORT_MAX_CANDIDATES (-inf = invalid) -> int64 [T, k]: the columns of each
    row's k largest scores (module docstring), best first. Equal as a set to triton_topk.topk_columns's picks."""
    scores, out = topk_arguments(scores, k, "topk_columns_sorted")
    t, s = scores.shape
    if s > SORT_MAX_CANDIDATES:
        raise ValueError(f"topk_columns_sorted takes rows of at most {SORT_MAX_CANDIDATES} candidates, got {s}")
    if k > SORT_MAX_CANDIDATES:
        raise ValueError(f"topk_columns_sorted takes k <= {SORT_MAX_CANDIDATES}, got {k}")
    if t == 0:
        return out
    if not HAS_TOPK:
        raise RuntimeError(f"topk_columns_sorted needs triton's tl.topk (triton >= 3.4), not in {triton.__version__}")
    block = sort_block(s, k)
    _topk_sort_kernel[(t,)](
        scores,
        out,
        s,
        k,
        scores.stride(0),
        out.stride(0),
        BLOCK=block,
        KP=max(2, triton.next_power_of_2(k)),  # tl.topk of 1 fails to compile on triton 3.6 (a scalar reshape)
        num_warps=8 if block >= 4096 else 4,
        **pdl_kwargs(scores),
    )
    return out
