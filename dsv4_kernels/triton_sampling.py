"""Triton per-row exponential noise for sampling: E[row, v] = -log(U), U from Philox keyed by the row's seed.

`engine.execution.sampling.sample` draws tokens by the exponential race argmax(p / E). On the CPU it draws U from one
torch generator per row; at V4's vocabulary that is ~8M host random numbers per step at batch 64 (~80 ms on
one core), far more than a decode step's GPU time. Here each row's U comes from `tl.rand(seed, v)` (Philox
4x32, counter = the vocabulary index), so a row's noise depends only on its draw seed, as on the CPU path
(same request seed and output index -> same draws, whatever else shares the batch), but the stream differs
from torch's CPU generator: engines on CUDA agree with each other, not with CPU engines.
"""

from __future__ import annotations

import torch

from dsv4_kernels.gpu import import_triton, require_triton
from dsv4_kernels.triton_pdl import pdl_kwargs, tl_pdl_wait

triton, tl = import_triton()

BLOCK = 1024


@triton.jit
def _exp_noise_kernel(seeds_ptr, out_ptr, V, stride_o, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    tl_pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    seed = tl.load(seeds_ptr + row)
    u = tl.rand(seed, cols)
    e = -tl.log(tl.maximum(u, 1e-20))
    tl.store(out_ptr + row * stride_o + cols, e, mask=cols < V)


def exp_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds: int64 [N] (draw seeds, < 2**63) -> fp32 [N, vocab] of Exp(1) noise, on seeds' device."""
    if seeds.dim() != 1 or seeds.dtype != torch.int64:
        raise ValueError(f"seeds must be int64 [N], got {seeds.dtype} {tuple(seeds.shape)}")
    require_triton(seeds.device)
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0] and vocab:
        _exp_noise_kernel[(seeds.shape[0], triton.cdiv(vocab, BLOCK))](
            seeds, out, vocab, out.stride(0), BLOCK_V=BLOCK, **pdl_kwargs(seeds)
        )
    return out
