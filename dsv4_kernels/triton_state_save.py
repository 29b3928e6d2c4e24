"""Triton compressor state-ring save: the chunk rows a step keeps for later windows, as the ring stores them.

state[ring_rows[i]] = fp32 [kv | gate + ape[pos % r]] of chunk row chunk_rows[i]: the score built in registers as
dsv4_kernels.compressor.state_rows builds it, one program per written ring row (engine.model.batch.RingWrite's
pairs). The second launch of a compressor step, after dsv4_kernels.triton_compress_step.close_windows (which may
read the ring rows this overwrites). No host sync: it runs under CUDA graphs.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()


@triton.jit
def _save_kernel(
    kv_ptr,
    gate_ptr,
    ape_ptr,
    pos_ptr,
    src_ptr,
    dst_ptr,
    state_ptr,
    W,
    RATIO,
    stride_kt,
    stride_gt,
    stride_ar,
    stride_sr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    src = tl.load(src_ptr + i + tl.arange(0, 1)).to(tl.int64)  # [1]: the interpreter needs vector masks
    dst = tl.load(dst_ptr + i + tl.arange(0, 1)).to(tl.int64)
    mask = (cols < W)[None, :] & (dst >= 0)[:, None]
    pos = tl.load(pos_ptr + src).to(tl.int64)
    kv = tl.load(kv_ptr + src[:, None] * stride_kt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + src[:, None] * stride_gt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ape = tl.load(ape_ptr + (pos % RATIO)[:, None] * stride_ar + cols[None, :], mask=mask, other=0.0)
    row = state_ptr + tl.maximum(dst, 0)[:, None] * stride_sr
    tl.store(row + cols[None, :], kv, mask=mask)
    tl.store(row + W + cols[None, :], gate + ape.to(tl.float32), mask=mask)


def save_state(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state: torch.Tensor,
    chunk_rows: torch.Tensor,
    ring_rows: torch.Tensor,
) -> None:
    """state[ring_rows[i]] = fp32 [kv | gate + ape[pos % r]] of chunk row chunk_rows[i] (engine.model.batch.RingWrite).

    kv, gate: [T, W] (row strides free, unit last stride); ape: [r, W]; positions: int [T]; state: fp32 [R, 2W];
    chunk_rows / ring_rows: int [M] (ring_rows < 0 skipped). Equals
    `RingWrite(chunk_rows, ring_rows).apply(dsv4_kernels.compressor.state_rows(kv, gate, ape, positions), state)`."""
    t, w = kv.shape
    if gate.shape != kv.shape or kv.stride(-1) != 1 or gate.stride(-1) != 1 or ape.dim() != 2 or ape.shape[1] != w:
        raise ValueError(
            f"kv / gate must be matching [T, W] and ape [r, W], got {tuple(kv.shape)}, "
            f"{tuple(gate.shape)}, {tuple(ape.shape)}"
        )
    if state.dtype != torch.float32 or state.dim() != 2 or state.shape[1] != 2 * w or state.stride(-1) != 1:
        raise ValueError(f"state must be fp32 [R, 2W={2 * w}], got {state.dtype} {tuple(state.shape)}")
    if chunk_rows.dim() != 1 or ring_rows.shape != chunk_rows.shape:
        raise ValueError(
            f"chunk_rows / ring_rows must be matching [M], got {tuple(chunk_rows.shape)}, {tuple(ring_rows.shape)}"
        )
    require_triton(kv.device)
    m = chunk_rows.shape[0]
    if m == 0:
        return
    block_w = min(1024, triton.next_power_of_2(w))
    _save_kernel[(m, triton.cdiv(w, block_w))](
        kv,
        gate,
        ape,
        positions,
        chunk_rows.contiguous(),
        ring_rows.contiguous(),
        state,
        w,
        ape.shape[0],
        kv.stride(0),
        gate.stride(0),
        ape.stride(0),
        state.stride(0),
        BLOCK_W=block_w,
        **pdl_kwargs(kv),
    )
