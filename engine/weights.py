"""Checkpoint loading for DeepSeek V4: names, shapes, dequantisation.

Everything is keyed by the ORIGINAL DeepSeek tensor names (`embed.weight`, `layers.3.attn.wq_a.weight`,
...). Two on-disk spellings are accepted:
- DeepSeek's release (and `engine.make_model`): the original names, no prefix;
- transformers' `save_pretrained`: the same names under `model.` except `model.embed_tokens.weight`,
  `model.hc_head.hc_{fn,base,scale}` and an unprefixed `head.weight` (`lm_head.weight` is accepted too).
Quantised tensors carry a companion holding their scales: `X.scale` (DeepSeek) or `X.weight_scale_inv` /
`X.weight_scale` (transformers / other exporters), where `X.weight` is the quantised tensor:
- float8_e4m3fn weight [N, K] + block scales [ceil(N/128), ceil(K/128)] -> FP8 block dequant;
- int8/uint8 weight [N, K/2] (or float4_e2m1fn_x2) + UE8M0 scales [N, K/32] -> MXFP4 dequant.
The multi-token-prediction head (`mtp.*`) is not used by this engine and is skipped.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.linear import keeps_fp8, pow2_activations
from kernels.fp8_linear import weight_from_checkpoint
from kernels.quant import FP8_BLOCK, MXFP4_BLOCK, dequant_fp8_block, dequant_mxfp4, mxfp4_as_bytes

# Tensors that stay float32 whatever `dtype` is asked for: they are tiny and feed fp32 maths
# (RMSNorm weights, mHC mixing, attention sinks, compressor position biases, router bias).
_KEEP_FP32 = re.compile(r"(?:norm\.weight|attn_sink|\.ape|gate\.bias)$|^hc_head_|\.hc_(?:attn|ffn)_")
_INT_TENSORS = re.compile(r"\.tid2eid$")
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
# transformers' leaf names that differ from DeepSeek's (after the `model.` prefix is stripped).
_HF_RENAMES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".scale")
_SHOW = 8  # how many names an error message lists before summarising the rest


# ---- expected names and shapes --------------------------------------------------------------
def expected_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model (original DeepSeek names, mtp excluded) -> its logical shape.

    Quantised tensors are listed by their dequantised shape; `.scale` companions are not listed.
    """
    h, v, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    hd, nh, ql = cfg.head_dim, cfg.num_heads, cfg.q_lora_rank
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (v, h),
        "head.weight": (v, h),
        "norm.weight": (h,),
        "hc_head_fn": (hc, hc * h),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc*hc) mixing weights per token
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (h,)
        shapes[p + "ffn_norm.weight"] = (h,)
        for site in ("attn", "ffn"):
            shapes[f"{p}hc_{site}_fn"] = (mix, hc * h)
            shapes[f"{p}hc_{site}_base"] = (mix,)
            shapes[f"{p}hc_{site}_scale"] = (3,)
        a = p + "attn."
        shapes[a + "wq_a.weight"] = (ql, h)
        shapes[a + "q_norm.weight"] = (ql,)
        shapes[a + "wq_b.weight"] = (nh * hd, ql)
        shapes[a + "wkv.weight"] = (hd, h)
        shapes[a + "norm.weight"] = (hd,)
        shapes[a + "wo_a.weight"] = (cfg.o_groups * cfg.o_lora_rank, nh * hd // cfg.o_groups)
        shapes[a + "wo_b.weight"] = (h, cfg.o_groups * cfg.o_lora_rank)
        shapes[a + "attn_sink"] = (nh,)
        ratio = cfg.compress_ratios[i]
        if ratio > 1:
            coff = 2 if ratio == 4 else 1  # overlapping (ratio 4) windows carry two halves per token
            shapes[a + "compressor.wkv.weight"] = (coff * hd, h)
            shapes[a + "compressor.wgate.weight"] = (coff * hd, h)
            shapes[a + "compressor.ape"] = (ratio, coff * hd)
            shapes[a + "compressor.norm.weight"] = (hd,)
        if cfg.has_indexer(i):
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            shapes[a + "indexer.wq_b.weight"] = (ih * idim, ql)
            shapes[a + "indexer.weights_proj.weight"] = (ih, h)
            shapes[a + "indexer.compressor.wkv.weight"] = (2 * idim, h)
            shapes[a + "indexer.compressor.wgate.weight"] = (2 * idim, h)
            shapes[a + "indexer.compressor.ape"] = (4, 2 * idim)
            shapes[a + "indexer.compressor.norm.weight"] = (idim,)
        f = p + "ffn."
        shapes[f + "gate.weight"] = (e, h)
        if cfg.hash_layers[i]:
            shapes[f + "gate.tid2eid"] = (v, cfg.num_experts_per_tok)
        else:
            shapes[f + "gate.bias"] = (e,)
        for j in range(e):
            shapes[f"{f}experts.{j}.w1.weight"] = (inter, h)
            shapes[f"{f}experts.{j}.w2.weight"] = (h, inter)
            shapes[f"{f}experts.{j}.w3.weight"] = (inter, h)
        shared = inter * cfg.n_shared_experts
        if shared:
            shapes[f + "shared_experts.w1.weight"] = (shared, h)
            shapes[f + "shared_experts.w2.weight"] = (h, shared)
            shapes[f + "shared_experts.w3.weight"] = (shared, h)
    return shapes


def keeps_fp32(name: str) -> bool:
    """True for tensors `load_weights` returns in float32 regardless of the requested dtype."""
    return bool(_KEEP_FP32.search(name))


def canonical_name(raw: str) -> str | None:
    """On-disk tensor name -> original DeepSeek name (scale companions end in `.scale`); None for mtp."""
    name = raw[len("model.") :] if raw.startswith("model.") else raw
    if name.startswith("mtp."):
        return None
    name = _HF_RENAMES.get(name, name)
    for suffix in _SCALE_SUFFIXES[:2]:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".scale"
    return name


# ---- checkpoint discovery --------------------------------------------------------------------
def checkpoint_files(model_dir: str | os.PathLike) -> list[str]:
    """The safetensors files of a model dir: the index's shards, else model.safetensors, else *.safetensors."""
    d = os.fspath(model_dir)
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map") or {}
        files = sorted({os.path.join(d, f) for f in weight_map.values()})
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {absent}")
        if files:
            return files
    single = os.path.join(d, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(glob.glob(os.path.join(d, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {d!r}")
    return files


@dataclass
class _Entry:
    raw: str  # name inside the file
    handle: object  # open safe_open handle holding it
    dtype: str  # safetensors dtype string ("F32", "F8_E4M3", "I8", "F4", ...)
    shape: tuple[int, ...]  # as recorded by safetensors (F4 records unpacked elements)


def _summarise(title: str, items: list[str]) -> str:
    shown = ", ".join(items[:_SHOW])
    more = f" ... and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return f"{len(items)} {title}: {shown}{more}"


def _quant_kind(name: str, w: _Entry, s: _Entry, want: tuple[int, ...], block: tuple[int, int]) -> str | None:
    """Which dequantiser fits weight `w` + scale `s` for logical shape `want`; None when shapes disagree."""
    if len(want) != 2:
        return None
    n, k = want
    fp8_scale = (math.ceil(n / block[0]), math.ceil(k / block[1]))
    # FP8 stored typed, or as raw bytes with the full logical shape.
    if w.dtype == "F8_E4M3" or (w.dtype in ("U8", "I8") and w.shape == want):
        return "fp8" if w.shape == want and s.shape == fp8_scale else None
    mx_scale = (n, k // MXFP4_BLOCK) if k % MXFP4_BLOCK == 0 else None
    if w.dtype == "F4":  # safetensors records float4_e2m1fn_x2 by element count
        return "mxfp4" if w.shape == want and s.shape == mx_scale else None
    if w.dtype in ("U8", "I8"):
        return "mxfp4" if w.shape == (n, k // 2) and s.shape == mx_scale else None
    return None


def load_weights(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    keep_mxfp4_experts: bool = False,
    keep_fp8: bool = False,
    skip: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Read, check and dequantise a checkpoint -> {original name: tensor on `device`}.

    Floating tensors come back in `dtype` except `keeps_fp32` ones (float32); `gate.tid2eid` as int64.
    Shapes are those of `expected_weight_shapes(cfg)`, except with `keep_mxfp4_experts`: MXFP4 routed
    experts (`layers.N.ffn.experts.E.w{1,2,3}.weight`) then stay packed, uint8 e2m1 bytes [N, K/2] plus
    a `...w1.scale` uint8 UE8M0 tensor [N, K/32], for kernels that dequantise in registers (a quarter of
    the bf16 bytes); experts stored in bf16/FP8 are unaffected. With `keep_fp8`, FP8 dense projections that
    `engine.linear.keeps_fp8` accepts stay as stored: float8_e4m3fn [N, K] plus `X.scale` fp32 block scales
    [N/128, K/128] (UE8M0 bytes converted exactly), for the FP8 GEMM path (no bf16 copy). Every problem
    (missing, unexpected or mis-shaped tensors, scales without weights, quantised bytes without scales) is collected first and reported in
    one ValueError, before any tensor data is read. `skip(name)` True: that tensor (and its scale) is checked
    but never read nor returned.
    """
    expected = expected_weight_shapes(cfg)
    block = tuple(cfg.quantization.get("weight_block_size") or FP8_BLOCK)
    with contextlib.ExitStack() as stack:
        # Pass 1: headers only (safe_open reads the JSON header; data is read on get_tensor).
        weights: dict[str, _Entry] = {}
        scales: dict[str, _Entry] = {}
        duplicates: list[str] = []
        for path in checkpoint_files(model_dir):
            handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for raw in handle.keys():
                name = canonical_name(raw)
                if name is None:
                    continue
                sl = handle.get_slice(raw)
                entry = _Entry(raw, handle, sl.get_dtype(), tuple(sl.get_shape()))
                table, key = (scales, name[: -len(".scale")]) if name.endswith(".scale") else (weights, name)
                if key in table:
                    duplicates.append(name)
                table[key] = entry

        problems: list[str] = []
        missing = [n for n in expected if n not in weights]
        unexpected = [n for n in weights if n not in expected]
        unexpected += [f"{n}.scale" for n in scales if f"{n}.weight" not in expected]
        misshaped: list[str] = []
        plan: dict[str, str | None] = {}  # name -> None (plain) / "fp8" / "mxfp4"
        for name, entry in weights.items():
            want = expected.get(name)
            if want is None:
                continue
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            scale = scales.get(base) if base is not None else None
            if scale is not None:
                plan[name] = _quant_kind(name, entry, scale, want, block)
                if plan[name] is None:
                    misshaped.append(
                        f"{name} (quantised): expected {want}, got {entry.shape} {entry.dtype} "
                        f"with scale {scale.shape} {scale.dtype}"
                    )
            elif entry.dtype in ("F8_E4M3", "F4") or (entry.dtype in ("U8", "I8") and not _INT_TENSORS.search(name)):
                misshaped.append(f"{name}: quantised {entry.dtype} tensor without a .scale companion")
            elif entry.shape != want:
                misshaped.append(f"{name}: expected {want}, got {entry.shape}")
            else:
                plan[name] = None
        if missing:
            problems.append(_summarise("missing tensor(s)", missing))
        if unexpected:
            problems.append(_summarise("unexpected tensor(s)", sorted(unexpected)))
        if misshaped:
            problems.append(_summarise("mis-shaped tensor(s)", misshaped))
        if duplicates:
            problems.append(_summarise("tensor(s) stored more than once", sorted(duplicates)))
        if problems:
            raise ValueError(f"checkpoint {os.fspath(model_dir)!r} does not match the config: " + "; ".join(problems))

        # Pass 2: read each tensor exactly once, in expected order so the dict order is stable.
        out: dict[str, torch.Tensor] = {}
        for name in expected:
            if skip is not None and skip(name):
                continue  # never read (an expert-parallel rank's other experts: engine.sharding.skips_unowned)
            entry = weights[name]
            t = entry.handle.get_tensor(entry.raw).to(device)
            kind = plan[name]
            if kind is not None:
                s_entry = scales[name[: -len(".weight")]]
                s = s_entry.handle.get_tensor(s_entry.raw).to(device)
                packed = mxfp4_as_bytes(t, s) if kind == "mxfp4" and keep_mxfp4_experts and \
                    _ROUTED_EXPERT.search(name) else None
                if packed is not None:
                    out[name], out[name[: -len(".weight")] + ".scale"] = packed
                    continue
                if kind == "fp8" and keep_fp8 and tuple(block) == FP8_BLOCK and \
                        keeps_fp8(name, expected[name], cfg.o_groups):
                    fp8 = weight_from_checkpoint(t, s, pow2_activations(cfg.quantization))
                    out[name], out[name[: -len(".weight")] + ".scale"] = fp8.weight, fp8.scale
                    continue
                t = dequant_fp8_block(t, s, block) if kind == "fp8" else dequant_mxfp4(t, s)
            if _INT_TENSORS.search(name):
                t = t.to(torch.int64)
            elif keeps_fp32(name):
                t = t.to(torch.float32)
            else:
                t = t.to(dtype)
            out[name] = t
        return out
