"""Triton MoE: routing, and grouped SwiGLU experts that read MXFP4 weights straight from their packed bytes.

References: `dsv4_kernels.moe.route` and `dsv4_kernels.moe.moe_experts` on `dsv4_kernels.quant.dequant_mxfp4` weights.

- `route`: torch does the fp32 router matmul (`router_logits`; decode-sized steps: dsv4_kernels.triton_router's
  split-K partials, added up as the routing kernel loads them); one program per token then scores (sqrt-softplus, sigmoid or
  softmax), adds the selection bias, picks the top k by repeated arg-max (lowest expert id wins a tie),
  gathers the unbiased scores, renormalises and scales. Hash layers gather `tid2eid[token_id]` instead.
  Ids come out best first; the reference's topk(sorted=False) order is unspecified, so compare sets.
- `mxfp4_moe`: the (token, slot) pairs are sorted by expert on the device (argsort + cumsum +
  searchsorted, no host sync). The grid is sized for the worst case, floor((P + min(E, P) * (BM - 1)) / BM)
  row tiles of BM pairs for P = T * k pairs, which depends only on T, so the launch can be captured in
  a CUDA graph; tiles past the real ones exit at once. Kernel 1 (gate/up) computes a [BN, BM] block of
  clamped SwiGLU(x W1^T, x W3^T) for one tile, kernel 2 (down) multiplies by W2 and the routing weight and
  writes one row per pair; torch sums the k rows of a token (deterministic, no atomics).
  Both GEMMs are "swap AB": the weight tile is the dot's M side ([BN, BK/2]) and the few token rows its
  N side, because decode tiles hold 1..16 real rows while weight tiles always fill theirs.
- MXFP4 in registers: a packed byte holds elements 2j (low nibble) and 2j+1 (high nibble), so rather
  than interleave nibbles the kernels split the activations into even and odd columns and run two dots:
  x W^T = x_even W_lo^T + x_odd W_hi^T. An e2m1 code is turned into fp32 bits arithmetically and times
  its UE8M0 scale 2**(byte - 127), also built from bits: the product has <= 2 mantissa bits, so the bf16
  dot operand is exact.

Interpreter note (as dsv4_kernels/triton_attention_kernels.py): the CPU interpreter does bf16 arithmetic on raw bits, so
every load is converted to fp32 and the dots run in fp32 there (`BF16_DOT` only when compiled for bf16).
"""

from __future__ import annotations

import logging

import torch

from dsv4_kernels import triton_router
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

log = logging.getLogger(__name__)

triton, tl = import_triton()

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
MXFP4_BLOCK = 32
# Launch defaults (untuned guesses for sm_90; `dsv4 bench kernels moe --sweep` measures alternatives).
DEFAULTS = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}
# Routing: tokens per program so that a program holds about this many scores (256 experts -> 8 tokens).
ROUTE_ELEMS = 2048
# Token rows per launch: bounds the fp32 [rows * k, hidden] buffer of per-pair outputs at prefill.
MAX_CHUNK_TOKENS = 2048


