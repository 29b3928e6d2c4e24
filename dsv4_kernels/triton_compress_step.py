"""Triton compressor step: close this step's windows straight from their slot rows into the entry cache.

Reference (engine/model/attention.py, AttentionBlock._compress on the reference path), for one compressor of ratio r:
    rows  = dsv4_kernels.compressor.state_rows(kv, gate, ape, positions)  # fp32 [T, 2W] = [kv | gate + ape[pos % r]]
    cur   = plan.cur.gather(rows, state); prev = plan.prev.gather(rows, state)   # SourceRows: [ring | chunk] rows
    slots = overlap_slots(prev, cur, prev_valid) (ratio 4) or cur (ratio 128)
    entry = apply_rope(rms_norm(pool_windows(slots kv in the model dtype, slots score), weight, eps), cos, sin)
    entries.write(plan.entry_row, entry); plan.state_write.apply(rows, state)
`close_windows` does the first five lines in one launch: each program takes one entry, reads each slot where it
lives -- a state-ring row (fp32 [kv | score]) or a chunk row (kv and gate in the model dtype, the score built in
registers as gate + ape[position % r], as state_rows builds it) -- pools, normalises, rotates at the window start
(cos / sin gathered from a table of multiples of r, not computed per step) and stores the entry into the entry
cache: exact rows in the model dtype, or the quantised row (fp8_ds_mla KV entries, MXFP4 / FP8 indexer keys) of
dsv4_kernels/triton_compressor.py's writers. The last line is dsv4_kernels.triton_state_save.save_state, run after
this: the close reads ring rows this step's save may overwrite (prefill chunks).

Rounding: as dsv4_kernels/triton_compressor.py's quantised writer (every bf16 rounding by bits), so interpreter and GPU
agree; against the torch reference an entry may differ by about one ulp (fp32 sums in another order).
No host sync; shapes are the plan's (static in a fixed-shape decode step), so both run under CUDA graphs.
"""

from __future__ import annotations

import torch

from dsv4_kernels import triton_cache_codecs as tc
from dsv4_kernels.geometry import Fp8DsMlaLayout, IndexerKeyLayout
from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_cache_codecs import tl_round_bf16, tl_round_to, tl_row_offsets, tl_store_fp8_ds_mla
from dsv4_kernels.triton_compressor import entry_quant_format, tl_store_indexer_key
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


@triton.jit
def _slot_rows(cur_ptr, prev_ptr, pv, n, sl, R, D, OVERLAP: tl.constexpr, RATIO: tl.constexpr):
    """Slots sl of entry n -> (row into [ring | chunk], first column of its half, dead slot, slot in range)."""
    if OVERLAP:
        in_range = sl < 2 * RATIO
        is_prev = sl < RATIO
        rp = tl.load(prev_ptr + n * RATIO + sl, mask=is_prev & in_range, other=0)
        rc = tl.load(cur_ptr + n * RATIO + sl - RATIO, mask=(sl >= RATIO) & in_range, other=0)
        rid = tl.where(is_prev, rp, rc).to(tl.int64)
        col0 = tl.where(is_prev, 0, D)  # window w-1 gives its first half (Ca), window w its second (Cb)
        dead = is_prev & (pv == 0)
    else:
        in_range = sl < RATIO
        rid = tl.load(cur_ptr + n * RATIO + sl, mask=in_range, other=0).to(tl.int64)
        col0 = sl * 0
        dead = sl < 0
    return rid, col0, dead, in_range


