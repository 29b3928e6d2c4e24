"""The engine's dense projections: a plain weight tensor, or an FP8 checkpoint weight kept as e4m3 + scales.

`load_weights(..., keep_fp8=True)` hands FP8 projections over as `X.weight` (float8_e4m3fn [N, K]) plus
`X.scale` (fp32 [N/128, K/128]); `take_fp8_weights` folds each pair into a dsv4_kernels.fp8_linear.Fp8Weight
and `linear` multiplies with whichever it gets:
- a tensor: x @ W^T in the engine dtype (the CPU path and CI, unchanged);
- an Fp8Weight on CUDA with `use_fp8_gemm`: activations quantised per token (1x128) and DeepGEMM's FP8
  GEMM (dsv4_kernels.deepgemm_linear); otherwise its plain-torch reference (same function, slow; tests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dsv4_kernels.fp8_linear import Fp8Weight, fp8_linear_ref
from dsv4_kernels.norm import rms_norm
from dsv4_kernels.rope import InverseRope
from engine.model.fast_paths import use_fp8_gemm, use_triton

Weight = torch.Tensor | Fp8Weight
# The projections that go through `linear` / `grouped_projection` (the release stores them FP8).
FP8_LINEAR = re.compile(r"\.attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$")


def keeps_fp8(name: str, shape: tuple[int, ...], o_groups: int) -> bool:
    """Can projection `name` of logical `shape` stay FP8 in memory? Whole 128-blocks only (wo_a per group)."""
    if not FP8_LINEAR.search(name) or len(shape) != 2:
        return False
    n, k = shape
    rows = n // o_groups if name.endswith("wo_a.weight") else n
    return n % 128 == 0 and k % 128 == 0 and rows % 128 == 0


def pow2_activations(quantization: dict) -> bool:
    """Activations of FP8 projections get power-of-two scales when the checkpoint's scales are UE8M0 (V4's)."""
    return str(quantization.get("scale_fmt", "ue8m0")).lower() == "ue8m0"


def take_fp8_weights(weights: dict, pow2_act: bool = True) -> dict:
    """Replace each `X.weight` e4m3 tensor with a `X.scale` companion by one Fp8Weight (scale popped)."""
    out = dict(weights)
    for name in [n for n, t in weights.items() if n.endswith(".weight") and t.dtype == torch.float8_e4m3fn]:
        scale = out.pop(name[: -len(".weight")] + ".scale", None)
        if scale is None:
            raise ValueError(f"FP8 weight {name} has no .scale companion")
        out[name] = Fp8Weight(weights[name], scale, pow2_act)
    return out


def _fast(x: torch.Tensor, w: Fp8Weight) -> bool:
    return _fast_on(x.device, x.dtype, w)


def _fast_on(device: torch.device, dtype: torch.dtype, w: Fp8Weight) -> bool:
    """Does w run DeepGEMM's FP8 GEMM on activations of `dtype` on `device`?"""
    if not (device.type == "cuda" and dtype == torch.bfloat16 and use_fp8_gemm(device, dtype)):
        return False
    from dsv4_kernels.deepgemm_linear import supported

    return supported(w)


def shared_quant_pow2(device: torch.device, dtype: torch.dtype, *ws: Weight | None) -> bool | None:
    """When every w in `ws` (at least one) runs DeepGEMM's FP8 GEMM on 2-D activations of `dtype` on `device` with
    the same activation scales, their pow2 flag: one 1x128 quantisation of the input can feed them all
    (`linear_from`); else None."""
    fp8 = [w for w in ws if isinstance(w, Fp8Weight) and _fast_on(device, dtype, w)]
    if not ws or len(fp8) != len(ws) or len({w.pow2_act for w in fp8}) != 1:
        return None
    return fp8[0].pow2_act


def uses_fp8_gemm(x: torch.Tensor, w: Weight) -> bool:
    """Does `linear(x, w)` run DeepGEMM's FP8 GEMM (an Fp8Weight with the fast path on for x)?"""
    return isinstance(w, Fp8Weight) and _fast(x, w)


