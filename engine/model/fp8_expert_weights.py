"""A prefill engine's routed experts as FP8 128x128 (dsv4_kernels.fp8_experts), converted from the loaded MXFP4 bytes
before the model is built, so the KV pool is planned with the FP8 bytes already resident.

`convert_expert_weights(weights, cfg, fmt)` works one layer at a time on the loaded dict (this rank's experts,
already cut by tensor / expert parallelism): the layer's packed `layers.L.ffn.experts.E.wN.weight` / `.scale`
become four stacked entries `layers.L.ffn.experts.fp8_{w13,s13,w2,s2}`; with fmt "fp8" the packed bytes are
dropped (a prefill-only engine holds FP8 alone: 2x the MXFP4 bytes), with "both" they stay (decode-sized steps keep
the MXFP4 backend). `take_fp8_experts` pops the four entries back as one Fp8Experts for engine.model.moe.MoEBlock.
Only the main layers convert; the MTP layer (decode drafts) keeps its format.
"""

from __future__ import annotations

import logging
import re

import torch

from dsv4_kernels.fp8_experts import Fp8Experts, from_packed
from dsv4_kernels.mxfp4_fp8 import BLOCK, ConversionReport
from engine.model.config import ModelConfig

log = logging.getLogger("dsv4.engine")
FORMATS = ("mxfp4", "fp8", "both")  # resolved formats (engine.model.fast_paths.resolve_prefill_expert_format)
_KEYS = ("fp8_w13", "fp8_s13", "fp8_w2", "fp8_s2")
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.w1\.weight$")


def _layer_experts(weights: dict) -> dict[int, list[int]]:
    """{layer: sorted expert ids held as packed MXFP4 bytes}."""
    found: dict[int, list[int]] = {}
    for name, t in weights.items():
        m = _EXPERT.match(name)
        if m and t.dtype == torch.uint8 and name[: -len(".weight")] + ".scale" in weights:
            found.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return {layer: sorted(ids) for layer, ids in found.items()}


def convert_expert_weights(weights: dict, cfg: ModelConfig, fmt: str, pow2_act: bool = True) -> ConversionReport:
    """In place: each layer's packed MXFP4 experts -> FP8 entries (module docstring). fmt: "fp8" or "both"
    ("mxfp4" converts nothing). -> the precision report over every converted tensor (also logged)."""
    if fmt not in FORMATS:
        raise ValueError(f"expert format must be one of {FORMATS}, got {fmt!r}")
    report = ConversionReport()
    if fmt == "mxfp4":
        return report
    for layer, ids in sorted(_layer_experts(weights).items()):
        p = f"layers.{layer}.ffn.experts."
        names = {w: [f"{p}{e}.{w}.weight" for e in ids] for w in ("w1", "w2", "w3")}
        if any(weights[n].shape[0] % BLOCK or 2 * weights[n].shape[1] % BLOCK for ns in names.values() for n in ns):
            raise ValueError(
                f"FP8 experts need 128-aligned expert shapes; layer {layer}'s are "
                f"{tuple(weights[names['w1'][0]].shape)} bytes (try prefill_expert_format='mxfp4')"
            )
        parts = {}
        for w in ("w1", "w2", "w3"):
            parts[w] = torch.stack([weights[n] for n in names[w]])
            parts["s" + w[1]] = torch.stack([_scale_bytes(weights[n[: -len(".weight")] + ".scale"]) for n in names[w]])
        ex = from_packed(
            parts["w1"],
            parts["s1"],
            parts["w2"],
            parts["s2"],
            parts["w3"],
            parts["s3"],
            report,
            f"layer {layer} ",
            pow2_act,
        )
        del parts
        for key, t in zip(_KEYS, (ex.w13, ex.s13, ex.w2, ex.s2)):
            weights[p + key] = t
        if fmt == "fp8":
            for n in (n for ns in names.values() for n in ns):
                weights.pop(n)
                weights.pop(n[: -len(".weight")] + ".scale")
    log.info("%s", report.describe())
    return report


def _scale_bytes(s: torch.Tensor) -> torch.Tensor:
    return s if s.dtype == torch.uint8 else s.view(torch.uint8)


def take_fp8_experts(weights: dict, prefix: str, pow2_act: bool = True) -> Fp8Experts | None:
    """Pop `{prefix}experts.fp8_*` (a converted layer) -> Fp8Experts, or None when the layer was not converted."""
    keys = [f"{prefix}experts.{k}" for k in _KEYS]
    if keys[0] not in weights:
        return None
    w13, s13, w2, s2 = (weights.pop(k) for k in keys)
    return Fp8Experts(w13=w13, s13=s13, w2=w2, s2=s2, pow2_act=pow2_act)


def has_packed_experts(weights: dict, prefix: str, first_expert: int) -> bool:
    """Are the layer's MXFP4 experts still in the dict (fmt "both", or never converted)?"""
    return f"{prefix}experts.{first_expert}.w1.weight" in weights
