"""Triton kernels of the sparse MQA attention with a per-head sink (dsv4_kernels/triton_attention.py launches them).

Algorithm (MQA reuse, as FlashMLA's decode kernel): one program per (token, block of up to 64 heads,
split of K). All heads of a token share the same K = V rows, so a program holds the whole query block
q [BLOCK_H, D] and walks its K range in row tiles [BLOCK_K, D] that are loaded (and, for fp8,
dequantised) ONCE and used by all BLOCK_H heads through tensor-core dots:
    S = q @ tile^T   [BLOCK_H, BLOCK_K],   acc += softmax-part(S) @ tile   [BLOCK_H, D],
with an fp32 online softmax in base 2. With H <= 64 there is one head block, so the bytes read per token
are K rows x row bytes (+ q). D is handled as up to four column segments of power-of-two width (at most
256, e.g. 512 = 256 + 256; fp8_ds_mla 512 = NoPE 256 + 128 + 64, RoPE 64): S sums one dot per segment,
and the fp32 accumulator is one [BLOCK_H, width] tensor per segment (64 x 512 fp32 = 128 registers a
thread over 8 warps). The running max starts at the sink logit, not -inf, which keeps every exponent
finite (no NaN for all-invalid tiles) and folds the sink into the normaliser for free; an all-invalid
query ends with acc = 0, i.e. the zero vector, as in the reference. Decode has few tokens, so K is split
across programs when the grid would not fill the GPU (flash-decoding) and a second kernel merges the
partial (max, sum, acc).

Interpreter note: triton's CPU interpreter stores bf16 as raw uint16 and does integer arithmetic and
matmuls on the bits, so kernels here convert every bf16 load to fp32 before arithmetic and only use bf16
dot operands when compiled for the GPU (`BF16_DOT`); the interpreter runs the same dots in fp32. Its
fp32 -> bf16 cast also truncates (the GPU rounds to nearest even), so interpreted bf16 outputs can be
one ulp lower in magnitude than compiled ones; bf16 tolerances cover both. On the GPU the bf16 rows go
straight from memory into the dots (no register round trip), so triton can pipeline the tile loads.
"""

from __future__ import annotations

from dsv4_kernels.gpu import import_triton
from dsv4_kernels.triton_pdl import tl_pdl_wait

triton, tl = import_triton()


@triton.jit
def _dot(a, b, BF16_DOT: tl.constexpr):
    """[M, K] x [K, N] -> fp32; operands already bf16 on the GPU path, exact fp32 in the interpreter."""
    if BF16_DOT:
        c = tl.dot(a, b)
    else:
        c = tl.dot(a, b, input_precision="ieee")
    return c


