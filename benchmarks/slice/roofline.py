"""Bytes a decode step must read and FLOPs a prefill must do: the numerators of the rooflines.

Two byte counts for a decode step:
- production format: dense FP8 (+ UE8M0 block scales) or bf16 where the release keeps bf16 (compressor,
  router, indexer weights_proj, embed rows, head), fp32 mHC/norm tensors, MXFP4 experts actually touched
  by the step's routing, caches as fp8_ds_mla (584 B a row) and MXFP4 indexer keys (68 B a row) per
  dsv4_kernels/geometry.py: per request and layer the SWA window (127 rows), on CSA layers all visible indexer
  keys + the top-512 entries, on HCA all entries;
- engine format: the same rows and tensors as the engine stores them: bf16 dense weights (FP8 + scales when
  the engine keeps them FP8), bf16 cache rows, and the touched routed experts as MXFP4 when the engine keeps
  them packed (bf16 otherwise).
"""

from __future__ import annotations

import math
import re

from engine.loading.make_model import _FP8, _MXFP4
from engine.loading.weights import expected_weight_shapes, keeps_fp32
from engine.model.config import ModelConfig


def _numel(shape) -> int:
    return math.prod(shape)


def kv_row_bytes(cfg: ModelConfig, fmt: str) -> int:
    """fp8_ds_mla: nope e4m3 + rope bf16 + one UE8M0 per 64 nope values + 1 pad byte (584 B for V4)."""
    if fmt == "engine":
        return cfg.head_dim * 2
    nope = cfg.head_dim - cfg.rope_dim
    return nope + 2 * cfg.rope_dim + math.ceil(nope / 64) + 1


def index_row_bytes(cfg: ModelConfig, fmt: str) -> int:
    """fmt "prod" / "mxfp4": packed e2m1 + one UE8M0 per 32 values (68 B for 128); "fp8": e4m3 + one fp32 scale
    (132 B); "engine": bf16."""
    if fmt == "engine":
        return cfg.index_head_dim * 2
    if fmt == "fp8":
        return cfg.index_head_dim + 4
    return cfg.index_head_dim // 2 + math.ceil(cfg.index_head_dim / 32)


def check_geometry(cfg: ModelConfig) -> None:
    """Cross-check the row sizes above with dsv4_kernels/geometry.py (only valid for V4-like widths)."""
    from dsv4_kernels.geometry import Fp8DsMlaLayout, IndexerKeyLayout

    assert kv_row_bytes(cfg, "prod") == Fp8DsMlaLayout(cfg.head_dim, cfg.rope_dim).row_bytes
    assert index_row_bytes(cfg, "prod") == IndexerKeyLayout(cfg.index_head_dim, "mxfp4").row_bytes
    assert index_row_bytes(cfg, "fp8") == IndexerKeyLayout(cfg.index_head_dim, "fp8").row_bytes


def expert_bytes(cfg: ModelConfig, fmt: str, packed: bool = False) -> int:
    """One routed expert's bytes (w1 + w2 + w3): MXFP4 in the production format or when the engine keeps
    them packed (`packed`), else bf16."""
    n = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    return n * 2 if fmt == "engine" and not packed else n // 2 + n // 32  # MXFP4: 4-bit values + UE8M0 per 32


def weight_bytes(
    cfg: ModelConfig, batch: int, touched: list[float], fmt: str, packed: bool = False, fp8_dense: bool = False
) -> float:
    """Bytes of weights a decode step of `batch` tokens must read; touched[i] = distinct experts on layer i;
    `packed`: the engine keeps its routed experts as MXFP4 (only changes the engine format)."""
    total = 0.0
    for name, shape in expected_weight_shapes(cfg).items():
        n = _numel(shape)
        if _MXFP4.search(name):
            continue
        if name == "embed.weight":
            total += batch * cfg.hidden_size * 2  # only the batch's rows
        elif name.endswith("gate.tid2eid"):
            total += batch * cfg.num_experts_per_tok * (8 if fmt == "engine" else 4)
        elif keeps_fp32(name) or (packed and fmt == "engine" and name.endswith("ffn.gate.weight")):
            total += 4 * n  # (the packed path's fused router reads an fp32 copy of the gate)
        elif _FP8.search(name) and (fmt != "engine" or fp8_dense):
            total += n + math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
        else:
            total += 2 * n
    return total + sum(touched) * expert_bytes(cfg, fmt, packed)


