"""Routed MXFP4 experts for steps of a few tokens: split-K GEMVs that read triton_kernels' Hopper layouts in place.

Same function as `dsv4_kernels.mxfp4_ogs.ogs_moe` (reference: `dsv4_kernels.moe.moe_experts` on dequantised
experts) on the same `OgsExperts`, for steps of at most MAX_ROUTES (token, slot) routes. Why: at one token a
step triton_kernels' ragged matmul streams the 6 selected experts at ~31% of copy bandwidth (BENCHMARKS.md
bench_gpu, mxfp4_moe). A route needs each weight byte once, so this is a GEMV per route: many programs, each
streaming a tile of packed bytes, dequantising in registers and summing with CUDA-core fp32 FMAs (no dot: one
activation row). Four launches: gate|up GEMV -> split-K sum + clamped SwiGLU -> down GEMV -> split-K sum,
routing weights and the k-way sum (+ the shared expert), with ogs_moe's roundings (the GEMV outputs rounded to
the activation dtype as its matmuls round them, then triton_moe_glue's SwiGLU and combine arithmetic).

The layouts (triton_kernels.tensor_details.layout_details, mx_axis=-2, mma_version 3; `swizzle_value` /
`swizzle_scale` here are torch copies, checked against the library in tests/kernels/test_triton_mxfp4_gemv.py):
- values, per expert W [N, K] (checkpoint bytes [N, K/2], element 2j in byte j's low nibble): with
  n = 16*r0 + 8*b + 2*t0 + s0 and byte kb = 32*c + 8*q + 4*w1 + t1, byte (n, kb) moves to swizzled row
  4*r0 + t0 (one row of 2K bytes holds all of K for 4 outputs n: b, s0 in {0, 1}) at column
  128*c + 64*s0 + 16*t1 + 4*q + 2*w1 + b, and each 4-byte word's 8 codes are bit-interleaved so that
  `word & 0x81C081C0` (and shifts of it) are two bf16 bit patterns = code * 2^-126 (the library's
  `_pack_bits`). Storage: uint8 [E, 2K, N/4] with unit stride along 2K, i.e. rows of int32 words.
  So the codes of word j = 32*c + 16*s0 + 4*t1 + q of a row are k = 64*c + 16*q + 8*w1 + 2*t1 + nibble
  for outputs b = 0 (w1 = 0: slots 0 and 2 below) and b = 1 (slots 1 and 3).
- scales uint8 E8M0 [E, N, K/32]: with n = 256*m + 128*a + 16*w + 8*b + cc and block kk = 2*c + k1,
  scale (n, kk) moves to row 8*m + w (32 outputs: a, b, cc) at column 64*c + 32*a + 4*cc + 2*k1 + b.
  Storage: uint8 [E, 32*K/32, N/32] with unit stride along its middle dim.
A program takes one scale row (and multiples): 32 outputs, 8 value rows (a in {0, 1} x t0 in 0..3, cc = 2*t0 +
s0), over a range of 64-wide K chunks c. Code words are contiguous runs of a row (16-byte vectors on the GPU);
scales are byte gathers within a row's 64-byte run per chunk, activations gathers from L1/L2.

Decode: a code's bits land on a bf16's sign, two low exponent bits and top mantissa bit, i.e. value * 2^-126
(the e = 0 code 0.5 is a subnormal: needs fp32 without flush-to-zero, Triton's default for plain fp32 ops).
The 2^126 is split: activations are multiplied by 2^64 as loaded and a scale byte s becomes 2^(s - 65) from its
bits ((s + 62) << 23: exact for every s <= 192), so products stay normal and no step overflows.

Grid of a GEMV: (N / (32 * BLOCK_SR), routes, splits), BLOCK_SR, KC, warps, stages and the split from a
GemvConfig (DEFAULT_CONFIG unless given). A route with expert id -1 (another rank's expert) loads
nothing and writes zeros. Partial sums go to fp32 [splits, routes, N]; the next launch sums the splits in a
fixed order (deterministic, no atomics). Bytes per route: N*K/2 + N*K/32 of weights (V4-Flash gate|up 8.9 MB,
down 4.5 MB), activations from L2.

Interpreter note (as dsv4_kernels/triton_attention_kernels.py): every load is converted to fp32 before any arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

# (token, slot) routes one call takes: each route streams its expert's bytes (a duplicate expert is read twice),
# which beats triton_kernels' ragged matmul while routes rarely share experts (256 experts, top-6: 5 tokens, 30
# routes, share ~2 experts); larger steps take ogs_moe. Measured (H100, 2026-12-06, BENCHMARKS mxfp4_moe): it does
# not beat ogs_moe at 1-4 tokens (DEFAULT_CONFIG below), so the engine takes it only with DSV4_MXFP4_GEMV=1.
MAX_ROUTES = 32
X_SCALE = 2.0**64  # activations are multiplied by this, scales divided (module docstring)
_CODES = -2118123520  # 0x81C00000 as int32: sign, two exponent bits and a mantissa bit of a bf16 in the high half
# the kernel's copies: compiled Triton reads a module global only when it is a tl.constexpr (the interpreter reads any)
_X_SCALE_K = tl.constexpr(X_SCALE)
_CODES_K = tl.constexpr(_CODES)


# Values a GemvConfig field may take: powers of two keep tl.arange's sizes legal (ROWS = 8 * block_sr, COLS =
# 32 * kc), block_sr <= 8 keeps a grid's last program within the scale rows' padding to 8 (N to 256), and the
# largest tile (64 x 256 fp32 twice) still compiles; the rest are what Triton accepts and the sweep tries.
CONFIG_CHOICES = {
    "block_sr": (1, 2, 4, 8),
    "kc": (1, 2, 4, 8),
    "num_warps": (1, 2, 4, 8, 16),
    "num_stages": (1, 2, 3, 4, 5, 6),
}
MAX_TARGET_PROGRAMS = 1 << 16


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of the GEMV kernel (every value computes the same sums, in other fp32 orders).

    block_sr: scale rows (32 outputs, 8 value rows each) a program takes; kc: 64-wide K chunks a loop step
    (block_sr = kc = 2: 16 rows x 64 int32 words = 4 KB of codes a step); num_warps, num_stages: Triton's launch
    options (4 and 3 are its CUDA defaults); target_programs: K is split until a GEMV has about this many
    programs (1024: ~8 per SM on 132 SMs). The defaults are the first version's constants."""

    block_sr: int = 2
    kc: int = 2
    num_warps: int = 4
    num_stages: int = 3
    target_programs: int = 1024

    def __post_init__(self):
        for name, allowed in CONFIG_CHOICES.items():
            v = getattr(self, name)
            if type(v) is not int or v not in allowed:
                raise ValueError(f"GemvConfig.{name} must be one of {allowed}, got {v!r}")
        t = self.target_programs
        if type(t) is not int or not 1 <= t <= MAX_TARGET_PROGRAMS:
            raise ValueError(f"GemvConfig.target_programs must be an int in 1..{MAX_TARGET_PROGRAMS}, got {t!r}")


