"""Triton step inputs in one launch: the token embeddings expanded into the hc residual streams, and the step's
RoPE cos / sin tables.

Reference (engine.model.model's torch path, 8 kernels at batch-1 decode: the positions' fp32 cast, mul, cos, mul,
sin, mul, the embedding gather and the expanding cast-copy):
- streams[t, i, :] = table[token_ids[t]].to(streams dtype) for each of the hc streams;
- for each RoPE r (V4: main and compress, equal widths), freqs = float(positions[t]) * inv_freq[r] (fp32),
  cos_sin[r, 0, t] = cos(freqs) * factor[r], cos_sin[r, 1, t] = sin(freqs) * factor[r]  (dsv4_kernels.rope.rope_cos_sin).
cos and sin are libdevice's (the precise cosf / sinf that torch's CUDA kernels call, not the approximate
instructions, whose error grows with the angle: positions reach 1M here). Grid (T, D / BLOCK_D); the programs of
column block 0 also write their token's RoPE rows. Static shapes, no host sync (CUDA-graph safe).
Interpreter note: loads are converted to fp32 before any arithmetic; it has no libdevice (LIBDEVICE off: tl.cos / tl.sin,
numpy's there).
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()
from triton.language.extra import libdevice  # noqa: E402  (after import_triton: its install hint first)


@triton.jit
def _step_inputs_kernel(
    table_ptr,
    ids_ptr,
    pos_ptr,
    inv_ptr,
    factor_ptr,
    streams_ptr,
    rope_ptr,
    T,
    D,
    HC,
    HALF,
    stride_tab,
    stride_st,
    stride_sh,
    HC_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_ROPES: tl.constexpr,
    HALF_P: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr,
):
    tl_pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = cols < D
    row = tl.load(table_ptr + tok * stride_tab + cols, mask=dmask, other=0.0)
    h = tl.arange(0, HC_P)
    vals = tl.broadcast_to(row.to(streams_ptr.dtype.element_ty)[None, :], (HC_P, BLOCK_D))
    tl.store(
        streams_ptr + t * stride_st + h[:, None] * stride_sh + cols[None, :],
        vals,
        mask=(h < HC)[:, None] & dmask[None, :],
    )
    if tl.program_id(1) == 0:
        j = tl.arange(0, HALF_P)
        jmask = j < HALF
        p = tl.load(pos_ptr + t).to(tl.float32)
        for r in tl.static_range(N_ROPES):
            freqs = p * tl.load(inv_ptr + r * HALF + j, mask=jmask, other=0.0)
            factor = tl.load(factor_ptr + r)
            out = rope_ptr + (r * 2 * T + t) * HALF + j  # [r, 0 (cos) | 1 (sin), t, j]
            if LIBDEVICE:
                cos, sin = libdevice.cos(freqs), libdevice.sin(freqs)
            else:  # the interpreter has no libdevice; its tl.cos / tl.sin are numpy's (precise too)
                cos, sin = tl.cos(freqs), tl.sin(freqs)
            tl.store(out, cos * factor, mask=jmask)
            tl.store(out + T * HALF, sin * factor, mask=jmask)


def step_inputs(
    table: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    hc: int,
    streams_dtype: torch.dtype,
    inv_freq: torch.Tensor,
    factors: torch.Tensor,
    *,
    block_d: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """table: [V, D] (unit last stride); token_ids, positions: int [T]; inv_freq: fp32 [R, half]; factors: fp32 [R]
    -> (streams [T, hc, D] in streams_dtype, fp32 cos_sin [R, 2, T, half]: cos_sin[r, 0] / [r, 1] are RoPE r's
    cos / sin at the positions, contiguous [T, half] views). Token ids are not bounds-checked (no host sync)."""
    if table.dim() != 2 or table.stride(-1) != 1:
        raise ValueError(f"table must be [V, D] with a unit last stride, got {tuple(table.shape)}")
    t = token_ids.shape[0]
    if token_ids.dim() != 1 or positions.shape != (t,):
        raise ValueError(
            f"token_ids and positions must both be [T], got {tuple(token_ids.shape)}, {tuple(positions.shape)}"
        )
    if inv_freq.dim() != 2 or factors.shape != (inv_freq.shape[0],):
        raise ValueError(
            f"inv_freq must be [R, half] and factors [R], got {tuple(inv_freq.shape)}, {tuple(factors.shape)}"
        )
    require_triton(table.device)
    d = table.shape[1]
    n_ropes, half = inv_freq.shape
    streams = torch.empty(t, hc, d, dtype=streams_dtype, device=table.device)
    cos_sin = torch.empty(n_ropes, 2, t, half, dtype=torch.float32, device=table.device)
    if t == 0:
        return streams, cos_sin
    block_d = min(block_d, triton.next_power_of_2(d))
    _step_inputs_kernel[(t, triton.cdiv(d, block_d))](
        table,
        token_ids,
        positions,
        inv_freq.float().contiguous(),
        factors.float().contiguous(),
        streams,
        cos_sin,
        t,
        d,
        hc,
        half,
        table.stride(0),
        streams.stride(0),
        streams.stride(1),
        HC_P=triton.next_power_of_2(hc),
        BLOCK_D=block_d,
        N_ROPES=n_ropes,
        HALF_P=triton.next_power_of_2(half),
        LIBDEVICE=table.is_cuda,
        **({"num_warps": 4} if table.is_cuda else {}),
        **pdl_kwargs(table),
    )
    return streams, cos_sin