# ---- routing ------------------------------------------------------------------------------------------
# (engine.execution.warmup: step sizes must not add variants; token_ids may be a slice at any offset of the step's ids)
@triton.jit(do_not_specialize=["T", "splits", "stride_s"], do_not_specialize_on_alignment=["token_ids_ptr"])
def _route_kernel(
    logits_ptr,
    bias_ptr,
    tid2eid_ptr,
    token_ids_ptr,
    w_ptr,
    ids_ptr,
    T,
    E,
    splits,
    stride_s,
    stride_l,
    stride_h,
    scaling,
    K: tl.constexpr,
    K_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HASH: tl.constexpr,
    RENORM: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    m2 = tmask[:, None] & emask[None, :]
    x = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for s in range(splits):  # the logits' split-K partials (dsv4_kernels.triton_router), or the logits (1 split)
        x += tl.load(logits_ptr + s * stride_s + t64[:, None] * stride_l + e[None, :], mask=m2, other=0.0).to(
            tl.float32
        )
    if SCORING == 0:
        # torch's softplus (identity above 20); log1p(u) as u * log(1+u) / ((1+u) - 1) stays accurate
        # for tiny u, where log(1 + u) would lose it (no log1p in tl).
        u = tl.exp(tl.minimum(x, 20.0))
        v = 1.0 + u
        lp = tl.where(v == 1.0, u, u * tl.log(v) / tl.where(v == 1.0, 1.0, v - 1.0))
        s = tl.sqrt_rn(tl.where(x > 20.0, x, lp))  # IEEE-rounded like torch, not sqrt.approx
    elif SCORING == 1:
        s = tl.sigmoid(x)
    else:
        xm = tl.where(m2, x, float("-inf"))
        row_max = tl.where(tmask, tl.max(xm, axis=1), 0.0)  # padded rows: keep exp finite
        p = tl.where(m2, tl.exp(xm - row_max[:, None]), 0.0)
        s = p / tl.where(tmask, tl.sum(p, axis=1), 1.0)[:, None]
    kk = tl.arange(0, K_P)
    kmask = kk < K
    if HASH:
        tok = tl.load(token_ids_ptr + t64, mask=tmask, other=0).to(tl.int64)
        ids = tl.zeros([BLOCK_T, K_P], dtype=tl.int32)
        sel = tl.zeros([BLOCK_T, K_P], dtype=tl.float32)
        for i in tl.static_range(K):
            idx = tl.load(tid2eid_ptr + tok * stride_h + i, mask=tmask, other=0).to(tl.int32)
            # Gather from registers: one-hot select over the expert axis and sum.
            ids = tl.where(kk[None, :] == i, idx[:, None], ids)
            sel = tl.where(kk[None, :] == i, tl.sum(tl.where(e[None, :] == idx[:, None], s, 0.0), axis=1)[:, None], sel)
    else:
        biased = s
        if HAS_BIAS:
            biased = s + tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32)[None, :]
        biased = tl.where(emask[None, :], biased, float("-inf"))
        ids = tl.zeros([BLOCK_T, K_P], dtype=tl.int32)
        sel = tl.zeros([BLOCK_T, K_P], dtype=tl.float32)
        for i in tl.static_range(K):
            best = tl.max(biased, axis=1)
            # Lowest id among the maxima; clamped so a NaN row still yields an in-range id.
            idx = tl.minimum(tl.min(tl.where(biased == best[:, None], e[None, :], BLOCK_E), axis=1), E - 1)
            hit = e[None, :] == idx[:, None]
            ids = tl.where(kk[None, :] == i, idx[:, None], ids)
            sel = tl.where(kk[None, :] == i, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], sel)
            biased = tl.where(hit, float("-inf"), biased)
    sel = tl.where(kmask[None, :], sel, 0.0)
    if RENORM:
        sel = sel / (tl.sum(sel, axis=1)[:, None] + 1e-20)
    out = t64[:, None] * K + kk[None, :]
    omask = tmask[:, None] & kmask[None, :]
    tl.store(w_ptr + out, sel * scaling, mask=omask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=omask)