def cache_bytes(cfg: ModelConfig, ctx: int, fmt: str, index_fmt: str | None = None) -> float:
    """Cache bytes one request's decode token at position ctx must read, all layers (index_fmt: the indexer
    keys' format when it differs from fmt's, e.g. FP8 keys in a production-format cache)."""
    kv, idx = kv_row_bytes(cfg, fmt), index_row_bytes(cfg, index_fmt or fmt)
    total = 0

    def visible(r: int) -> int:  # entries closed before the query (incl. its own window)
        return (ctx + 1) // r

    for r in cfg.compress_ratios:
        total += min(ctx, cfg.sliding_window - 1) * kv  # the query's own row comes from the step
        if r == 4:
            total += visible(4) * idx + min(cfg.index_topk, visible(4)) * kv
        elif r > 1:
            total += visible(r) * kv
    return total


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """FLOPs a prefill of positions [0, tokens) must do: every 2-D projection of each layer (attention,
    compressors, indexer, router, mHC mixes, shared expert) + top-k routed experts per token, attention
    over the SWA window + selected / visible compressed entries (QK and PV), indexer scores over all
    visible keys, and the LM head for the one sampled row."""
    per_layer_dense = [0] * cfg.num_layers
    for name, shape in expected_weight_shapes(cfg).items():
        m = re.match(r"layers\.(\d+)\.", name)
        if not m or len(shape) != 2 or name.endswith(("tid2eid", ".ape")) or _MXFP4.search(name):
            continue
        per_layer_dense[int(m.group(1))] += 2 * _numel(shape)
    routed = cfg.num_experts_per_tok * 2 * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    total = float(tokens * (sum(per_layer_dense) + cfg.num_layers * routed) + 2 * cfg.vocab_size * cfg.hidden_size)
    attn = 4 * cfg.num_heads * cfg.head_dim
    for pos in range(tokens):
        for r in cfg.compress_ratios:
            keys = min(pos + 1, cfg.sliding_window)
            if r == 4:
                vis = (pos + 1) // 4
                keys += min(cfg.index_topk, vis)
                total += 2 * cfg.index_n_heads * cfg.index_head_dim * vis
            elif r > 1:
                keys += (pos + 1) // r
            total += attn * keys
    return total


def decode_figures(
    cfg: ModelConfig,
    batch: int,
    ctx: int,
    step_s: float,
    touched: list[float],
    copy_gbs: float,
    packed: bool,
    fp8_dense: bool = False,
    fp8_cache: bool = False,
    index_fmt: str = "mxfp4",
) -> dict:
    """A decode step's time against both byte rooflines -> the decode table's figures (`packed`: the
    engine keeps routed experts as MXFP4; `fp8_cache`: its KV cache holds the production formats (fp8_ds_mla
    rows, indexer keys as `index_fmt`: "mxfp4" / "fp8"), else bf16 rows; touched = mean distinct experts per
    layer)."""
    prod = weight_bytes(cfg, batch, touched, "prod") + batch * cache_bytes(cfg, ctx, "prod")
    eng = weight_bytes(cfg, batch, touched, "engine", packed, fp8_dense) + batch * cache_bytes(
        cfg, ctx, "prod" if fp8_cache else "engine", index_fmt if fp8_cache else None
    )
    bw = copy_gbs * 1e9
    return {
        "step_ms": step_s * 1e3,
        "tok_s": batch / step_s,
        "touched": sum(touched) / len(touched),
        "prod_gb": prod / 1e9,
        "prod_roof_ms": prod / bw * 1e3,
        "x_prod": step_s / (prod / bw),
        "eng_gb": eng / 1e9,
        "eng_roof_ms": eng / bw * 1e3,
        "x_eng": step_s / (eng / bw),
    }


def prefill_figures(cfg: ModelConfig, tokens: int, seconds: float, tflops: float) -> dict:
    """A prefill's time against the FLOP roofline -> the prefill table's figures."""
    flops = prefill_flops(cfg, tokens)
    roof_s = flops / (tflops * 1e12)
    return {
        "tokens": tokens,
        "s": seconds,
        "tok_s": tokens / seconds,
        "tflop": flops / 1e12,
        "roof_tok_s": tokens / roof_s,
        "share": roof_s / seconds,
    }
