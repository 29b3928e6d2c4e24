"""Routed experts held as FP8 e4m3 with 128x128 block scales (a prefill engine's format), their contiguous grouped
layout, and the plain-torch references the DeepGEMM path (dsv4_kernels.deepgemm_moe) must match.

Layout (DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous`): the (token, slot) pairs are sorted by expert and each
expert's segment is padded to the kernel's M alignment A (`deep_gemm.get_mk_alignment_for_contiguous_layout()`,
128 on sm90), so no M tile spans two experts; `m_indices` gives every padded row its expert, -1 for padding rows
(the kernel skips tiles whose first row is -1). Two row counts M:
- bound (`padded_rows`): roundup(P + min(E, P) (A - 1) + 1, A), known from the shapes alone, so building the layout
  reads nothing back to the host (no sync: CUDA-graph safe; the unused tail is all -1 and skipped). At V4-Flash's
  256 experts top-6 that is 81,792 rows for 8K tokens' 49,152 pairs: the kernel still walks the empty tiles;
- exact (`exact=True`): sum over experts of roundup(count, A) (one tile at least), read back once (one host sync
  per call, i.e. per MoE layer of a step). For eager steps (prefill is not captured). Under uniform routing at
  8K tokens each expert's ~192 pairs round up to 256: 65,536 rows (bound 81,792); at 2K, 32,768 (bound 44,928).
The two give the same rows to the same pairs in the same order; only the padding after the last segment differs.
Pairs another expert-parallel rank serves (id -1) get no row (`pair_row` -1).

References:
- `fp8_moe_ref`: what the DeepGEMM path computes: x quantised per token in 1x128 blocks (as every FP8 projection
  here), gate|up = x_q W13^T, the clamped SwiGLU rounded to the dtype and quantised 1x128 again, y = act_q W2^T
  rounded to the dtype, then the routing-weighted k-way sum in fp32 (rounded once) plus `shared`.
- The engine's CPU path for FP8 experts dequantises the experts a call uses and runs dsv4_kernels.moe's
  reference (`Fp8Experts.dequant`), as it does for packed MXFP4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_kernels import mxfp4_fp8
from dsv4_kernels.fp8_linear import dequant_act, quant_act_1x128
from dsv4_kernels.moe import swiglu

DEFAULT_ALIGN = 128  # DeepGEMM's sm90 contiguous-layout alignment; the fast path asks deep_gemm for its own


@dataclass(frozen=True)
class Fp8Experts:
    """One layer's routed experts in FP8: w13 e4m3 [E, 2I, H] (gate rows, then up rows) with fp32 scales
    s13 [E, 2I/128, H/128]; w2 e4m3 [E, H, I] with s2 [E, H/128, I/128]. pow2_act: activation scales rounded up to
    powers of two (V4's ue8m0 scale_fmt)."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    pow2_act: bool = True

    def __post_init__(self):
        e, n2, h = self.w13.shape
        if self.w13.dtype != torch.float8_e4m3fn or self.w2.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Experts weights must be float8_e4m3fn, got {self.w13.dtype}, {self.w2.dtype}")
        if tuple(self.w2.shape) != (e, h, n2 // 2):
            raise ValueError(f"Fp8Experts w2 must be [E, H, I] = {(e, h, n2 // 2)}, got {tuple(self.w2.shape)}")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2))

    def dequant(self, experts: torch.Tensor, dtype: torch.dtype):
        """Dense (w1 [n, I, H], w2 [n, H, I], w3 [n, I, H]) of the given expert ids, in `dtype`."""
        w13 = mxfp4_fp8.dequant(self.w13[experts], self.s13[experts], dtype)
        w2 = mxfp4_fp8.dequant(self.w2[experts], self.s2[experts], dtype)
        return w13[:, : self.inter], w2, w13[:, self.inter :]


def from_packed(
    w1, s1, w2, s2, w3, s3, report: mxfp4_fp8.ConversionReport | None = None, name: str = "", pow2_act: bool = True
) -> Fp8Experts:
    """MXFP4 experts as engine.model.moe.PackedExperts holds them (w1, w3: uint8 [E, I, H/2], scales [E, I, H/32];
    w2: [E, H, I/2], [E, H, I/32]) -> Fp8Experts on the same device (dsv4_kernels.mxfp4_fp8.convert)."""
    q1, t1 = mxfp4_fp8.convert(w1, s1, report, name + "w1")
    q3, t3 = mxfp4_fp8.convert(w3, s3, report, name + "w3")
    w13, s13 = torch.cat([q1, q3], 1), torch.cat([t1, t3], 1)
    del q1, q3
    q2, t2 = mxfp4_fp8.convert(w2, s2, report, name + "w2")
    return Fp8Experts(w13, s13, q2, t2, pow2_act)


@dataclass(frozen=True)
class ContiguousLayout:
    """pair_row int64 [P]: padded row of each (token, slot) pair (t * k + slot order), -1 for a skipped pair;
    src_token int64 [M]: the token each padded row reads (0 on padding rows); m_indices int32 [M]: expert of each
    padded row, -1 on padding rows. M = `padded_rows(P, E, align)`."""

    pair_row: torch.Tensor
    src_token: torch.Tensor
    m_indices: torch.Tensor

    @property
    def rows(self) -> int:
        return self.m_indices.shape[0]


