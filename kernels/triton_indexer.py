"""Triton lightning-indexer logits over paged key rows, then top-k with -1 padding.

Reference: `kernels.indexer.indexer_scores` + `topk_visible`. For query t and candidate s (row rows[t, s]
of a key store, -1 = not visible):
    score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . key[rows[t, s]]) * Di^-0.5,   -inf when invalid.
One program scores BLOCK_S candidates of one token against all its index heads with a single
[BLOCK_S, Di] x [Di, Hi] dot, so keys are read once per token straight from the store (no [T, S, Di]
gather). Decode has few tokens but thousands of candidates, so the grid is (T, S / BLOCK_S).

Key stores: plain rows [R, Di] (the exact cache), or the paged indexer cache of kernels/geometry.py
(`IndexerKeyLayout`): FP8 e4m3 with one fp32 scale per 128 values, or MXFP4 (e2m1 nibbles, element 2i
in the low nibble, one UE8M0 scale per 32 values), dequantised in registers. Dequantised values are
exact in bf16 (few mantissa bits times a power of two), so bf16 tensor-core dots lose nothing on them.

Selection uses torch.topk on the kernel's scores for now (the score pass is the bandwidth-bound part;
a fused radix/bitonic top-k is the next step). As in the reference, near-ties may order differently
from another implementation whose scores differ in the last bits.

Interpreter note: bf16 values are converted to fp32 right after loading (triton 3.x's interpreter does
bf16 arithmetic on the raw bits); the GPU path feeds bf16 operands to tl.dot.
"""

from __future__ import annotations

import torch

from kernels.geometry import IndexerKeyLayout
from kernels.gpu import import_triton, require_triton

triton, tl = import_triton()

_PLAIN, _FP8, _MXFP4 = 0, 1, 2