def can_concat_rows(a: Weight, b: Weight) -> bool:
    """Can `concat_rows(a, b)` stack these two (same kind, same K; FP8: a's rows whole 128-blocks, same scales)?"""
    if isinstance(a, Fp8Weight) and isinstance(b, Fp8Weight):
        return a.shape[1] == b.shape[1] and a.shape[0] % 128 == 0 and a.pow2_act == b.pow2_act
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape[1] == b.shape[1] and a.dtype == b.dtype and a.device == b.device
    return False


def concat_rows(a: Weight, b: Weight) -> Weight:
    """Two projections of the same input as one: [N1, K] and [N2, K] -> [N1 + N2, K] (an Fp8Weight's rows and
    scale rows stay aligned when N1 is whole 128-blocks), so one GEMM (and one activation quantisation) runs."""
    if isinstance(a, Fp8Weight) and isinstance(b, Fp8Weight):
        if a.shape[0] % 128 or a.shape[1] != b.shape[1] or a.pow2_act != b.pow2_act:
            raise ValueError(f"cannot stack FP8 weights {a.shape} and {b.shape} (rows in 128s, same K and scales)")
        return Fp8Weight(torch.cat([a.weight, b.weight]), torch.cat([a.scale, b.scale]), a.pow2_act)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.cat([a, b])
    raise ValueError("concat_rows needs two tensors or two Fp8Weight")


def split_rows(w: Weight, n: int) -> tuple[Weight, Weight]:
    """Views of rows [:n] and [n:] of a (concatenated) weight; for an Fp8Weight n is whole 128-blocks."""
    if isinstance(w, Fp8Weight):
        nb = n // 128
        return (Fp8Weight(w.weight[:n], w.scale[:nb], w.pow2_act), Fp8Weight(w.weight[n:], w.scale[nb:], w.pow2_act))
    return w[:n], w[n:]


@dataclass(frozen=True)
class QuantizedAct:
    """Activations already quantised per token in 1x128 FP8 blocks: e4m3 q [M, K], fp32 s [M, K/128] MN-major."""

    q: torch.Tensor
    s: torch.Tensor


def rms_norm_for(x: torch.Tensor, weight: torch.Tensor, eps: float, *ws: Weight):
    """RMSNorm of x [M, K] that feeds the projections `ws` -> (normed [M, K] in x.dtype, QuantizedAct or None).

    Where every w in `ws` runs DeepGEMM's FP8 GEMM, one Triton launch (dsv4_kernels.triton_norm_quant) norms and
    quantises, and each `linear_from(normed, qa, w)` then skips its own quantiser; elsewhere the plain norm."""
    pow2 = shared_quant_pow2(x.device, x.dtype, *ws) if x.dim() == 2 else None
    if pow2 is not None:
        from dsv4_kernels.triton_norm_quant import rms_norm_quant  # imports triton: only on this path

        normed, q, s = rms_norm_quant(x, weight, eps, pow2)
        return normed, QuantizedAct(q, s)
    return rms_norm(x, weight, eps), None