def padded_rows(pairs: int, num_experts: int, align: int) -> int:
    """Rows of the bound layout (no sync): every used expert's segment rounds up by < align rows, plus one row
    (the layout always ends in padding)."""
    raw = pairs + min(num_experts, pairs) * (align - 1) + 1
    return -(-raw // align) * align


def exact_rows(counts: torch.Tensor, align: int) -> int:
    """Rows of the exact layout from the per-expert pair counts int64 [E] (one host sync): every segment rounded up
    to `align`, one tile at least (the kernel is never handed M = 0)."""
    return max(align, int(((counts + align - 1) // align * align).sum()))


def contiguous_layout(
    ids: torch.Tensor, num_experts: int, align: int = DEFAULT_ALIGN, exact: bool = False
) -> ContiguousLayout:
    """ids: int [T, k] (-1 = another rank's expert) -> ContiguousLayout, on ids' device: the bound row count
    without a host sync, or (`exact`) the exact one after one (module docstring). Pairs keep their (token, slot)
    order within an expert's segment (stable sort)."""
    t, k = ids.shape
    p, e, dev = t * k, num_experts, ids.device
    flat = torch.where(ids >= 0, ids, e).reshape(-1).long()  # skipped pairs sort after every expert
    order = flat.argsort(stable=True)
    sorted_e = flat.index_select(0, order)
    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # scatter_add: bincount syncs on CUDA
    m = exact_rows(counts[:e], align) if exact else padded_rows(p, e, align)
    first = torch.cumsum(counts, 0) - counts  # [E + 1] sorted position of each expert's first pair
    padded = (counts[:e] + align - 1) // align * align
    seg = torch.cumsum(padded, 0) - padded  # [E] first padded row of each expert's segment
    # Skipped pairs write row m, one past the layout (the buffers hold m + 1 rows; the layout is their first m).
    seg = torch.cat([seg, seg.new_full((1,), m)])
    rank = torch.arange(p, device=dev) - first.index_select(0, sorted_e)
    row_sorted = seg.index_select(0, sorted_e) + torch.where(sorted_e < e, rank, 0)
    dump = torch.empty(p, dtype=torch.int64, device=dev).index_copy_(0, order, row_sorted)  # pair -> row
    pair_row = torch.where(flat < e, dump, -1)
    tokens = torch.arange(p, device=dev) // k
    src_token = torch.zeros(m + 1, dtype=torch.int64, device=dev).index_copy_(0, dump, tokens)[:m]
    expert = torch.where(flat < e, flat, -1).to(torch.int32)
    m_indices = torch.full((m + 1,), -1, dtype=torch.int32, device=dev).index_copy_(0, dump, expert)[:m]
    return ContiguousLayout(pair_row, src_token, m_indices)


def layout_ref(ids: torch.Tensor, num_experts: int, align: int = DEFAULT_ALIGN, exact: bool = False):
    """Plain loop of `contiguous_layout` (the test's oracle): -> (pair_row list, src_token list, m_indices list)
    over the same M rows."""
    t, k = ids.shape
    flat = ids.reshape(-1).tolist()
    sizes = [-(-flat.count(ex) // align) * align for ex in range(num_experts)]
    m = max(align, sum(sizes)) if exact else padded_rows(t * k, num_experts, align)
    pair_row, src, mi = [-1] * len(flat), [0] * m, [-1] * m
    row = 0
    for ex in range(num_experts):
        pairs = [i for i, x in enumerate(flat) if x == ex]
        for j, i in enumerate(pairs):
            pair_row[i], src[row + j], mi[row + j] = row + j, i // k, ex
        row += sizes[ex]
    return pair_row, src, mi


def fp8_moe_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    ex: Fp8Experts,
    limit: float,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """The DeepGEMM path's function in plain torch (fp32 products of the quantised operands; module docstring).
    x: [T, H] (bf16 on the GPU); weights float [T, k]; ids int [T, k] (-1 skipped) -> [T, H] in x.dtype."""
    t, k = ids.shape
    out = torch.zeros(t, ex.hidden, dtype=torch.float32, device=x.device)
    xq = dequant_act(*quant_act_1x128(x, ex.pow2_act))
    for e in ids[ids >= 0].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13 = mxfp4_fp8.dequant(ex.w13[e], ex.s13[e])
        h = (xq[tok] @ w13.t()).to(x.dtype)
        act = swiglu(h[:, : ex.inter], h[:, ex.inter :], limit)  # rounded as the Triton SwiGLU rounds it
        aq = dequant_act(*quant_act_1x128(act, ex.pow2_act))
        y = (aq @ mxfp4_fp8.dequant(ex.w2[e], ex.s2[e]).t()).to(x.dtype)
        out.index_add_(0, tok, y.float() * weights[tok, slot].float().unsqueeze(-1))
    out = out.to(x.dtype)
    return out if shared is None else (out.float() + shared.float()).to(x.dtype)