@triton.jit
def _ue8m0(byte):
    """UE8M0 byte b -> fp32 2**(b - 127), built from the exponent bits (exact, unlike ex2.approx)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_keys(k_ptr, r, ok, cols, cmask, DI, stride_kr, block_size, VALUE_BYTES: tl.constexpr,
               SCALE_BYTES: tl.constexpr, FMT: tl.constexpr, DI_P: tl.constexpr, BLOCK_S: tl.constexpr):
    """Keys of rows / slots r (int64 [BLOCK_S]) -> fp32 [BLOCK_S, DI_P], 0 where masked."""
    mask = ok[:, None] & cmask[None, :]
    if FMT == 0:
        keys = tl.load(k_ptr + r[:, None] * stride_kr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        # Paged layout: block = r // block_size holds all its value rows, then all its scale rows.
        blk = r // block_size
        pos = r - blk * block_size
        base = blk * stride_kr
        vrow = base + pos * VALUE_BYTES
        srow = base + block_size * VALUE_BYTES + pos * SCALE_BYTES
        if FMT == 1:
            codes = tl.load(k_ptr + vrow[:, None] + cols[None, :], mask=mask, other=0)
            vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            GROUP: tl.constexpr = 128
        else:
            packed = tl.load(k_ptr + vrow[:, None] + (cols // 2)[None, :], mask=mask, other=0).to(tl.int32)
            nib = (packed >> ((cols % 2) * 4)[None, :]) & 0xF
            # e2m1: exponent field e = bits 1-2, mantissa m = bit 0; e == 0 is the subnormal 0 / 0.5.
            e = (nib >> 1) & 3
            m = (nib & 1).to(tl.float32)
            mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
            vals = tl.where((nib & 8) != 0, -mag, mag)
            GROUP: tl.constexpr = 32
        # One scale per GROUP values, loaded once as [BLOCK_S, DI_P / GROUP] and broadcast over its group.
        NG: tl.constexpr = DI_P // GROUP
        g = tl.arange(0, NG)
        gmask = ok[:, None] & (g * GROUP < DI)[None, :]
        if FMT == 1:
            sptr = (k_ptr + srow[:, None] + 4 * g[None, :]).to(tl.pointer_type(tl.float32))
            scale = tl.load(sptr, mask=gmask, other=0.0)
        else:
            scale = _ue8m0(tl.load(k_ptr + srow[:, None] + g[None, :], mask=gmask, other=127))
        keys = tl.reshape(tl.reshape(vals, [BLOCK_S, NG, GROUP]) * scale[:, :, None], [BLOCK_S, DI_P])
    return keys


@triton.jit
def _indexer_scores_kernel(q_ptr, k_ptr, rows_ptr, w_ptr, out_ptr, HI, DI, S, scale, block_size,
                           stride_qt, stride_qh, stride_kr, stride_rt, stride_wt, stride_ot,
                           HI_P: tl.constexpr, DI_P: tl.constexpr, BLOCK_S: tl.constexpr,
                           FMT: tl.constexpr, VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                           BF16_DOT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cand = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    heads = tl.arange(0, HI_P)
    cols = tl.arange(0, DI_P)
    hmask = heads < HI
    cmask = cols < DI
    r = tl.load(rows_ptr + t * stride_rt + cand, mask=cand < S, other=-1).to(tl.int64)
    ok = r >= 0
    r = tl.where(ok, r, 0)
    keys = _load_keys(k_ptr, r, ok, cols, cmask, DI, stride_kr, block_size, VALUE_BYTES, SCALE_BYTES, FMT, DI_P,
                      BLOCK_S)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                mask=hmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    if BF16_DOT:
        dots = tl.dot(keys.to(tl.bfloat16), tl.trans(q.to(tl.bfloat16)))
    else:
        dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
    # Padded heads load w = 0, so they add nothing.
    w = tl.load(w_ptr + t * stride_wt + heads, mask=hmask, other=0.0).to(tl.float32)
    score = tl.sum(tl.maximum(dots, 0.0) * scale * w[None, :], axis=1)
    score = tl.where(ok, score, float("-inf"))
    tl.store(out_ptr + t * stride_ot + cand, score, mask=cand < S)


def _check_keys(keys: torch.Tensor, layout: IndexerKeyLayout | None, di: int) -> None:
    if layout is None:
        if keys.dim() != 2 or keys.shape[1] != di or keys.stride(-1) != 1:
            raise ValueError(f"keys must be [R, Di={di}] with unit stride on the last dim, got {tuple(keys.shape)}")
        return
    if not isinstance(layout, IndexerKeyLayout):
        raise TypeError(f"layout must be an IndexerKeyLayout or None, got {type(layout).__name__}")
    if layout.index_head_dim != di:
        raise ValueError(f"layout.index_head_dim {layout.index_head_dim} != q's Di {di}")
    if keys.dtype != torch.uint8 or keys.dim() != 2 or keys.stride(-1) != 1 or keys.shape[1] < layout.block_bytes():
        raise ValueError(f"keys must be a uint8 cache [blocks, >= {layout.block_bytes()}] with unit last stride, "
                         f"got {keys.dtype} {tuple(keys.shape)}")
    if layout.fmt == "fp8" and (keys.stride(0) % 4 or keys.data_ptr() % 4):
        raise ValueError(f"an fp8 indexer cache must be 4-byte aligned (fp32 scales), got stride {keys.stride(0)}")


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                   layout: IndexerKeyLayout | None = None, *, block_s: int = 64) -> torch.Tensor:
    """Indexer logits of each token's candidates, read from a key store.

    q: [T, Hi, Di] fp32/bf16 (last dim contiguous); rows: int32/int64 [T, S], -1 = invalid;
    weights: [T, Hi] (already times Hi^-0.5); keys, by `layout`:
    - None: plain rows [R, Di] (row stride free, last dim contiguous), rows index them;
    - IndexerKeyLayout (fmt "fp8" or "mxfp4"): uint8 paged cache [blocks, >= layout.block_bytes()],
      rows are global slots (slot s = block s // block_size, position s % block_size).
    -> fp32 [T, S], -inf where rows < 0. Equals `kernels.indexer.indexer_scores(q, K, weights)` on the
    valid entries, K = the (dequantised) keys of rows.clamp(min=0).
    """
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, Hi, Di] with unit stride on the last dim, got {tuple(q.shape)}")
    t, hi, di = q.shape
    _check_keys(keys, layout, di)
    if rows.dim() != 2 or rows.shape[0] != t or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32/int64 [T={t}, S], got {rows.dtype} {tuple(rows.shape)}")
    if weights.shape != (t, hi):
        raise ValueError(f"weights must be [T={t}, Hi={hi}], got {tuple(weights.shape)}")
    if block_s < 16:
        raise ValueError(f"block_s must be >= 16 (tl.dot), got {block_s}")
    require_triton(q.device)
    s = rows.shape[1]
    out = torch.empty(t, s, dtype=torch.float32, device=q.device)
    if t == 0 or s == 0:
        return out
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    fmt = _PLAIN if layout is None else (_FP8 if layout.fmt == "fp8" else _MXFP4)
    # Dequantised keys are exact in bf16, so quantized stores take the bf16 dot whenever q is bf16.
    bf16_dot = q.is_cuda and q.dtype == torch.bfloat16 and (layout is not None or keys.dtype == torch.bfloat16)
    # sm_90 compiles at Hi=64, Di=128, BLOCK_S=64: plain keys fit 4 warps; dequantising needs 8 to not spill.
    extra = {"num_warps": 4 if layout is None else 8, "num_stages": 2} if q.is_cuda else {}
    _indexer_scores_kernel[(t, triton.cdiv(s, block_s))](
        q, keys, rows, weights, out, hi, di, s, di**-0.5, 1 if layout is None else layout.block_size,
        q.stride(0), q.stride(1), keys.stride(0), rows.stride(0), weights.stride(0), out.stride(0),
        HI_P=max(16, triton.next_power_of_2(hi)), DI_P=max(16, triton.next_power_of_2(di)), BLOCK_S=block_s,
        FMT=fmt, VALUE_BYTES=0 if layout is None else layout.value_bytes,
        SCALE_BYTES=0 if layout is None else layout.scale_bytes, BF16_DOT=bf16_dot, **extra)
    return out


def indexer_topk(q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, k: int,
                 layout: IndexerKeyLayout | None = None) -> torch.Tensor:
    """Top-k candidates of each token by indexer score. Inputs as `indexer_scores`.

    -> int64 [T, k] candidate positions (columns of `rows`, not row ids), best first, -1 where fewer
    than k candidates are valid: the contract of `kernels.indexer.topk_visible(scores, rows >= 0, k)`.
    Selection is torch.topk on the fp32 scores (see the module docstring).
    """
    scores = indexer_scores(q, keys, rows, weights, layout)
    if scores.shape[1] < k:  # pad the candidate axis so topk always returns k columns
        scores = torch.nn.functional.pad(scores, (0, k - scores.shape[1]), value=float("-inf"))
    top = scores.topk(k, dim=-1)
    # Valid scores are finite, so -inf marks exactly the invalid (or padding) picks.
    return torch.where(top.values > float("-inf"), top.indices, torch.full_like(top.indices, -1))