@triton.jit
def _load_slots(
    state_ptr,
    kv_ptr,
    gate_ptr,
    ape_ptr,
    pos_ptr,
    rid,
    col0,
    dead,
    in_range,
    cols,
    cmask,
    R,
    W,
    stride_sr,
    stride_kt,
    stride_gt,
    stride_ar,
    RATIO: tl.constexpr,
    LOAD_KV: tl.constexpr,
):
    """[slots, cols] fp32 scores (-inf where dead / out of range), or kv values (0 there) when LOAD_KV."""
    live = in_range & (dead == 0)
    ring = rid < R
    c = tl.maximum(rid - R, 0)
    m_ring = (live & ring)[:, None] & cmask[None, :]
    m_chunk = (live & (rid >= R))[:, None] & cmask[None, :]
    col = col0[:, None] + cols[None, :]
    r = tl.maximum(tl.minimum(rid, R - 1), 0)
    if LOAD_KV:
        a = tl.load(state_ptr + r[:, None] * stride_sr + col, mask=m_ring, other=0.0)
        b = tl.load(kv_ptr + c[:, None] * stride_kt + col, mask=m_chunk, other=0.0).to(tl.float32)
        val = tl.where(m_chunk, b, a)
    else:
        a = tl.load(state_ptr + r[:, None] * stride_sr + W + col, mask=m_ring, other=float("-inf"))
        pos = tl.load(pos_ptr + c, mask=live & (rid >= R), other=0).to(tl.int64)
        g = tl.load(gate_ptr + c[:, None] * stride_gt + col, mask=m_chunk, other=0.0).to(tl.float32)
        ape = tl.load(ape_ptr + (pos % RATIO)[:, None] * stride_ar + col, mask=m_chunk, other=0.0).to(tl.float32)
        val = tl.where(m_chunk, g + ape, a)
        val = tl.where(live[:, None] & cmask[None, :], val, float("-inf"))
    return val


@triton.jit
def _pool(
    state_ptr,
    kv_ptr,
    gate_ptr,
    ape_ptr,
    pos_ptr,
    cur_ptr,
    prev_ptr,
    pv,
    n,
    cols,
    cmask,
    R,
    D,
    W,
    stride_sr,
    stride_kt,
    stride_gt,
    stride_ar,
    DT: tl.constexpr,
    OVERLAP: tl.constexpr,
    RATIO: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BF16: tl.constexpr,
):
    """dsv4_kernels.compressor.pool_windows of columns `cols` of entry n (fp32 holding model-dtype values)."""
    m = tl.full(cols.shape, float("-inf"), dtype=tl.float32)
    l = tl.zeros(cols.shape, dtype=tl.float32)
    for s0 in range(0, SLOTS, BLOCK_S):
        sl = s0 + tl.arange(0, BLOCK_S)
        rid, col0, dead, ok = _slot_rows(cur_ptr, prev_ptr, pv, n, sl, R, D, OVERLAP, RATIO)
        sc = _load_slots(
            state_ptr,
            kv_ptr,
            gate_ptr,
            ape_ptr,
            pos_ptr,
            rid,
            col0,
            dead,
            ok,
            cols,
            cmask,
            R,
            W,
            stride_sr,
            stride_kt,
            stride_gt,
            stride_ar,
            RATIO,
            False,
        )
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(sc - m_safe[None, :]), axis=0)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    inv_l = 1.0 / tl.where(cmask, l, 1.0)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s0 in range(0, SLOTS, BLOCK_S):
        sl = s0 + tl.arange(0, BLOCK_S)
        rid, col0, dead, ok = _slot_rows(cur_ptr, prev_ptr, pv, n, sl, R, D, OVERLAP, RATIO)
        sc = _load_slots(
            state_ptr,
            kv_ptr,
            gate_ptr,
            ape_ptr,
            pos_ptr,
            rid,
            col0,
            dead,
            ok,
            cols,
            cmask,
            R,
            W,
            stride_sr,
            stride_kt,
            stride_gt,
            stride_ar,
            RATIO,
            False,
        )
        kv = _load_slots(
            state_ptr,
            kv_ptr,
            gate_ptr,
            ape_ptr,
            pos_ptr,
            rid,
            col0,
            dead,
            ok,
            cols,
            cmask,
            R,
            W,
            stride_sr,
            stride_kt,
            stride_gt,
            stride_ar,
            RATIO,
            True,
        )
        w = tl_round_to(tl.exp(sc - m[None, :]) * inv_l[None, :], BF16, DT)
        acc += tl.sum(tl_round_to(kv * w, BF16, DT), axis=0)
    return tl_round_to(acc, BF16, DT)