# What gemv / gemv_moe launch with when given no config (the engine passes none). benchmarks/kernels/moe.py
# --gemv-sweep times the alternatives; adopt a winner by writing its values here. This one: the H100 sweep's best
# single config over 1 / 2 / 4 tokens (2026-12-06: 70.5 / 109.8 / 190.0 us against the first version's 79.0 / 121.1 /
# 206.4; triton_kernels' ogs_moe 62.7 / 103.7 / 149.6 us, so DSV4_MXFP4_GEMV stays off).
DEFAULT_CONFIG = GemvConfig(block_sr=1, kc=4, num_warps=2, num_stages=1, target_programs=2048)


@dataclass(frozen=True)
class GemvWeights:
    """One GEMV's weights as the kernel reads them (views of triton_kernels' storage, or `swizzle_*` output).

    words: int32 [E, rows, row_words] (rows = padded N / 4; 8 codes a word); scales: uint8 [E, padded N / 32,
    32 * padded K / 32]; n, k: the logical [N, K]."""

    words: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int


@dataclass(frozen=True)
class GemvExperts:
    """A layer's routed experts for `gemv_moe`: gate|up fused along N ([2I, H]), then down ([H, I])."""

    w13: GemvWeights
    w2: GemvWeights
    num_experts: int
    hidden: int
    inter: int