def linear_from(x: torch.Tensor, qa: QuantizedAct | None, w: Weight) -> torch.Tensor:
    """linear(x, w), reusing `qa` (x's quantisation from rms_norm_for) when given."""
    if qa is None or not isinstance(w, Fp8Weight):  # qa exists only for FP8 weights (rms_norm_for)
        return linear(x, w)
    from dsv4_kernels.deepgemm_linear import fp8_gemm_quantized  # imports deep_gemm: only on this path

    return fp8_gemm_quantized(qa.q, qa.s, w)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x: [..., K] -> [..., N] = x W^T, for W [N, K] as a tensor or an Fp8Weight."""
    if isinstance(w, torch.Tensor):
        return x @ w.t()
    if not _fast(x, w):
        return fp8_linear_ref(x, w)
    from dsv4_kernels.deepgemm_linear import fp8_gemm  # imports deep_gemm: only on this path

    n, k = w.shape
    lead = x.shape[:-1]
    return fp8_gemm(x.reshape(-1, k), w).view(*lead, n)


def grouped_projection(x: torch.Tensor, w: Weight, groups: int) -> torch.Tensor:
    """Block-diagonal projection: x [T, G, D] and W [G * R, D] -> [T, G * R] (group g through rows gR..gR+R)."""
    t = x.shape[0]
    if isinstance(w, torch.Tensor):
        wg = w.view(groups, -1, w.shape[-1]).transpose(1, 2)  # [G, D, R]
        return torch.bmm(x.transpose(0, 1), wg).transpose(0, 1).reshape(t, -1)
    if _fast(x, w) and x.stride(-1) == 1:
        from dsv4_kernels.deepgemm_linear import fp8_grouped_gemm

        # The quantiser reads the [G, T, D] view in place (no transposing copy) and writes contiguous groups.
        return fp8_grouped_gemm(x.transpose(0, 1), w, groups).transpose(0, 1).reshape(t, -1)
    xg = x.transpose(0, 1).contiguous()  # [G, T, D]
    r = w.shape[0] // groups
    rb = r // 128
    parts = [
        fp8_linear_ref(xg[i], Fp8Weight(w.weight[i * r : (i + 1) * r], w.scale[i * rb : (i + 1) * rb], w.pow2_act))
        for i in range(groups)
    ]
    return torch.stack(parts, dim=1).reshape(t, -1)


def grouped_then_linear(
    x: torch.Tensor, w_groups: Weight, groups: int, w_out: Weight, rope: InverseRope | None = None
) -> torch.Tensor:
    """linear(grouped_projection(rope.apply(x), w_groups, groups), w_out): x [T, G, D] -> [T, N] (V4's wo_b after
    wo_a; rope None: no rotation; x may be overwritten by it).

    Where both run DeepGEMM, the inverse rope rides in the grouped GEMM's activation quantiser (one launch fewer),
    and the grouped GEMM's per-group outputs [G, T, R] are quantised for w_out straight from its storage
    (dsv4_kernels.triton_fp8_quant.quant_act_1x128_joined), one launch instead of a transposing bf16 copy and a
    quantiser: the same codes and scales, so the same result."""
    fast = (
        isinstance(w_groups, Fp8Weight)
        and isinstance(w_out, Fp8Weight)
        and _fast(x, w_groups)
        and _fast(x, w_out)
        and x.stride(-1) == 1
        and (w_groups.shape[0] // groups) % 128 == 0
    )
    if not fast:
        if rope is not None:
            x = _turn_back(x, rope)
        return linear(grouped_projection(x, w_groups, groups), w_out)
    from dsv4_kernels.deepgemm_linear import fp8_gemm_quantized, fp8_grouped_gemm
    from dsv4_kernels.triton_fp8_quant import quant_act_1x128_joined

    assert isinstance(w_groups, Fp8Weight) and isinstance(w_out, Fp8Weight)  # for the type checker: `fast` says so
    y = fp8_grouped_gemm(x.transpose(0, 1), w_groups, groups, rope)  # [G, T, R]
    q, s = quant_act_1x128_joined(y, w_out.pow2_act)
    return fp8_gemm_quantized(q, s, w_out)


def _turn_back(x: torch.Tensor, rope: InverseRope) -> torch.Tensor:
    """rope.apply(x) for x [T, G, D]: in place in one launch with the Triton fast paths (only the rope channels
    move: dsv4_kernels.triton_norm_rope.rope), else the reference."""
    if use_triton(x.device) and x.is_contiguous():
        from dsv4_kernels.triton_norm_rope import rope as triton_rope  # imports triton: only on this path

        t = x.shape[0]
        triton_rope(x.view(t, -1, rope.head_dim), rope.cos, rope.sin, inverse=True, inplace=True)
        return x
    return rope.apply(x)