_MM_OUT_DTYPE = [True]  # False once torch's mm(out_dtype=) has failed here (logged)


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ gate [E, H]^T -> fp32 [T, E], the reference's x.float() @ gate.float().t().

    bf16 x and gate on CUDA: one cuBLAS GEMM with fp32 output, no fp32 copy of x. A bf16 x bf16 product is exact
    in fp32 and the sums are fp32, so this is the fp32 matmul up to summation order. (The fp32 copy and sgemm took
    0.35 ms a layer at 8K tokens on the H200, 2% of a prefill step of the V4-Flash slice.)"""
    if x.is_cuda and x.dtype == gate.dtype == torch.bfloat16 and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(x, gate.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError) as e:  # a torch without mm's out_dtype on this GPU
            _MM_OUT_DTYPE[0] = False
            log.warning("router logits: torch.mm(out_dtype=float32) failed (%s); using an fp32 copy and sgemm", e)
    return x.float() @ gate.float().t()


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
    """`dsv4_kernels.moe.route` (same arguments and contract) with scoring and top-k fused in one kernel.

    x: [T, H]; gate: [E, H] (bf16 with bf16 x, else fp32, to skip a cast per call: `router_logits`)
    -> (fp32 [T, k], int64 [T, k]).
    """
    if scoring_func not in SCORING:
        raise ValueError(f"unknown scoring_func {scoring_func!r}")
    if x.dim() != 2 or gate.dim() != 2 or gate.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, H] and gate [E, H], got {tuple(x.shape)} and {tuple(gate.shape)}")
    hashed = tid2eid is not None
    if tid2eid is not None and (token_ids is None or token_ids.shape != (x.shape[0],) or tid2eid.shape[1] != top_k):
        raise ValueError(f"hash routing needs token_ids [T={x.shape[0]}] and tid2eid [V, {top_k}]")
    require_triton(x.device)
    e = gate.shape[0]
    # [splits, T, E]: decode-sized steps' split-K partials (one launch, added up by the routing kernel), else the
    # logits themselves as one split
    if triton_router.takes_gemv(x) and x.stride(-1) == 1 and gate.stride(-1) == 1:
        logits = triton_router.router_partials(x, gate)
    else:
        logits = router_logits(x, gate).unsqueeze(0)
    t = x.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    has_bias = bias is not None and not hashed
    dummy = logits  # never read: the constexpr flags compile those loads out
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(triton.next_power_of_2(t), ROUTE_ELEMS // block_e))
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits,
        bias if has_bias else dummy,
        tid2eid if hashed else dummy,
        token_ids if hashed else dummy,
        weights,
        ids,
        t,
        e,
        logits.shape[0],
        logits.stride(0),
        logits.stride(1),
        tid2eid.stride(0) if tid2eid is not None else 0,
        float(scaling),
        K=top_k,
        K_P=triton.next_power_of_2(top_k),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        SCORING=SCORING[scoring_func],
        HAS_BIAS=has_bias,
        HASH=hashed,
        RENORM=renormalize,
        **pdl_kwargs(logits),
    )
    return weights, ids


# ---- MXFP4 tiles ----------------------------------------------------------------------------------------
@triton.jit
def _e2m1_bits(c):
    """4-bit e2m1 codes (int32) -> fp32 bit patterns. Codes 2..7 are 2**(e-1) * (1 + m/2) with c = 2e + m,
    i.e. exponent field e + 126 and top mantissa bit m: ((e + 126) << 23) | (m << 22) = (c + 252) << 22;
    code 1 is 0.5 (= 252 << 22), code 0 is zero; bit 3 is the sign."""
    mag = c & 7
    bits = tl.where(mag >= 2, (mag + 252) << 22, tl.where(mag == 1, 252 << 22, 0))
    return bits | ((c & 8) << 28)


@triton.jit
def _mxfp4_tile(w_ptrs, s_ptrs, mask, BF16_DOT: tl.constexpr):
    """[BN, BKH] packed bytes + their UE8M0 scale bytes -> (low-nibble, high-nibble) dot operands."""
    b = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    sbyte = tl.load(s_ptrs, mask=mask, other=127).to(tl.int32)
    scale = (sbyte << 23).to(tl.float32, bitcast=True)  # 2**(byte - 127), exact (no exp2 approximation)
    lo = _e2m1_bits(b & 15).to(tl.float32, bitcast=True) * scale
    hi = _e2m1_bits((b >> 4) & 15).to(tl.float32, bitcast=True) * scale
    if BF16_DOT:
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _dot(a, b, acc, BF16_DOT: tl.constexpr):
    """acc + a @ b: bf16 tensor-core operands when compiled for bf16, exact fp32 otherwise."""
    if BF16_DOT:
        acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _act_cols(rows_ptr, rmask, kk, kmask, BF16_DOT: tl.constexpr):
    """Even and odd activation columns 2kk, 2kk+1 of the tile's rows -> two [BKH, BM] dot operands."""
    m = kmask[:, None] & rmask[None, :]
    ev = tl.load(rows_ptr[None, :] + 2 * kk[:, None], mask=m, other=0.0)
    od = tl.load(rows_ptr[None, :] + 2 * kk[:, None] + 1, mask=m, other=0.0)
    # One return: the compiler rejects returns of different dtypes even under a constexpr branch.
    dt: tl.constexpr = tl.bfloat16 if BF16_DOT else tl.float32
    return ev.to(dt), od.to(dt)


