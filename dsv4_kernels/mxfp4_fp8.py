"""MXFP4 expert weights -> FP8 e4m3 with 128x128 block scales (the prefill engine's expert format, converted at load).

The checkpoint stores a routed expert's W [N, K] as e2m1 values times one UE8M0 scale 2^e per 32 elements along K
(dsv4_kernels.quant.dequant_mxfp4). DeepGEMM's grouped FP8 GEMM reads e4m3 values times one fp32 scale per 128x128
block. The conversion dequantises each block exactly (fp32 holds every e2m1 x 2^e), picks the block scale the way
the checkpoint's own FP8 weights are scaled (dsv4_kernels.quant.quant_fp8_block, scale_fmt "ue8m0": the smallest
power of two S with amax / S <= 448, so nothing saturates) and rounds W / S to e4m3 (round to nearest even).

When is it exact? e2m1 magnitudes {0.5, 1, 1.5, 2, 3, 4, 6} have at most two significant bits, and dividing by a
power of two keeps them; e4m3 holds every such value from 2^-9 (its smallest subnormal, with 1.5 x 2^-8 the
smallest 1.5-type value) up to 448. The block's largest element lands in (224, 448], so log2 S <= e_max - 6 where
2^e_max is the largest 32-group scale in the block, and an element of a group with scale 2^e lands at >= 2^(e - 1 -
log2 S) in steps of that size. Hence: **the conversion is exact whenever the UE8M0 exponents of the block's 32-groups
that hold a nonzero value span at most 14** (e_max - e_min <= 14: the block's scale range fits e4m3's range). Past
that, the smallest groups' values fall below e4m3's subnormal step and are rounded: the error of one element is at
most half that step, 2^-10 x S, i.e. below 2^-10 / 224 ~ 4.4e-6 of the block's largest magnitude. Trained
checkpoints' expert scales follow the weight magnitudes and rarely span 14 binades within a 128x128 block;
`ConversionReport` measures it on every converted tensor (exact compare against the dequantised MXFP4) and the
engine logs the worst case at load.

Storage doubles: 1 byte a weight (+ 4 bytes a 128x128 block) against MXFP4's 0.5 (+ 1 byte per 32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_kernels.quant import FP8_MAX, dequant_mxfp4

BLOCK = 128
EXACT_SPAN = 14  # block exponent span (binades) up to which the conversion is exact (module docstring)
CHUNK = 8  # experts converted at once: the fp32 intermediate of 8 V4-Flash experts is 8 x 2048 x 4096 x 4 B = 268 MB


@dataclass
class ConversionReport:
    """What converting some tensors cost in precision (accumulated over calls of `convert`)."""

    tensors: int = 0
    blocks: int = 0
    inexact_blocks: int = 0  # blocks with at least one element that did not convert exactly
    wide_blocks: int = 0  # blocks whose 32-group exponents span more than EXACT_SPAN (may be inexact)
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0  # max |error| / the amax of the element's block
    worst: list[str] = field(default_factory=list)  # names of tensors with an inexact block (first few)

    @property
    def exact(self) -> bool:
        return self.inexact_blocks == 0

    def describe(self) -> str:
        head = (
            f"MXFP4 -> FP8 128x128 experts: {self.tensors} tensors, {self.blocks} blocks, "
            f"{self.inexact_blocks} inexact ({self.wide_blocks} with a scale span > {EXACT_SPAN} binades)"
        )
        if self.exact:
            return head + ": exact"
        return (
            head
            + f"; worst error {self.max_abs_err:.3g} absolute, {self.max_rel_err:.3g} of its block's amax"
            + (f" (in {', '.join(self.worst)})" if self.worst else "")
        )


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[C, N, K] -> [C, N/128, K/128, 128, 128] view-like copy (N and K whole blocks)."""
    c, n, k = x.shape
    return x.view(c, n // BLOCK, BLOCK, k // BLOCK, BLOCK).transpose(2, 3)


def _block_scale(amax: torch.Tensor) -> torch.Tensor:
    """Block amax -> the smallest power of two S with amax / S <= 448 (1 for an all-zero block), exact on exponents."""
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(s)))