def _weights(value: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> GemvWeights:
    """Storage views [E, 2K, N/4] uint8 (unit middle stride) and [E, 32*K/32, N/32] -> GemvWeights (no copy)."""
    if value.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError(f"expected Hopper storage with a unit middle stride, got {value.stride()} / {scale.stride()}")
    rows = value.mT  # [E, N/4, 2K] contiguous rows
    if rows.shape[-1] % 4 or rows.stride(-1) != 1:
        raise ValueError(f"value rows of {rows.shape[-1]} bytes are not whole int32 words")
    return GemvWeights(rows.view(torch.int32), scale.mT, n, k)


def from_ogs(ex) -> GemvExperts:
    """dsv4_kernels.mxfp4_ogs.OgsExperts -> GemvExperts over the same storage (views: no second copy)."""
    for t in (ex.w13, ex.s13, ex.w2, ex.s2):
        if t.storage.layout.name not in ("HOPPER_VALUE", "HOPPER_SCALE"):
            raise ValueError(f"the GEMV reads the Hopper layouts only, got {t.storage.layout}")
    h, i = ex.hidden, ex.inter
    return GemvExperts(
        _weights(ex.w13.storage.data, ex.s13.storage.data, 2 * i, h),
        _weights(ex.w2.storage.data, ex.s2.storage.data, h, i),
        ex.num_experts,
        h,
        i,
    )


def _pad(x: torch.Tensor, n_mult: int, k_mult: int) -> torch.Tensor:
    n, k = x.shape[-2:]
    return torch.nn.functional.pad(x, (0, -k % k_mult, 0, -n % n_mult))


def swizzle_value(w: torch.Tensor) -> torch.Tensor:
    """Checkpoint e2m1 bytes uint8 [E, N, K/2] -> the Hopper value storage uint8 [E, 2K', N'/4] (a transposed
    view, unit middle stride; N', K' padded to 64 / 128) = triton_kernels' HopperMXValueLayout(mx_axis=-2,
    mma_version=3).swizzle_data of the [E, K, N] FP4 tensor."""
    w = _pad(w, 64, 64)
    e, n, kb = w.shape
    # n = 16*r0 + 8*b + 2*t0 + s0; kb = 32*c + 8*q + 4*w1 + t1 -> row (r0, t0), column (c, s0, t1, q, w1, b)
    w = w.view(e, n // 16, 2, 4, 2, kb // 32, 4, 2, 4).permute(0, 1, 3, 5, 4, 8, 6, 7, 2)
    x = w.reshape(e, n // 4, kb, 4).to(torch.int32)  # 4 bytes (w1, b) of one word

    def codes(v, fourth=False):  # both nibbles of bytes v at their bf16 bit positions (library's _compress_*)
        lo, hi = v & 15, v >> 4
        if fourth:
            f = lambda c: ((c & 8) << 11) | ((c & 6) << 9) | ((c & 1) << 13)  # noqa: E731
        else:
            f = lambda c: ((c & 8) << 12) | ((c & 7) << 6)  # noqa: E731
        return f(lo) | (f(hi) << 16)

    def shr(v, n):  # logical right shift of int32
        return (v >> n) & ((1 << (32 - n)) - 1)

    word = codes(x[..., 0]) | shr(codes(x[..., 1]), 3) | shr(codes(x[..., 2]), 6) | codes(x[..., 3], True)
    return word.view(torch.uint8).view(e, n // 4, 4 * kb).mT


def swizzle_scale(s: torch.Tensor, num_warps: int = 8) -> torch.Tensor:
    """E8M0 bytes uint8 [E, N, K/32] -> the Hopper scale storage uint8 [E, 32*K'/32, N'/32] (a transposed view;
    N' padded to 32 * num_warps, K'/32 to 2) = HopperMXScaleLayout(mx_axis=-2, num_warps).swizzle_data."""
    s = _pad(s, 32 * num_warps, 2)
    e, n, ks = s.shape
    # n = 32*num_warps*m + 128*a + 16*w + 8*b + cc (a, b: 2, cc: 8, w: num_warps); kk = 2*c + k1
    s = s.view(e, n // (32 * num_warps), 2, num_warps, 2, 8, ks // 2, 2).permute(0, 1, 3, 6, 2, 5, 7, 4)
    return s.reshape(e, n // 32, 32 * ks).mT


def from_checkpoint(w1, s1, w2, s2, w3, s3) -> GemvExperts:
    """Packed experts as engine.model.moe.PackedExperts holds them (w1, w3: [E, I, H/2], s1, s3: [E, I, H/32],
    w2: [E, H, I/2], s2: [E, H, I/32]) -> GemvExperts in the Hopper layouts (new tensors: CPU tests, benches)."""
    e, inter, half_h = w1.shape
    w13, s13 = torch.cat([w1, w3], dim=1), torch.cat([s1, s3], dim=1)
    return GemvExperts(
        _weights(swizzle_value(w13), swizzle_scale(s13), 2 * inter, 2 * half_h),
        _weights(swizzle_value(w2), swizzle_scale(s2), 2 * half_h, inter),
        e,
        2 * half_h,
        inter,
    )


# Step-size dependent integers are not specialised on: one compiled variant per weight shape serves every step
# (no compile mid-serving, none in a CUDA-graph capture after the warm-up's first call).
@triton.jit(do_not_specialize=["CHUNKS_PER_SPLIT", "stride_os"])
def _gemv_kernel(
    w_ptr,  # int32 [E, VROWS, ROW_WORDS]
    s_ptr,  # uint8 [E, SROWS, 32 * K/32]
    x_ptr,  # [rows of x, K]: route p reads row p // X_DIV
    ids_ptr,  # int [P]
    out_ptr,  # fp32 [S, P, N]
    N,
    K,
    VROWS,
    ROW_WORDS,
    CHUNKS_PER_SPLIT,
    X_DIV,
    stride_we,
    stride_wr,
    stride_se,
    stride_sr,
    stride_xr,
    stride_os,
    stride_op,
    BLOCK_SR: tl.constexpr,
    KC: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    ROWS: tl.constexpr = 8 * BLOCK_SR
    COLS: tl.constexpr = 32 * KC
    p = tl.program_id(1)
    split = tl.program_id(2)
    e = tl.load(ids_ptr + p).to(tl.int32)
    rows_live = tl.where(e >= 0, VROWS, 0)  # a dead route masks every row (a mask of comparisons only)
    e = tl.maximum(e, 0).to(tl.int64)
    # Rows of this program: scale row sr (outputs 256*m + 16*w + {0..15, 128..143}) and its 8 value rows.
    i = tl.arange(0, ROWS)
    sr = tl.program_id(0) * BLOCK_SR + i // 8
    a = (i // 4) % 2
    t0 = i % 4
    vrow = ((sr // 8) * 16 + sr % 8 + a * 8) * 4 + t0
    rmask = vrow < rows_live
    w_rows = w_ptr + e * stride_we + vrow.to(tl.int64) * stride_wr
    s_rows = s_ptr + e * stride_se + sr.to(tl.int64) * stride_sr + a * 32 + t0 * 8
    x_row = x_ptr + (p // X_DIV).to(tl.int64) * stride_xr
    # Columns: word j of a K chunk step; its codes' k (slot 0's) and the scale column of word pair j // 2.
    j = tl.arange(0, COLS)
    kj = (j // 32) * 64 + (j % 4) * 16 + ((j // 4) % 4) * 2
    q = tl.arange(0, COLS // 2)
    sq = (q // 16) * 64 + ((q // 8) % 2) * 4 + (q % 2) * 2
    acc0 = tl.zeros([ROWS, COLS], dtype=tl.float32)  # outputs b = 0
    acc1 = tl.zeros([ROWS, COLS], dtype=tl.float32)  # outputs b = 1
    c_begin = split * CHUNKS_PER_SPLIT
    c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, ROW_WORDS // 32)
    for c in range(c_begin, c_end, KC):
        col = c * 32 + j
        wmask = rmask[:, None] & (col < c_end * 32)[None, :]
        w = tl.load(w_rows[:, None] + col[None, :], mask=wmask, other=0)
        k = c * 64 + kj
        xa = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32) * _X_SCALE_K
        xb = tl.load(x_row + k + 1, mask=k + 1 < K, other=0.0).to(tl.float32) * _X_SCALE_K
        xc = tl.load(x_row + k + 8, mask=k + 8 < K, other=0.0).to(tl.float32) * _X_SCALE_K
        xd = tl.load(x_row + k + 9, mask=k + 9 < K, other=0.0).to(tl.float32) * _X_SCALE_K
        # 8 codes of a word: slots (w1, b) = (0,0), (0,1), (1,0), (1,1), each low nibble (k) and high (k+1).
        t1 = w << 3
        t2 = w << 6
        t3 = ((w << 1) & -2147450880) | ((w >> 3) & 0x01800180) | ((w >> 7) & 0x00400040)  # slot 3's bits
        v0h = (w & _CODES_K).to(tl.float32, bitcast=True)
        v0l = ((w << 16) & _CODES_K).to(tl.float32, bitcast=True)
        v1h = (t1 & _CODES_K).to(tl.float32, bitcast=True)
        v1l = ((t1 << 16) & _CODES_K).to(tl.float32, bitcast=True)
        v2h = (t2 & _CODES_K).to(tl.float32, bitcast=True)
        v2l = ((t2 << 16) & _CODES_K).to(tl.float32, bitcast=True)
        v3h = (t3 & _CODES_K).to(tl.float32, bitcast=True)
        v3l = (t3 << 16).to(tl.float32, bitcast=True)
        part0 = v0l * xa[None, :] + v0h * xb[None, :] + v2l * xc[None, :] + v2h * xd[None, :]
        part1 = v1l * xa[None, :] + v1h * xb[None, :] + v3l * xc[None, :] + v3h * xd[None, :]
        # One scale per (row, word pair, b): 2^(s - 65) from its bits, duplicated onto both words of the pair.
        soff = s_rows[:, None] + (c * 64 + sq)[None, :]
        sk = c * 64 + (q // 16) * 64  # first k of the pair's chunk: the scale row ends at K (value rows at 128s)
        smask = rmask[:, None] & ((c * 32 + 2 * q < c_end * 32) & (sk < K))[None, :]
        s0 = tl.load(soff, mask=smask, other=0).to(tl.int32)
        s1 = tl.load(soff + 1, mask=smask, other=0).to(tl.int32)
        s0 = ((s0 + 62) << 23).to(tl.float32, bitcast=True)
        s1 = ((s1 + 62) << 23).to(tl.float32, bitcast=True)
        s0 = tl.reshape(tl.join(s0, s0), [ROWS, COLS])
        s1 = tl.reshape(tl.join(s1, s1), [ROWS, COLS])
        acc0 += part0 * s0
        acc1 += part1 * s1
    # Words 16*s0 .. 16*s0 + 15 of every 32 belong to outputs s0: sum each half, then the chunks.
    r0 = tl.sum(tl.sum(tl.reshape(acc0, [ROWS, KC, 2, 16]), axis=3), axis=1)  # [ROWS, 2 (s0)]
    r1 = tl.sum(tl.sum(tl.reshape(acc1, [ROWS, KC, 2, 16]), axis=3), axis=1)
    n0 = (sr // 8) * 256 + a * 128 + (sr % 8) * 16 + t0 * 2  # output of b = 0, s0 = 0
    s_ = tl.arange(0, 2)
    n = n0[:, None] + s_[None, :]
    out = out_ptr + split.to(tl.int64) * stride_os + p.to(tl.int64) * stride_op + n
    omask = n < N
    tl.store(out, r0, mask=omask)
    tl.store(out + 8, r1, mask=omask)


@triton.jit(do_not_specialize=["S", "stride_ps"])
def _swiglu_kernel(
    part_ptr, out_ptr, S, INTER, stride_ps, stride_pp, stride_o, limit, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """act[p] = swiglu(gate, up) of the split-K sums of part[:, p] (gate | up), each rounded to the output dtype
    first (as ogs_moe's matmul writes them), then triton_moe_glue's arithmetic."""
    tl_pdl_wait(PDL)
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(S):
        row = part_ptr + s * stride_ps + p * stride_pp
        g += tl.load(row + cols, mask=mask, other=0.0)
        u += tl.load(row + INTER + cols, mask=mask, other=0.0)
    dt = out_ptr.dtype.element_ty
    g = tl.minimum(g.to(dt).to(tl.float32), limit)
    u = u.to(dt).to(tl.float32)
    sg = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + p * stride_o + cols, (sg * u).to(dt), mask=mask)


@triton.jit(do_not_specialize=["S", "stride_ps"])
def _combine_kernel(
    part_ptr,
    w_ptr,
    ids_ptr,
    shared_ptr,
    out_ptr,
    S,
    TOPK,
    H,
    stride_ps,
    stride_pp,
    stride_st,
    stride_ot,
    HAS_SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = sum over slots of (routing weight * split-K sum of part[:, t*k + slot]) rounded to the output dtype
    (ogs_moe's down matmul with gammas), summed in fp32 and rounded (triton_moe_glue.combine), + shared."""
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in range(TOPK):
        p = t * TOPK + slot
        y = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(S):
            y += tl.load(part_ptr + s * stride_ps + p * stride_pp + cols, mask=mask, other=0.0)
        wt = tl.load(w_ptr + p).to(tl.float32)
        wt = tl.where(tl.load(ids_ptr + p) < 0, 0.0, wt)
        acc += (y * wt).to(dt).to(tl.float32)
    out = acc.to(dt)
    if HAS_SHARED:
        out = (out.to(tl.float32) + tl.load(shared_ptr + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)).to(
            dt
        )
    tl.store(out_ptr + t * stride_ot + cols, out, mask=mask)


def splits_for(n: int, k: int, routes: int, config: GemvConfig | None = None) -> int:
    """K splits of a GEMV over `routes` routes of [n, k] weights: enough programs to fill the GPU (the config's
    target_programs), each still looping over at least one step of kc chunks. A function of the shapes and the
    config only (CUDA graphs)."""
    cfg = config or DEFAULT_CONFIG
    tiles = triton.cdiv(triton.cdiv(n, 256) * 8, cfg.block_sr) * max(1, routes)
    steps = triton.cdiv(triton.cdiv(k, 64), cfg.kc)
    return max(1, min(steps, triton.cdiv(cfg.target_programs, tiles)))


def gemv(
    wt: GemvWeights,
    x: torch.Tensor,
    ids: torch.Tensor,
    x_div: int = 1,
    splits: int | None = None,
    config: GemvConfig | None = None,
):
    """Per route p: wt[ids[p]] @ x[p // x_div] -> fp32 partial sums [splits, P, N] (sum over dim 0 = the GEMV).

    x: [rows, K] (unit last stride); ids: int [P] (-1: zeros, nothing read); config: DEFAULT_CONFIG if None
    (`splits`, when given, overrides its split-K target)."""
    if x.dim() != 2 or x.shape[1] != wt.k or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, K={wt.k}] with a unit last stride, got {tuple(x.shape)} {x.stride()}")
    cfg = config or DEFAULT_CONFIG
    if not isinstance(cfg, GemvConfig):
        raise ValueError(f"config must be a GemvConfig, got {type(cfg).__name__}")
    require_triton(x.device)
    p = ids.numel()
    chunks = wt.words.shape[2] // 32
    s = splits or splits_for(wt.n, wt.k, p, cfg)
    per = triton.cdiv(triton.cdiv(chunks, s), cfg.kc) * cfg.kc  # chunks a split, in whole loop steps
    s = triton.cdiv(chunks, per)
    out = torch.empty(s, p, wt.n, dtype=torch.float32, device=x.device)
    if p:
        # Every scale row of the storage (N padded to 256): a row's outputs are not one contiguous range of N.
        grid = (triton.cdiv(wt.scales.shape[1], cfg.block_sr), p, s)
        _gemv_kernel[grid](
            wt.words,
            wt.scales,
            x,
            ids,
            out,
            wt.n,
            wt.k,
            wt.words.shape[1],
            wt.words.shape[2],
            per,
            x_div,
            wt.words.stride(0),
            wt.words.stride(1),
            wt.scales.stride(0),
            wt.scales.stride(1),
            x.stride(0),
            out.stride(0),
            out.stride(1),
            BLOCK_SR=cfg.block_sr,
            KC=cfg.kc,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **pdl_kwargs(wt.words),
        )
    return out


def fits(tokens: int, top_k: int) -> bool:
    """Does a call of `tokens` tokens (each routed to top_k experts) take the GEMV? (host ints only)"""
    return 0 < tokens * top_k <= MAX_ROUTES


def gemv_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    ex: GemvExperts,
    limit: float,
    shared: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """= mxfp4_ogs.ogs_moe(x, weights, ids, ...) for T * k <= MAX_ROUTES. x: [T, H]; weights: float [T, k];
    ids: int [T, k] (-1 = another rank's expert: contributes nothing, reads nothing); shared: [T, H] added in the
    k-way sum's launch; config: both GEMVs' launch (DEFAULT_CONFIG if None) -> [T, H] in x.dtype."""
    t, k = ids.shape
    if x.shape != (t, ex.hidden) or weights.shape != ids.shape:
        raise ValueError(
            f"x [T={t}, H={ex.hidden}] and weights [T, k] expected, got {tuple(x.shape)}, {tuple(weights.shape)}"
        )
    if shared is not None and (shared.shape != x.shape or shared.stride(-1) != 1):
        raise ValueError(f"shared must be [T, H] = {tuple(x.shape)} with a unit last stride")
    if t * k > MAX_ROUTES:
        raise ValueError(f"gemv_moe takes at most {MAX_ROUTES} routes, got {t} x {k}; use mxfp4_ogs.ogs_moe")
    if t == 0:
        return torch.zeros_like(x) if shared is None else shared.clone()
    flat = ids.reshape(-1).contiguous()
    x = x.contiguous()
    h13 = gemv(ex.w13, x, flat, x_div=k, config=config)  # [S, P, 2I]: gate | up
    act = torch.empty(t * k, ex.inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(ex.inter))
    _swiglu_kernel[(t * k, triton.cdiv(ex.inter, block))](
        h13,
        act,
        h13.shape[0],
        ex.inter,
        h13.stride(0),
        h13.stride(1),
        act.stride(0),
        float(limit),
        BLOCK=block,
        **pdl_kwargs(h13),
    )
    y = gemv(ex.w2, act, flat, config=config)  # [S, P, H]
    out = torch.empty_like(x)
    block = min(1024, triton.next_power_of_2(ex.hidden))
    _combine_kernel[(t, triton.cdiv(ex.hidden, block))](
        y,
        weights.reshape(-1).contiguous(),
        flat,
        out if shared is None else shared,
        out,
        y.shape[0],
        k,
        ex.hidden,
        y.stride(0),
        y.stride(1),
        0 if shared is None else shared.stride(0),
        out.stride(0),
        HAS_SHARED=shared is not None,
        BLOCK=block,
        **pdl_kwargs(y),
    )
    return out
