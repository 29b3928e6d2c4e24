"""The mHC pre's mixing logits, split over K: streams [T, hc, D] @ fn^T in fp32, one partial sum a split.

The pre's (2+hc)*hc mixing logits are RMSNorm(flat streams) @ fn^T; the norm has no weight, so they are
rsqrt(mean(x^2) + eps) * (x @ fn^T), and `mix_partials` computes the skinny matmul on the raw streams, in the
streams' dtype as stored (no fp32 copy of them), writing one partial sum a split for the pre kernel
(dsv4_kernels.triton_mhc) to add; with `sumsq` each split's sum of squares too, the norm's statistic. Three
kernels by step length and stream dtype: a matrix-vector product a token (up to MIX_GEMV_MAX_TOKENS: at decode
sizes a 16-row dot tile is mostly padding), FMA dot tiles, and for long bf16 steps three bf16 tensor-core dots
(fn split into hi + mid + lo bf16 parts, so the product keeps fp32 accuracy). Steps longer than
`split_max_tokens(dtype)` take torch's fp32 matmul instead (one "split").
The thresholds come from the measurements in BENCHMARKS.md, "mHC pre: split kernels vs the long path".
Interpreter note: bf16 loads are converted to fp32 before any arithmetic (see dsv4_kernels/triton_attention_kernels.py).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dsv4_kernels.gpu import import_triton
from dsv4_kernels.settings import settings
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


@triton.jit(do_not_specialize=["T", "k_per_split", "stride_ps", "stride_pt"])
def _hc_mix_kernel(
    streams_ptr,
    fn_ptr,
    part_ptr,
    T,
    D,
    K,
    N_MIX,
    k_per_split,
    stride_st,
    stride_sh,
    stride_fn,
    stride_ps,
    stride_pt,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NM_P: tl.constexpr,
    SUMSQ: tl.constexpr,
    EVEN_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """part[s, t, m] = sum over this split's k of streams[t].flat[k] * fn[m, k], fp32 (grid: T blocks x splits);
    SUMSQ: part[s, t, N_MIX] = the split's sum of streams[t].flat[k]^2 (the mixing RMSNorm's statistic).
    EVEN_D: BLOCK_K divides D (and the split), so a K tile lies in one stream: one scalar division a tile, not
    one per element. The dot is fp32 FMAs (decode-sized steps; long bf16 steps: _hc_mix_bf16x3_kernel; long fp32
    steps: cuBLAS, see hc_pre)."""
    tl_pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    m = tl.arange(0, NM_P)
    mmask = m < N_MIX
    k_lo = tl.program_id(1) * k_per_split
    acc = tl.zeros([BLOCK_T, NM_P], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        if EVEN_D:
            h = k0 // D
            off = h * stride_sh + (k0 - h * D) + tl.arange(0, BLOCK_K)
        else:
            off = (k // D) * stride_sh + (k % D)
        x = tl.load(
            streams_ptr + rows[:, None].to(tl.int64) * stride_st + off[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(fn_ptr + m[None, :] * stride_fn + k[:, None], mask=kmask[:, None] & mmask[None, :], other=0.0)
        acc += tl.dot(x, w.to(tl.float32), input_precision="ieee")
        if SUMSQ:
            sq += tl.sum(x * x, axis=1)
    if SUMSQ:  # (N_MIX < NM_P: the column is free in the tile)
        acc = tl.where((m == N_MIX)[None, :], sq[:, None], acc)
        mmask = m <= N_MIX
    tl.store(
        part_ptr + tl.program_id(1) * stride_ps + rows[:, None].to(tl.int64) * stride_pt + m[None, :],
        acc,
        mask=rmask[:, None] & mmask[None, :],
    )


@triton.jit(do_not_specialize=["T", "k_per_split", "stride_ps", "stride_pt"])
def _hc_mix_gemv_kernel(
    streams_ptr,
    fn_ptr,
    part_ptr,
    T,
    D,
    K,
    N_MIX,
    k_per_split,
    stride_st,
    stride_sh,
    stride_fn,
    stride_ps,
    stride_pt,
    BLOCK_K: tl.constexpr,
    NM_P: tl.constexpr,
    SUMSQ: tl.constexpr,
    PDL: tl.constexpr,
):
    """_hc_mix_kernel's partials for one token a program (grid: T x splits), as a matrix-vector product on FMAs:
    a few tokens' 16-row dot tiles were mostly padding (decode steps of 1-4 requests)."""
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, NM_P)
    mmask = m < N_MIX
    k_lo = tl.program_id(1) * k_per_split
    acc = tl.zeros([NM_P], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(streams_ptr + t * stride_st + (k // D) * stride_sh + (k % D), mask=kmask, other=0.0)
        x = x.to(tl.float32)
        w = tl.load(fn_ptr + m[:, None] * stride_fn + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if SUMSQ:
            sq += x * x
    if SUMSQ:  # (N_MIX < NM_P: the column is free)
        acc = tl.where(m == N_MIX, tl.sum(sq, axis=0), acc)
        mmask = m <= N_MIX
    tl.store(part_ptr + tl.program_id(1) * stride_ps + t * stride_pt + m, acc, mask=mmask)


@triton.jit(do_not_specialize=["T", "k_per_split", "stride_ps", "stride_pt"])
def _hc_mix_bf16x3_kernel(
    streams_ptr,
    w_ptr,
    part_ptr,
    T,
    D,
    K,
    N_MIX,
    k_per_split,
    stride_st,
    stride_sh,
    stride_ps,
    stride_pt,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NM_P: tl.constexpr,
    SUMSQ: tl.constexpr,
    BF16_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """_hc_mix_kernel for long steps of bf16 streams, on tensor cores. w: bf16 [3, K, NM_P], fn^T split in three
    (hi + mid + lo = fn to fp32 precision; zero columns from N_MIX): a bf16 x bf16 product is exact in fp32, so
    three bf16 dots with fp32 accumulation give the fp32 matmul's products. BLOCK_K divides D and the split.
    (fp32 streams split the same way take six dots, slower than cuBLAS's sgemm: they take the long path.) BF16_DOT False (the interpreter, whose dots take no bf16): the same operands as fp32."""
    tl_pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    m = tl.arange(0, NM_P)
    c = tl.arange(0, BLOCK_K)
    k_lo = tl.program_id(1) * k_per_split
    acc = tl.zeros([BLOCK_T, NM_P], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    row_ptr = streams_ptr + rows[:, None].to(tl.int64) * stride_st
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        kmask = (k0 + c) < K
        h = k0 // D
        x = tl.load(
            row_ptr + h * stride_sh + (k0 - h * D) + c[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0
        )
        xf = x.to(tl.float32)
        if not BF16_DOT:
            x = xf
        wp = w_ptr + (k0 + c)[:, None] * NM_P + m[None, :]
        w_hi = tl.load(wp, mask=kmask[:, None], other=0.0)
        w_mid = tl.load(wp + K * NM_P, mask=kmask[:, None], other=0.0)
        w_lo = tl.load(wp + 2 * K * NM_P, mask=kmask[:, None], other=0.0)
        if not BF16_DOT:
            w_hi, w_mid, w_lo = w_hi.to(tl.float32), w_mid.to(tl.float32), w_lo.to(tl.float32)
        acc += tl.dot(x, w_hi)
        acc += tl.dot(x, w_mid)
        acc += tl.dot(x, w_lo)
        if SUMSQ:
            sq += tl.sum(xf * xf, axis=1)
    mmask = m < N_MIX
    if SUMSQ:  # (N_MIX < NM_P: the column is free in the tile)
        acc = tl.where((m == N_MIX)[None, :], sq[:, None], acc)
        mmask = m <= N_MIX
    tl.store(
        part_ptr + tl.program_id(1) * stride_ps + rows[:, None].to(tl.int64) * stride_pt + m[None, :],
        acc,
        mask=rmask[:, None] & mmask[None, :],
    )


# Split K until about this many programs run (T = 1 in decode: one token's 16K-long dot products); more splits
# leave the pre kernel more partials to add, fewer leave the GPU idle (BENCHMARKS.md, "mHC pre").
MIX_PROGRAMS = 128
# Up to this many tokens the mix is _hc_mix_gemv_kernel (one token a program: a 16-row dot tile would be mostly
# padding), above it _hc_mix_kernel's dot tiles.
MIX_GEMV_MAX_TOKENS = 8
# Steps up to split_max_tokens(dtype) tokens take the split kernels, longer ones the long path (torch's fp32 matmul
# on an fp32 copy of the streams, then dsv4_kernels.triton_mhc.LONG_PATH's kernels): for fp32 streams (the engine's
# residual) cuBLAS's sgemm reads them as stored and wins on long steps; bf16 streams would need the fp32 copy, so
# they stay split at every size. $DSV4_HC_SPLIT_MAX_TOKENS / $DSV4_HC_SPLIT_MAX_TOKENS_BF16 override
# (dsv4_kernels.settings, read at import; tests and benchmarks set these attributes).
MIX_MAX_TOKENS = settings().hc_split_max_tokens  # 256
MIX_MAX_TOKENS_BF16 = settings().hc_split_max_tokens_bf16  # 1 << 30
# From this many tokens bf16 streams' mix runs on tensor cores (_hc_mix_bf16x3_kernel; fp32 FMAs below).
MIX_TENSOR_CORE_MIN_TOKENS = 257
BF16X3_BLOCK_K = 128


def split_max_tokens(dtype: torch.dtype) -> int:
    """The longest step whose mHC pre takes the split kernels, for streams of this dtype (see above)."""
    return MIX_MAX_TOKENS_BF16 if dtype == torch.bfloat16 else MIX_MAX_TOKENS


def mix_partials(streams: torch.Tensor, fn: torch.Tensor, sumsq: bool = False) -> torch.Tensor:
    """Split-K partial mixing logits: streams [T, hc, D] (any float dtype, unit last stride), fn [n_mix, hc*D]
    -> fp32 [splits, T, n_mix] whose sum over splits is streams.reshape(T, hc*D).float() @ fn.float().t()
    (one "split", torch's matmul, above split_max_tokens(streams.dtype) tokens). sumsq (split-K only): one more
    column, n_mix, whose sum over splits is each token's sum of squares of its flattened streams."""
    t, hc, d = streams.shape
    k, n_mix = hc * d, fn.shape[0]
    if t > split_max_tokens(streams.dtype):
        if sumsq:
            raise ValueError(f"sumsq needs the split-K kernel (T <= {split_max_tokens(streams.dtype)}), got T={t}")
        return (streams.reshape(t, k).float() @ fn.float().t()).unsqueeze(0)
    # (sm_90 compile, scripts/compile_triton_sm90.py: 64 rows x 128 of K in 4 warps spilled at 255 registers)
    block_t, block_k = (16, 128) if t <= 16 else (64, 64)
    tensor_cores = t >= MIX_TENSOR_CORE_MIN_TOKENS and d % BF16X3_BLOCK_K == 0 and streams.dtype == torch.bfloat16
    if tensor_cores:
        block_k = BF16X3_BLOCK_K
    tiles = triton.cdiv(t, block_t)
    splits = max(1, min(triton.cdiv(k, block_k), triton.cdiv(MIX_PROGRAMS, tiles)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    parts = torch.empty(splits, t, n_mix + sumsq, dtype=torch.float32, device=streams.device)
    nm_p = max(16, triton.next_power_of_2(n_mix + sumsq))
    if tensor_cores:
        _hc_mix_bf16x3_kernel[(tiles, splits)](
            streams,
            _fn_bf16x3(fn, nm_p),
            parts,
            t,
            d,
            k,
            n_mix,
            k_per_split,
            streams.stride(0),
            streams.stride(1),
            parts.stride(0),
            parts.stride(1),
            BLOCK_T=block_t,
            BLOCK_K=block_k,
            NM_P=nm_p,
            SUMSQ=sumsq,
            BF16_DOT=streams.is_cuda,
            num_warps=8,
            **pdl_kwargs(streams),
        )
        return parts
    fn = fn.float().contiguous()
    if t <= MIX_GEMV_MAX_TOKENS:
        _hc_mix_gemv_kernel[(t, splits)](
            streams,
            fn,
            parts,
            t,
            d,
            k,
            n_mix,
            k_per_split,
            streams.stride(0),
            streams.stride(1),
            fn.stride(0),
            parts.stride(0),
            parts.stride(1),
            BLOCK_K=block_k,
            NM_P=nm_p,
            SUMSQ=sumsq,
            **({"num_warps": 4} if streams.is_cuda else {}),
            **pdl_kwargs(streams),
        )
        return parts
    _hc_mix_kernel[(tiles, splits)](
        streams,
        fn,
        parts,
        t,
        d,
        k,
        n_mix,
        k_per_split,
        streams.stride(0),
        streams.stride(1),
        fn.stride(0),
        parts.stride(0),
        parts.stride(1),
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        NM_P=nm_p,
        SUMSQ=sumsq,
        EVEN_D=d % block_k == 0,
        num_warps=4 if block_t == 16 else 8,
        **pdl_kwargs(streams),
    )
    return parts


_FN_BF16X3 = WeakIdKeyDictionary()  # weight tensor -> ((its _version, nm_p), bf16 [3, K, nm_p])


def _fn_bf16x3(fn: torch.Tensor, nm_p: int) -> torch.Tensor:
    """fn [n_mix, K] -> bf16 [3, K, nm_p]: fn^T as hi + mid + lo bf16 parts (zero-padded columns), built once
    per weight tensor (and again if it is written in place)."""
    cached = _FN_BF16X3.get(fn)
    if cached is not None and cached[0] == (fn._version, nm_p):
        return cached[1]
    w = torch.zeros(fn.shape[1], nm_p, dtype=torch.float32, device=fn.device)
    w[:, : fn.shape[0]] = fn.float().t()
    hi = w.bfloat16()
    rest = w - hi.float()
    mid = rest.bfloat16()
    parts = torch.stack([hi, mid, (rest - mid.float()).bfloat16()]).contiguous()
    _FN_BF16X3[fn] = ((fn._version, nm_p), parts)
    return parts