def _convert_chunk(w: torch.Tensor, s: torch.Tensor, report: ConversionReport | None, name: str):
    """uint8 [C, N, K/2] + UE8M0 [C, N, K/32] -> (e4m3 [C, N, K], fp32 [C, N/128, K/128])."""
    dense = dequant_mxfp4(w, s)  # fp32 [C, N, K], exact
    blocks = _blocks(dense)
    amax = blocks.abs().amax(dim=(-1, -2))  # [C, N/128, K/128]
    scale = _block_scale(amax)
    full = scale.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    q = (dense / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if report is not None:
        _measure(report, dense, q, full, amax, s, name)
    return q, scale


def _measure(report: ConversionReport, dense, q, full, amax, s, name: str) -> None:
    err = (q.float() * full - dense).abs()
    block_err = _blocks(err).amax(dim=(-1, -2))  # [C, N/128, K/128]
    rel = block_err / amax.clamp_min(torch.finfo(torch.float32).tiny)
    # exponent span over the 32-groups that hold a nonzero value
    nonzero = _groups_nonzero(dense)
    e = s.view(torch.uint8).to(torch.int32) if s.dtype != torch.uint8 else s.to(torch.int32)
    hi = torch.where(nonzero, e, -1)
    lo = torch.where(nonzero, e, 1 << 20)
    c, n, g = e.shape
    per = BLOCK // 32
    hi = hi.view(c, n // BLOCK, BLOCK, g // per, per).amax(dim=(2, 4))
    lo = lo.view(c, n // BLOCK, BLOCK, g // per, per).amin(dim=(2, 4))
    report.blocks += amax.numel()
    inexact = int((block_err > 0).sum())
    report.inexact_blocks += inexact
    report.wide_blocks += int(((hi - lo) > EXACT_SPAN).sum())
    report.max_abs_err = max(report.max_abs_err, float(block_err.max()) if block_err.numel() else 0.0)
    report.max_rel_err = max(report.max_rel_err, float(rel.max()) if rel.numel() else 0.0)
    if inexact and len(report.worst) < 4:
        report.worst.append(name)


def _groups_nonzero(dense: torch.Tensor) -> torch.Tensor:
    """[C, N, K] -> bool [C, N, K/32]: the 32-group holds a nonzero value."""
    c, n, k = dense.shape
    return dense.view(c, n, k // 32, 32).ne(0).any(-1)


def convert(
    w: torch.Tensor, s: torch.Tensor, report: ConversionReport | None = None, name: str = "", chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked MXFP4 experts -> FP8 128x128 block-scaled, on w's device, `chunk` experts at a time.

    w: uint8 [E, N, K/2] (low nibble = even element); s: UE8M0 [E, N, K/32] (uint8 or float8_e8m0fnu); N, K whole
    128-blocks. -> (float8_e4m3fn [E, N, K], fp32 [E, N/128, K/128]). report: accumulates the precision figures."""
    if w.dim() != 3 or s.dim() != 3:
        raise ValueError(
            f"convert takes stacked experts [E, N, K/2] and [E, N, K/32], got {tuple(w.shape)}, {tuple(s.shape)}"
        )
    e, n, half = w.shape
    k = 2 * half
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"FP8 128x128 experts need N and K in whole 128-blocks, got N={n}, K={k}")
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(e, n // BLOCK, k // BLOCK, dtype=torch.float32, device=w.device)
    if report is not None:
        report.tensors += 1
    for e0 in range(0, e, chunk):
        q[e0 : e0 + chunk], scale[e0 : e0 + chunk] = _convert_chunk(
            w[e0 : e0 + chunk], s[e0 : e0 + chunk], report, name
        )
    return q, scale


def dequant(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(e4m3 [..., N, K], fp32 [..., N/128, K/128]) -> [..., N, K] in dtype."""
    full = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return (q.to(torch.float32) * full).to(dtype)