@triton.jit
def _tile_rows(order_ptr, tile_expert_ptr, tile_start_ptr, tile_stop_ptr, tile, BM: tl.constexpr):
    """-> (expert, sorted positions [BM], their mask, pair ids [BM]) of one row tile."""
    expert = tl.load(tile_expert_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    stop = tl.load(tile_stop_ptr + tile)
    pos = start + tl.arange(0, BM)
    rmask = pos < stop
    pair = tl.load(order_ptr + pos, mask=rmask, other=0)
    return expert, pos, rmask, pair


@triton.jit
def _gate_up_kernel(
    x_ptr,
    order_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_stop_ptr,
    w1_ptr,
    s1_ptr,
    w3_ptr,
    s3_ptr,
    act_ptr,
    N,
    K,
    E,
    TOPK,
    limit,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_act,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BF16_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """act[pos, n] = silu(min(g, limit)) * clamp(u, +-limit), g/u = x[token(pos)] . W1/W3[expert, n]."""
    tl_pdl_wait(PDL)
    tile = tl.program_id(0)
    expert, pos, rmask, pair = _tile_rows(order_ptr, tile_expert_ptr, tile_start_ptr, tile_stop_ptr, tile, BM)
    if expert >= E:  # a spare tile of the worst-case grid
        return
    BKH: tl.constexpr = BK // 2
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    j = tl.arange(0, BKH)
    x_rows = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    e64 = expert.to(tl.int64)
    w_off = e64 * stride_we + n[:, None].to(tl.int64) * stride_wn
    s_off = e64 * stride_se + n[:, None].to(tl.int64) * stride_sn
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 // 2 + j  # packed byte index = pair of columns (2kk, 2kk + 1)
        kmask = kk < K // 2
        xe, xo = _act_cols(x_rows, rmask, kk, kmask, BF16_DOT)
        wmask = nmask[:, None] & kmask[None, :]
        sk = (kk // 16)[None, :]  # 16 packed bytes (32 elements) share a scale
        lo, hi = _mxfp4_tile(w1_ptr + w_off + kk[None, :], s1_ptr + s_off + sk, wmask, BF16_DOT)
        acc_g = _dot(hi, xo, _dot(lo, xe, acc_g, BF16_DOT), BF16_DOT)
        lo, hi = _mxfp4_tile(w3_ptr + w_off + kk[None, :], s3_ptr + s_off + sk, wmask, BF16_DOT)
        acc_u = _dot(hi, xo, _dot(lo, xe, acc_u, BF16_DOT), BF16_DOT)
    g = tl.minimum(acc_g, limit)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = g * tl.sigmoid(g) * u
    ptrs = act_ptr + pos[None, :].to(tl.int64) * stride_act + n[:, None]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=nmask[:, None] & rmask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    order_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_stop_ptr,
    w2_ptr,
    s2_ptr,
    rw_ptr,
    y_ptr,
    N,
    K,
    E,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_y,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BF16_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[pair, n] = routing_weight[pair] * act[pos] . W2[expert, n]."""
    tl_pdl_wait(PDL)
    tile = tl.program_id(0)
    expert, pos, rmask, pair = _tile_rows(order_ptr, tile_expert_ptr, tile_start_ptr, tile_stop_ptr, tile, BM)
    if expert >= E:
        return
    BKH: tl.constexpr = BK // 2
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    j = tl.arange(0, BKH)
    a_rows = act_ptr + pos.to(tl.int64) * stride_act
    e64 = expert.to(tl.int64)
    w_off = e64 * stride_we + n[:, None].to(tl.int64) * stride_wn
    s_off = e64 * stride_se + n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 // 2 + j
        kmask = kk < K // 2
        ae, ao = _act_cols(a_rows, rmask, kk, kmask, BF16_DOT)
        sk = (kk // 16)[None, :]
        lo, hi = _mxfp4_tile(
            w2_ptr + w_off + kk[None, :], s2_ptr + s_off + sk, nmask[:, None] & kmask[None, :], BF16_DOT
        )
        acc = _dot(hi, ao, _dot(lo, ae, acc, BF16_DOT), BF16_DOT)
    rw = tl.load(rw_ptr + pair, mask=rmask, other=0.0)
    ptrs = y_ptr + pair[None, :].to(tl.int64) * stride_y + n[:, None]
    tl.store(ptrs, acc * rw[None, :], mask=nmask[:, None] & rmask[None, :])


# ---- host side ---------------------------------------------------------------------------------------
def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case row tiles: sum over used experts of ceil(count / BM) with at most min(E, P) used."""
    return (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """Bucket the (token, slot) pairs by expert without a host sync.

    ids: int [T, k] -> (order int32 [P]: pair ids sorted by expert, and per tile of the worst-case grid:
    expert int32 (num_experts for a spare tile), first and one-past-last sorted position int32).
    """
    flat = ids.reshape(-1).long()
    p = flat.numel()
    order = torch.argsort(flat, stable=True).to(torch.int32)
    # scatter_add, not bincount: bincount reads the max id back to the host to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    row_end = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    j = torch.arange(max_tiles(p, num_experts, block_m), device=ids.device)
    expert = torch.searchsorted(tile_end, j, right=True)
    e = expert.clamp(max=num_experts - 1)
    start = row_end[e] - counts[e] + (j - (tile_end[e] - tiles[e])) * block_m
    stop = torch.minimum(row_end[e], start + block_m)
    return order, expert.to(torch.int32), start.to(torch.int32), stop.to(torch.int32)


def pick_block_m(pairs: int, num_experts: int) -> int:
    """Rows per tile from the mean pairs per used expert: 16 (tl.dot's minimum) at decode, up to 64."""
    mean = pairs / max(1, min(num_experts, pairs))
    return 16 if mean <= 16 else 32 if mean <= 48 else 64


def _check_experts(x, w1, s1, w2, s2, w3, s3):
    e, inter = w1.shape[:2]
    h = x.shape[1]
    want = {
        "w1": (w1, (e, inter, h // 2)),
        "w3": (w3, (e, inter, h // 2)),
        "w2": (w2, (e, h, inter // 2)),
        "s1": (s1, (e, inter, h // 32)),
        "s3": (s3, (e, inter, h // 32)),
        "s2": (s2, (e, h, inter // 32)),
    }
    for name, (t, shape) in want.items():
        if t.dtype != torch.uint8 or tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be uint8 {shape} with unit last stride (hidden {h}, inter {inter}), "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    if h % MXFP4_BLOCK or inter % MXFP4_BLOCK:
        raise ValueError(f"hidden {h} and intermediate {inter} must be multiples of {MXFP4_BLOCK}")


def _blocks(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int]:
    # K tiles are whole scale blocks (>= 32 elements = 16 packed bytes, tl.dot's minimum K) and N >= 16.
    bk = max(MXFP4_BLOCK, min(block_k, triton.next_power_of_2(k)))
    bn = max(16, min(block_n, triton.next_power_of_2(n)))
    return bn, bk


def mxfp4_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    w3: torch.Tensor,
    s3: torch.Tensor,
    limit: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts on MXFP4 weights. = `moe_experts(x, weights, ids, W1, W2, W3, limit)` with
    W = dequant_mxfp4(w, s).

    x: [T, H] fp32/bf16/fp16; weights: [T, k] float; ids: int [T, k]; w1, w3: uint8 [E, I, H/2] packed
    e2m1 with s1, s3: uint8 UE8M0 [E, I, H/32]; w2: uint8 [E, H, I/2] with s2: [E, H, I/32] -> [T, H].
    """
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"x must be [T, H], ids and weights [T, k]; got {tuple(x.shape)}, {tuple(ids.shape)}, "
            f"{tuple(weights.shape)}"
        )
    _check_experts(x, w1, s1, w2, s2, w3, s3)
    for name, value, least in (("block_m", block_m, 16), ("block_n", block_n, 16), ("block_k", block_k, 32)):
        if value is not None and (value < least or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two >= {least} (tl.dot tiles), got {value}")
    require_triton(x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    opts = {
        "block_m": block_m,
        "block_n": block_n or DEFAULTS["block_n"],
        "block_k": block_k or DEFAULTS["block_k"],
        "num_warps": num_warps or DEFAULTS["num_warps"],
        "num_stages": num_stages or DEFAULTS["num_stages"],
    }
    packed = (w1, s1, w2, s2, w3, s3)
    if x.shape[0] <= MAX_CHUNK_TOKENS:
        return _moe_chunk(x, weights, ids, packed, limit, **opts) if x.shape[0] else torch.zeros_like(x)
    out = torch.empty_like(x)
    # Fixed-size chunks: shapes (hence a captured graph) depend only on T.
    for c0 in range(0, x.shape[0], MAX_CHUNK_TOKENS):
        c1 = min(c0 + MAX_CHUNK_TOKENS, x.shape[0])
        out[c0:c1] = _moe_chunk(x[c0:c1], weights[c0:c1], ids[c0:c1], packed, limit, **opts)
    return out


def _moe_chunk(x, weights, ids, packed, limit, *, block_m, block_n, block_k, num_warps, num_stages):
    w1, s1, w2, s2, w3, s3 = packed
    t, k = ids.shape
    e, inter, _ = w1.shape
    h = x.shape[1]
    p = t * k
    bm = block_m or pick_block_m(p, e)
    order, tile_expert, tile_start, tile_stop = sort_by_expert(ids, e, bm)
    n_tiles = tile_expert.numel()
    bf16_dot = x.is_cuda and x.dtype == torch.bfloat16
    extra = {"num_warps": num_warps, "num_stages": num_stages} if x.is_cuda else {}
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    bn, bk = _blocks(inter, h, block_n, block_k)
    _gate_up_kernel[(n_tiles, triton.cdiv(inter, bn))](
        x,
        order,
        tile_expert,
        tile_start,
        tile_stop,
        w1,
        s1,
        w3,
        s3,
        act,
        inter,
        h,
        e,
        k,
        float(limit),
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        s1.stride(0),
        s1.stride(1),
        act.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        BF16_DOT=bf16_dot,
        **extra,
        **pdl_kwargs(x),
    )
    y = torch.empty(p, h, dtype=torch.float32, device=x.device)
    rw = weights.reshape(-1).float().contiguous()
    bn, bk = _blocks(h, inter, block_n, block_k)
    _down_kernel[(n_tiles, triton.cdiv(h, bn))](
        act,
        order,
        tile_expert,
        tile_start,
        tile_stop,
        w2,
        s2,
        rw,
        y,
        h,
        inter,
        e,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        y.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        BF16_DOT=bf16_dot,
        **extra,
        **pdl_kwargs(act),
    )
    return y.view(t, k, h).sum(dim=1).to(x.dtype)