@triton.jit(do_not_specialize=["R", "skip_row"])
def _close_kernel(
    state_ptr,
    kv_ptr,
    gate_ptr,
    ape_ptr,
    pos_ptr,
    cur_ptr,
    prev_ptr,
    pv_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    epos_ptr,
    rows_ptr,
    out_ptr,
    cache_ptr,
    R,
    D,
    W,
    HALF,
    eps,
    hscale,
    table_rows,
    skip_row,
    block_size,
    block_stride,
    stride_sr,
    stride_kt,
    stride_gt,
    stride_ar,
    stride_pv,
    stride_on,
    stride_cr,
    FMT: tl.constexpr,
    OVERLAP: tl.constexpr,
    RATIO: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NOPE_P: tl.constexpr,
    HALF_P: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    LD: tl.constexpr,
    NB: tl.constexpr,
    OUT_P: tl.constexpr,
    HADAMARD: tl.constexpr,
    LOG2D: tl.constexpr,
    BF16: tl.constexpr,
    HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    first = tl.load(rows_ptr + n)
    if (first < 0) | (first == skip_row):
        # No window of this row closes this step. A fixed-shape decode step launches a program for every row
        # whether or not its window closes (1 step in r): pooling anyway cost 88 us a step at ratio 128.
        return
    dt = out_ptr.dtype.element_ty
    pv = 1
    if OVERLAP:
        pv = tl.load(pv_ptr + n * stride_pv).to(tl.int32)
    nope = D - 2 * HALF
    ca = tl.arange(0, NOPE_P)
    ma = ca < nope
    p = tl.arange(0, HALF_P)
    mp = p < HALF
    ce = nope + 2 * p
    a = tl.where(
        ma,
        _pool(
            state_ptr,
            kv_ptr,
            gate_ptr,
            ape_ptr,
            pos_ptr,
            cur_ptr,
            prev_ptr,
            pv,
            n,
            ca,
            ma,
            R,
            D,
            W,
            stride_sr,
            stride_kt,
            stride_gt,
            stride_ar,
            dt,
            OVERLAP,
            RATIO,
            SLOTS,
            BLOCK_S,
            BF16,
        ),
        0.0,
    )
    e = tl.where(
        mp,
        _pool(
            state_ptr,
            kv_ptr,
            gate_ptr,
            ape_ptr,
            pos_ptr,
            cur_ptr,
            prev_ptr,
            pv,
            n,
            ce,
            mp,
            R,
            D,
            W,
            stride_sr,
            stride_kt,
            stride_gt,
            stride_ar,
            dt,
            OVERLAP,
            RATIO,
            SLOTS,
            BLOCK_S,
            BF16,
        ),
        0.0,
    )
    o = tl.where(
        mp,
        _pool(
            state_ptr,
            kv_ptr,
            gate_ptr,
            ape_ptr,
            pos_ptr,
            cur_ptr,
            prev_ptr,
            pv,
            n,
            ce + 1,
            mp,
            R,
            D,
            W,
            stride_sr,
            stride_kt,
            stride_gt,
            stride_ar,
            dt,
            OVERLAP,
            RATIO,
            SLOTS,
            BLOCK_S,
            BF16,
        ),
        0.0,
    )
    r = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(e * e, axis=0) + tl.sum(o * o, axis=0)) / D + eps)
    a = tl_round_to(tl.load(w_ptr + ca, mask=ma, other=0.0).to(tl.float32) * (a * r), BF16, dt)
    e = tl_round_to(tl.load(w_ptr + ce, mask=mp, other=0.0).to(tl.float32) * (e * r), BF16, dt)
    o = tl_round_to(tl.load(w_ptr + ce + 1, mask=mp, other=0.0).to(tl.float32) * (o * r), BF16, dt)
    # cos / sin of the window start from the table of multiples of RATIO (clamped: padding rows only)
    k = tl.load(epos_ptr + n + tl.arange(0, 1)).to(tl.int64) // RATIO
    k = tl.minimum(tl.maximum(k, 0), table_rows - 1)
    c = tl.load(cos_ptr + k * HALF + p, mask=mp, other=1.0)
    s = tl.load(sin_ptr + k * HALF + p, mask=mp, other=0.0)
    e, o = tl_round_to(e * c - o * s, BF16, dt), tl_round_to(o * c + e * s, BF16, dt)

    slot = tl.load(rows_ptr + n + tl.arange(0, 1)).to(tl.int64)  # [1]: the interpreter needs vector masks
    ok = slot >= 0
    slot = tl.maximum(slot, 0)
    if FMT == 3:  # exact entry rows in the model dtype
        row = cache_ptr + slot * stride_cr
        cdt = cache_ptr.dtype.element_ty
        tl.store(row + ca, a.to(cdt), mask=ma & ok)
        tl.store(row + ce, e.to(cdt), mask=mp & ok)
        tl.store(row + ce + 1, o.to(cdt), mask=mp & ok)
    else:
        o_row = out_ptr + n * stride_on
        vrow, srow = tl_row_offsets(slot, block_size, block_stride, VALUE_BYTES, SCALE_BYTES)
        if FMT == 0:
            nope2 = tl.reshape(tl_round_bf16(a), [NOPE_P // 64, 64])
            tl_store_fp8_ds_mla(
                cache_ptr,
                vrow,
                srow,
                ok,
                nope2,
                tl_round_bf16(e),
                tl_round_bf16(o),
                p,
                HALF,
                NB,
                NOPE_P // 64,
                64,
                LD,
                SCALE_BYTES - NB,
                HW_FP8,
            )
        else:
            tl_store_indexer_key(
                cache_ptr,
                o_row,
                vrow,
                srow,
                ok,
                a,
                e,
                o,
                ca,
                ce,
                D,
                hscale,
                FMT,
                LD,
                NB,
                OUT_P,
                HADAMARD,
                LOG2D,
                BF16,
                HW_FP8,
            )


def entry_rope_table(cos_sin_of, max_positions: int, ratio: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin at positions 0, r, 2r, ... below max_positions: fp32 [ceil(max / r), rope_dim // 2] each.

    cos_sin_of: positions -> (cos, sin) (the engine's compress Rope), so the table holds exactly its values."""
    cos, sin = cos_sin_of(torch.arange(0, max(max_positions, 1), ratio, device=device))
    return cos.float().contiguous(), sin.float().contiguous()


def close_windows(
    state: torch.Tensor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    cur_rows: torch.Tensor,
    prev_rows: torch.Tensor | None,
    prev_valid: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    entry_pos: torch.Tensor,
    entry_rows: torch.Tensor,
    cache: torch.Tensor,
    layout: Fp8DsMlaLayout | IndexerKeyLayout | None = None,
    *,
    hadamard: bool = False,
    block_s: int | None = None,
    skip_row: int = -1,
) -> None:
    """Pool, normalise, rotate and store N entries whose slots are read in place (module docstring).

    state: fp32 [R, 2W] one layer's state ring (row stride free); kv, gate: [T, W] this step's compressor
    projections (model dtype; row strides free, e.g. column slices of one GEMM output); ape: fp32 [r, W];
    positions: int [T]; cur_rows / prev_rows: int64 [N, r] rows into [ring R | chunk T] (SourceRows.row; prev
    only with overlap, r = 4, then W = 2 d); prev_valid: bool [N] or [N, k] (column 0 read); weight: [d];
    cos_table / sin_table: fp32 [P, rope_dim // 2] at positions 0, r, 2r, ... (`entry_rope_table`);
    entry_pos: int [N] window starts; entry_rows: int [N] rows of the entry cache (-1 = skip);
    cache: exact [rows, d] model-dtype rows when layout is None, else the paged uint8 cache of `layout`.
    hadamard: rotate indexer keys by H / sqrt(d) before quantising (the engine stores them unrotated).
    skip_row: an entry row that means "no window closes" too (a decode plan's scratch row); its program returns
    at once, as for -1.
    """
    n, r = cur_rows.shape if cur_rows.dim() == 2 else (0, 0)
    overlap = prev_rows is not None
    t, w = kv.shape
    d = weight.shape[0]
    if cur_rows.dim() != 2 or (prev_rows is not None and (prev_rows.shape != cur_rows.shape or prev_valid is None)):
        raise ValueError(f"cur_rows / prev_rows must be matching [N, r], got {tuple(cur_rows.shape)}")
    if w != (2 * d if overlap else d) or gate.shape != kv.shape or kv.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError(
            f"kv / gate must be [T, {'2d' if overlap else 'd'}] (d={d}) with unit last stride, got "
            f"{tuple(kv.shape)}, {tuple(gate.shape)}"
        )
    if state.dtype != torch.float32 or state.dim() != 2 or state.shape[1] != 2 * w or state.stride(-1) != 1:
        raise ValueError(f"state must be fp32 [R, 2W={2 * w}], got {state.dtype} {tuple(state.shape)}")
    if ape.shape != (r, w) or ape.stride(-1) != 1 or positions.shape != (t,):
        raise ValueError(
            f"ape must be [r={r}, W={w}] and positions [T={t}], got {tuple(ape.shape)}, {tuple(positions.shape)}"
        )
    half = cos_table.shape[1]
    if sin_table.shape != cos_table.shape or 2 * half > d or entry_pos.shape != (n,):
        raise ValueError(f"cos/sin tables must be [P, rope_dim // 2 <= {d // 2}] and entry_pos [N={n}]")
    require_triton(kv.device)
    if n == 0:
        return
    cos_table, sin_table = cos_table.float().contiguous(), sin_table.float().contiguous()
    out = kv  # the kernel's dtype source; a scratch [N, d] for indexer keys (their writer stores them too)
    if layout is None:
        if cache.dim() != 2 or cache.shape[1] != d or cache.stride(-1) != 1:
            raise ValueError(
                f"an exact entry cache must be [rows, d={d}] with unit last stride, got {tuple(cache.shape)}"
            )
        fmt, block_stride, nope_p, width, out_p, nb = 3, 0, triton.next_power_of_2(max(1, d - 2 * half)), d, 1, 1
        value_bytes = scale_bytes = 1
        stride_cr = cache.stride(0)
    else:
        fmt = entry_quant_format(layout, d, 2 * half, hadamard)
        block_stride, capacity = tc.paged_cache_args(cache, layout)
        value_bytes, scale_bytes, nb, stride_cr = layout.value_bytes, layout.scale_bytes, layout.num_scales, 0
        if isinstance(layout, Fp8DsMlaLayout):  # fmt 0
            nope_p, width, out_p = triton.next_power_of_2(layout.nope_dim), layout.nope_dim, 1
        else:
            width = layout.index_head_dim
            nope_p = max(1, triton.next_power_of_2(d - 2 * half))
            out_p = triton.next_power_of_2(width // 2 if fmt == 1 else width)
            out = torch.empty(n, d, dtype=kv.dtype, device=kv.device)  # the key as quantised (not kept)
    entry_rows = tc.check_rows(entry_rows, n, 0, "entry_rows")
    slots = 2 * r if overlap else r
    # 8 slots a tile: 16 x 512-wide fp32 tiles spill on sm_90 (scripts/compile_triton_sm90.py)
    block_s = block_s or max(1, min(8, triton.next_power_of_2(slots)))
    pv = prev_valid if prev_rows is not None and prev_valid is not None else entry_rows  # overlap: both given
    extra = {"num_warps": 4} if kv.is_cuda else {}
    _close_kernel[(n,)](
        state,
        kv,
        gate,
        ape,
        positions,
        cur_rows.contiguous(),
        (prev_rows if prev_rows is not None else cur_rows).contiguous(),
        pv,
        weight,
        cos_table,
        sin_table,
        entry_pos,
        entry_rows,
        out,
        cache,
        state.shape[0],
        d,
        w,
        half,
        eps,
        d**-0.5 if hadamard else 1.0,
        cos_table.shape[0],
        skip_row,
        layout.block_size if layout is not None else 1,
        block_stride,
        state.stride(0),
        kv.stride(0),
        gate.stride(0),
        ape.stride(0),
        pv.stride(0),
        out.stride(0),
        stride_cr,
        FMT=fmt,
        OVERLAP=overlap,
        RATIO=r,
        SLOTS=slots,
        BLOCK_S=block_s,
        NOPE_P=nope_p,
        HALF_P=max(1, triton.next_power_of_2(half)),
        VALUE_BYTES=value_bytes,
        SCALE_BYTES=scale_bytes,
        LD=width,
        NB=nb,
        OUT_P=out_p,
        HADAMARD=hadamard,
        LOG2D=max(1, d.bit_length() - 1),
        BF16=kv.dtype == torch.bfloat16,
        HW_FP8=kv.is_cuda and tc.USE_HW_FP8_CAST,
        **extra,
        **pdl_kwargs(state),
    )