@triton.jit
def _load_seg(
    rp,
    sp,
    ok,
    O: tl.constexpr,
    W: tl.constexpr,
    P: tl.constexpr,
    KIND: tl.constexpr,
    BF16_DOT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    BK: tl.constexpr,
):
    """Columns [O, O + W) (padded to P) of BK rows -> [BK, P] dot operand (bf16 on GPU, fp32 when interpreted).

    rp: per-row pointers to the row start (elements of the store for KIND 0, the fp8 value row's bytes
    otherwise); sp: per-row pointers to the fp8 scale row (KIND 1 only). Masked rows / columns read 0.
    """
    c = tl.arange(0, P)
    if W == P:
        mask = ok[:, None]
    else:
        mask = ok[:, None] & (c < W)[None, :]
    if KIND == 0:
        x = tl.load(rp[:, None] + (O + c)[None, :], mask=mask, other=0.0)
        if BF16_DOT:
            x = x.to(tl.bfloat16)  # a no-op for bf16 stores: the load feeds the dots directly
        else:
            x = x.to(tl.float32)
    elif KIND == 1:
        # e4m3 codes times one UE8M0 scale byte per SCALE_BLOCK columns; the byte scales are loaded once
        # as [BK, P / SCALE_BLOCK] and broadcast over their block (W is a multiple of SCALE_BLOCK).
        codes = tl.load(rp[:, None] + (O + c)[None, :], mask=mask, other=0)
        NB: tl.constexpr = P // SCALE_BLOCK
        sidx = tl.arange(0, NB)
        sbyte = tl.load(
            sp[:, None] + (O // SCALE_BLOCK + sidx)[None, :],
            mask=ok[:, None] & (sidx * SCALE_BLOCK < W)[None, :],
            other=127,
        )
        # UE8M0 byte b is 2**(b - 127): build the fp32 from its exponent bits (exact, unlike ex2.approx).
        scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        x = tl.reshape(tl.reshape(vals, [BK, NB, SCALE_BLOCK]) * scale[:, :, None], [BK, P])
        if BF16_DOT:
            x = x.to(tl.bfloat16)  # exact: 3 mantissa bits times a power of two
    else:
        # Raw bf16 RoPE values at byte O (= the NoPE width) of the value row.
        x = tl.load((rp + O).to(tl.pointer_type(tl.bfloat16))[:, None] + c[None, :], mask=mask, other=0.0)
        if not BF16_DOT:
            x = x.to(tl.float32)
    return x


@triton.jit
def _load_q(q_row, hmask, O: tl.constexpr, W: tl.constexpr, P: tl.constexpr, BF16_DOT: tl.constexpr):
    c = tl.arange(0, P)
    x = tl.load(q_row[:, None] + (O + c)[None, :], mask=hmask[:, None] & (c < W)[None, :], other=0.0)
    return x.to(tl.bfloat16) if BF16_DOT else x.to(tl.float32)


@triton.jit
def _store_seg(o_row, hmask, acc, scale, O: tl.constexpr, W: tl.constexpr, P: tl.constexpr):
    """o_row: [BLOCK_H] pointers to the output (or partial) row; writes acc * scale[:, None] cast to its type."""
    c = tl.arange(0, P)
    tl.store(
        o_row[:, None] + (O + c)[None, :],
        (acc * scale[:, None]).to(o_row.dtype.element_ty),
        mask=hmask[:, None] & (c < W)[None, :],
    )


# K, the split counts and the store sizes (R0, R01: a prefill's local compressed rows) vary with the step, and
# rows' stride with K: unspecialised, so they add no compiled variants (engine.execution.warmup). b1 / b2, the element
# offsets of stores 1 and 2 from store 0, are pointer differences: wherever the allocator put this step's stores.
# Typed by value they would be i32 or i64 (stores 4 GiB apart), a variant each, compiled mid-request
# (engine.telemetry.compile_watch showed it): declared i64 and unspecialised, they are one.
@triton.jit(do_not_specialize=["K", "tiles_per_split", "num_splits", "stride_rt", "R0", "R01", "b1", "b2"])
def sparse_attn_kernel(
    q_ptr,
    kv0_ptr,
    rows_ptr,
    sink_ptr,
    out_ptr,
    pacc_ptr,
    pml_ptr,
    H,
    K,
    tiles_per_split,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_rt,
    R0,
    R01,
    s0,
    s1,
    s2,
    b1: tl.int64,
    b2: tl.int64,
    block_size,
    stride_block,
    scale_log2,
    D: tl.constexpr,
    NSRC: tl.constexpr,
    ALIGN: tl.constexpr,
    FP8: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,
    SCALE_STRIDE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    NSEG: tl.constexpr,
    O0: tl.constexpr,
    W0: tl.constexpr,
    P0: tl.constexpr,
    KD0: tl.constexpr,
    O1: tl.constexpr,
    W1: tl.constexpr,
    P1: tl.constexpr,
    KD1: tl.constexpr,
    O2: tl.constexpr,
    W2: tl.constexpr,
    P2: tl.constexpr,
    KD2: tl.constexpr,
    O3: tl.constexpr,
    W3: tl.constexpr,
    P3: tl.constexpr,
    KD3: tl.constexpr,
    QO0: tl.constexpr,
    QO1: tl.constexpr,
    QO2: tl.constexpr,
    QO3: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    BF16_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Segment i: store columns O_i (bytes for fp8 kinds) of width W_i, q / output columns QO_i."""
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp_id = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H

    # The query block, loaded once and converted to the dot operand type outside the K loop.
    q_row = q_ptr + t * stride_qt + heads.to(tl.int64) * stride_qh
    q0 = _load_q(q_row, hmask, QO0, W0, P0, BF16_DOT)
    if NSEG > 1:
        q1 = _load_q(q_row, hmask, QO1, W1, P1, BF16_DOT)
    if NSEG > 2:
        q2 = _load_q(q_row, hmask, QO2, W2, P2, BF16_DOT)
    if NSEG > 3:
        q3 = _load_q(q_row, hmask, QO3, W3, P3, BF16_DOT)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634

    # Running state in base 2. m starts at the sink so it is always finite; without a split the sink's
    # own exp2(sink - m) = 1 is already in l, with a split the merge kernel adds it once.
    m_i = sink
    if SPLIT:
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, P0], dtype=tl.float32)
    if NSEG > 1:
        acc1 = tl.zeros([BLOCK_H, P1], dtype=tl.float32)
    if NSEG > 2:
        acc2 = tl.zeros([BLOCK_H, P2], dtype=tl.float32)
    if NSEG > 3:
        acc3 = tl.zeros([BLOCK_H, P3], dtype=tl.float32)

    num_tiles = tl.cdiv(K, BLOCK_K)
    tile_begin = sp_id * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    for tile in range(tile_begin, tile_end):
        ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        r = tl.load(rows_ptr + t * stride_rt + ks, mask=ks < K, other=-1).to(tl.int64)
        ok = r >= 0
        r = tl.where(ok, r, 0)
        if FP8:
            blk = r // block_size
            pos = r - blk * block_size
            base = kv0_ptr + blk * stride_block
            rp = base + pos * TOKEN_STRIDE
            sp = base + block_size * TOKEN_STRIDE + pos * SCALE_STRIDE
        else:
            # Row ids index the concatenation of up to three stores [kv0 | kv1 | kv2]; stores 1 and 2 are
            # addressed by their element offset from store 0 (b1, b2), so the row pointers stay
            # `kv0_ptr + offset` and triton can prove the 16-byte alignment its async copies need.
            if NSRC == 1:
                off = r * s0
            elif NSRC == 2:
                off = tl.where(r < R0, r * s0, b1 + (r - R0) * s1)
            else:
                off = tl.where(r < R0, r * s0, tl.where(r < R01, b1 + (r - R0) * s1, b2 + (r - R01) * s2))
            if ALIGN > 1:
                off = tl.multiple_of(off, ALIGN)
            rp = kv0_ptr + off
            sp = rp
        k0 = _load_seg(rp, sp, ok, O0, W0, P0, KD0, BF16_DOT, SCALE_BLOCK, BLOCK_K)
        s = _dot(q0, tl.trans(k0), BF16_DOT)
        if NSEG > 1:
            k1 = _load_seg(rp, sp, ok, O1, W1, P1, KD1, BF16_DOT, SCALE_BLOCK, BLOCK_K)
            s += _dot(q1, tl.trans(k1), BF16_DOT)
        if NSEG > 2:
            k2 = _load_seg(rp, sp, ok, O2, W2, P2, KD2, BF16_DOT, SCALE_BLOCK, BLOCK_K)
            s += _dot(q2, tl.trans(k2), BF16_DOT)
        if NSEG > 3:
            k3 = _load_seg(rp, sp, ok, O3, W3, P3, KD3, BF16_DOT, SCALE_BLOCK, BLOCK_K)
            s += _dot(q3, tl.trans(k3), BF16_DOT)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BF16_DOT:
            p = p.to(tl.bfloat16)
        acc0 = acc0 * alpha[:, None] + _dot(p, k0, BF16_DOT)
        if NSEG > 1:
            acc1 = acc1 * alpha[:, None] + _dot(p, k1, BF16_DOT)
        if NSEG > 2:
            acc2 = acc2 * alpha[:, None] + _dot(p, k2, BF16_DOT)
        if NSEG > 3:
            acc3 = acc3 * alpha[:, None] + _dot(p, k3, BF16_DOT)
        m_i = m_new

    if SPLIT:
        # Partials: acc [T, H, S, D] fp32 and (m, l) [T, H, S, 2] fp32, merged by _merge_kernel.
        prow = (t * H + heads) * num_splits + sp_id
        o_row = pacc_ptr + prow * D
        one = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        tl.store(pml_ptr + prow * 2, m_i, mask=hmask)
        tl.store(pml_ptr + prow * 2 + 1, l_i, mask=hmask)
    else:
        o_row = out_ptr + t * stride_ot + heads.to(tl.int64) * stride_oh
        one = 1.0 / l_i
    _store_seg(o_row, hmask, acc0, one, QO0, W0, P0)
    if NSEG > 1:
        _store_seg(o_row, hmask, acc1, one, QO1, W1, P1)
    if NSEG > 2:
        _store_seg(o_row, hmask, acc2, one, QO2, W2, P2)
    if NSEG > 3:
        _store_seg(o_row, hmask, acc3, one, QO3, W3, P3)


@triton.jit
def merge_kernel(
    pacc_ptr,
    pml_ptr,
    sink_ptr,
    out_ptr,
    H,
    num_splits,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    PD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the split partials of one (token, head block); the sink enters once, as the initial state."""
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    c = tl.arange(0, PD)
    mask = hmask[:, None] & (c < D)[None, :]
    m = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    l = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, PD], dtype=tl.float32)
    for sp in range(0, num_splits):
        row = (t * H + heads) * num_splits + sp
        m_s = tl.load(pml_ptr + row * 2, mask=hmask, other=0.0)
        l_s = tl.load(pml_ptr + row * 2 + 1, mask=hmask, other=0.0)
        a = tl.load(pacc_ptr + row[:, None] * D + c[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        l = l * alpha + l_s * beta
        acc = acc * alpha[:, None] + a * beta[:, None]
        m = m_new
    inv = 1.0 / l
    o_row = out_ptr + t * stride_ot + heads.to(tl.int64) * stride_oh
    tl.store(o_row[:, None] + c[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
