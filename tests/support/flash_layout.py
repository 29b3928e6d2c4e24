"""V4-Flash's checkpoint layout as released (names, shapes, formats; no data): for the fit check's numbers."""

from __future__ import annotations

import re

from engine.loading.weights import expected_weight_shapes
from engine.model.config import ModelConfig
from engine.model.linear import keeps_fp8


def flash_release_layout(cfg: ModelConfig) -> dict:
    """{name: (safetensors dtype, stored shape)}: MXFP4 routed experts (e2m1 bytes + UE8M0 scales), FP8 dense
    projections with 128x128 block scales, everything else bf16 (as engine.loading.fit_check.stored_tensors reads)."""
    stored = {}
    for name, shape in expected_weight_shapes(cfg).items():
        base = name[: -len(".weight")]
        if re.search(r"\.experts\.\d+\.", name):
            stored[name] = ("I8", (shape[0], shape[1] // 2))
            stored[base + ".scale"] = ("U8", (shape[0], shape[1] // 32))
        elif name.endswith(".weight") and keeps_fp8(name, shape, cfg.o_groups):
            stored[name] = ("F8_E4M3", shape)
            stored[base + ".scale"] = ("U8", (-(-shape[0] // 128), -(-shape[1] // 128)))
        else:
            stored[name] = ("BF16", shape)
    return stored
