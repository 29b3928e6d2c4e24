"""Checkpoint loading for DeepSeek V4: names, shapes, dequantisation.

Everything is keyed by the ORIGINAL DeepSeek tensor names (`embed.weight`, `layers.3.attn.wq_a.weight`,
...). Two on-disk spellings are accepted:
- DeepSeek's release (and `engine.loading.make_model`): the original names, no prefix;
- transformers' `save_pretrained`: the same names under `model.` except `model.embed_tokens.weight`,
  `model.hc_head.hc_{fn,base,scale}` and an unprefixed `head.weight` (`lm_head.weight` is accepted too).
Quantised tensors carry a companion holding their scales: `X.scale` (DeepSeek) or `X.weight_scale_inv` /
`X.weight_scale` (transformers / other exporters), where `X.weight` is the quantised tensor:
- float8_e4m3fn weight [N, K] + block scales [ceil(N/128), ceil(K/128)] -> FP8 block dequant;
- int8/uint8 weight [N, K/2] (or float4_e2m1fn_x2) + UE8M0 scales [N, K/32] -> MXFP4 dequant.
The multi-token-prediction layers (`mtp.{i}.*`, DeepSeek's names; `model.mtp.{i}.*` in the `model.`-prefixed
scheme, the same way `model.layers.N.*` maps to `layers.N.*`) are read only with `mtp=True` (speculative
decoding on); otherwise they are skipped unread (no memory cost). vLLM's in-memory rename
(`model.layers.{L+i}.*`) is not an on-disk scheme and is not read: a `layers.{L}` tensor is reported unexpected.
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

from dsv4_kernels.fp8_linear import weight_from_checkpoint
from dsv4_kernels.quant import FP8_BLOCK, MXFP4_BLOCK, dequant_fp8_block, dequant_mxfp4, mxfp4_as_bytes
from engine.loading.load_progress import LoadProgress
from engine.model.config import ModelConfig
from engine.model.linear import keeps_fp8, pow2_activations

# Tensors that stay float32 whatever `dtype` is asked for: they are tiny and feed fp32 maths
# (RMSNorm weights, mHC mixing, attention sinks, compressor position biases, router bias).
_KEEP_FP32 = re.compile(r"(?:norm\.weight|attn_sink|\.ape|gate\.bias)$|(?:^|\.)hc_head_|\.hc_(?:attn|ffn)_")
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
def expected_weight_shapes(cfg: ModelConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model (original DeepSeek names) -> its logical shape; with `mtp`, the
    `cfg.num_nextn_predict_layers` MTP layers' `mtp.{i}.*` tensors follow the main model's.

    Quantised tensors are listed by their dequantised shape; `.scale` companions are not listed.
    """
    h, v, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (v, h),
        "head.weight": (v, h),
        "norm.weight": (h,),
        "hc_head_fn": (hc, hc * h),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for i in range(cfg.num_layers):
        shapes.update(_block_shapes(cfg, f"layers.{i}.", cfg.compress_ratios[i], cfg.hash_layers[i]))
    if mtp:
        shapes.update(mtp_weight_shapes(cfg))
    return shapes


def mtp_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP layers' tensors (docs: /work/shared/docs/mtp.md section 1): per layer i, `mtp.{i}.` +
    enorm / hnorm / norm, e_proj / h_proj (D x D), its own hc_head_{fn,base,scale}, and one V4 block whose
    attention is sliding-window only (no compressor, no indexer) and whose MoE is score-routed (gate.bias)."""
    h, hc = cfg.hidden_size, cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{i}."
        for norm in ("enorm", "hnorm", "norm"):
            shapes[f"{p}{norm}.weight"] = (h,)
        shapes[p + "e_proj.weight"] = (h, h)
        shapes[p + "h_proj.weight"] = (h, h)
        shapes[p + "hc_head_fn"] = (hc, hc * h)
        shapes[p + "hc_head_base"] = (hc,)
        shapes[p + "hc_head_scale"] = (1,)
        shapes.update(_block_shapes(cfg, p, 0, False))
    return shapes


def _block_shapes(cfg: ModelConfig, p: str, ratio: int, hash_layer: bool) -> dict[str, tuple[int, ...]]:
    """One V4 block's tensors under prefix `p` (`layers.N.` or `mtp.i.`): norms, mHC mixing, attention
    (compressor when ratio > 1, indexer when ratio == 4) and MoE (tid2eid when hash-routed, else gate.bias)."""
    h, v, hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    hd, nh, ql = cfg.head_dim, cfg.num_heads, cfg.q_lora_rank
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc*hc) mixing weights per token
    shapes: dict[str, tuple[int, ...]] = {}
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
    if ratio > 1:
        coff = 2 if ratio == 4 else 1  # overlapping (ratio 4) windows carry two halves per token
        shapes[a + "compressor.wkv.weight"] = (coff * hd, h)
        shapes[a + "compressor.wgate.weight"] = (coff * hd, h)
        shapes[a + "compressor.ape"] = (ratio, coff * hd)
        shapes[a + "compressor.norm.weight"] = (hd,)
    if ratio == 4:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        shapes[a + "indexer.wq_b.weight"] = (ih * idim, ql)
        shapes[a + "indexer.weights_proj.weight"] = (ih, h)
        shapes[a + "indexer.compressor.wkv.weight"] = (2 * idim, h)
        shapes[a + "indexer.compressor.wgate.weight"] = (2 * idim, h)
        shapes[a + "indexer.compressor.ape"] = (4, 2 * idim)
        shapes[a + "indexer.compressor.norm.weight"] = (idim,)
    f = p + "ffn."
    shapes[f + "gate.weight"] = (e, h)
    if hash_layer:
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
    """On-disk tensor name -> original DeepSeek name (scale companions end in `.scale`); MTP tensors keep their
    `mtp.{i}.` names (`model.mtp.{i}.` loses the prefix like `model.layers.N.`)."""
    name = raw[len("model.") :] if raw.startswith("model.") else raw
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


@dataclass(frozen=True)
class _Entry:
    raw: str  # name inside the file
    handle: safe_open  # the open file holding it (get_tensor / get_slice)
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


def _index(model_dir, stack: contextlib.ExitStack, mtp: bool = False) -> tuple[dict, dict, list[str]]:
    """Pass 1, headers only (safe_open reads the JSON header; data is read on demand):
    -> ({name: weight entry}, {weight base name: scale entry}, [names stored more than once]).
    mtp False: `mtp.*` tensors are left out (never read, never checked)."""
    weights: dict[str, _Entry] = {}
    scales: dict[str, _Entry] = {}
    duplicates: list[str] = []
    for path in checkpoint_files(model_dir):
        handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
        for raw in handle.keys():
            name = canonical_name(raw)
            if name is None or (not mtp and name.startswith("mtp.")):
                continue
            sl = handle.get_slice(raw)
            entry = _Entry(raw, handle, sl.get_dtype(), tuple(sl.get_shape()))
            table, key = (scales, name[: -len(".scale")]) if name.endswith(".scale") else (weights, name)
            if key in table:
                duplicates.append(name)
            table[key] = entry
    return weights, scales, duplicates


def _plan(
    model_dir, expected: dict, weights: dict, scales: dict, duplicates: list[str], block: tuple[int, int]
) -> dict[str, str | None]:
    """Check the headers against the config -> {name: None (plain) / "fp8" / "mxfp4"}; every problem is
    collected into one ValueError."""
    missing = [n for n in expected if n not in weights]
    unexpected = [n for n in weights if n not in expected]
    unexpected += [f"{n}.scale" for n in scales if f"{n}.weight" not in expected]
    misshaped: list[str] = []
    plan: dict[str, str | None] = {}
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
    problems = []
    for title, items in (
        ("missing tensor(s)", missing),
        ("unexpected tensor(s)", sorted(unexpected)),
        ("mis-shaped tensor(s)", misshaped),
        ("tensor(s) stored more than once", sorted(duplicates)),
    ):
        if items:
            problems.append(_summarise(title, items))
    if problems:
        raise ValueError(f"checkpoint {os.fspath(model_dir)!r} does not match the config: " + "; ".join(problems))
    return plan


class Checkpoint:
    """A checkpoint whose headers were checked against the config (`open_checkpoint`). `read(name)` returns a
    tensor as `load_weights` does; `read(name, window)` only elements [lo, hi) of one dimension (logical
    elements, starting on `grid(name, dim)`), read through safetensors' get_slice, so a tensor-parallel rank
    reads its shard and not the whole (engine.loading.shard_reader). `bytes_read`: bytes materialised from the files."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict,
        scales: dict,
        plan: dict,
        dtype: torch.dtype,
        device,
        keep_mxfp4_experts: bool,
        keep_fp8: bool,
        mtp: bool = False,
    ):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.expected = expected_weight_shapes(cfg, mtp)
        self.block = tuple(cfg.quantization.get("weight_block_size") or FP8_BLOCK)
        self._weights, self._scales, self._plan = weights, scales, plan
        self.keep_mxfp4_experts, self.keep_fp8 = keep_mxfp4_experts, keep_fp8
        self.bytes_read = 0

    @property
    def names(self) -> list[str]:
        """Every model tensor (scales excluded), in `expected_weight_shapes` order."""
        return list(self.expected)

    def grid(self, name: str, dim: int) -> int:
        """Elements of `dim` a stored block spans: a window must start on it (FP8 scale blocks, 32-value MXFP4
        blocks along K; 1 for plain tensors and MXFP4 rows)."""
        kind = self._plan[name]
        if kind == "fp8":
            return self.block[dim]
        return MXFP4_BLOCK if kind == "mxfp4" and dim == 1 else 1

    def read(self, name: str, window: tuple[int, int, int] | None = None) -> dict[str, torch.Tensor]:
        """-> {name: tensor} or, kept quantised, {name: ..., X.scale: ...}; window = (dim, lo, hi)."""
        kind = self._plan[name]
        t = self._read(self._weights[name], window, 2 if kind == "mxfp4" and window and window[0] == 1 else 1)
        if kind is not None:
            base = name[: -len(".weight")]
            s_entry = self._scales[base]
            s = self._read(s_entry, window, self.grid(name, window[0]) if window else 1)
            if kind == "mxfp4" and self.keep_mxfp4_experts and _ROUTED_EXPERT.search(name):
                packed = mxfp4_as_bytes(t, s) if self._packable(s_entry, t, window) else None
                if packed is not None:
                    return {name: packed[0], base + ".scale": packed[1]}
            if (
                kind == "fp8"
                and self.keep_fp8
                and tuple(self.block) == FP8_BLOCK
                and keeps_fp8(name, self.expected[name], self.cfg.o_groups)
            ):
                fp8 = weight_from_checkpoint(t, s, pow2_activations(self.cfg.quantization))
                return {name: fp8.weight, base + ".scale": fp8.scale}
            t = dequant_fp8_block(t, s, self.block) if kind == "fp8" else dequant_mxfp4(t, s)
        if _INT_TENSORS.search(name):
            return {name: t.to(torch.int64)}
        return {name: t.to(torch.float32 if keeps_fp32(name) else self.dtype)}

    def _read(self, entry: _Entry, window, unit: int) -> torch.Tensor:
        """Stored elements [lo // unit, ceil(hi / unit)) of the window's dim (unit: 2 for MXFP4 bytes along K,
        the block for scales), moved to the device."""
        if window is None:
            t = entry.handle.get_tensor(entry.raw)
        else:
            dim, lo, hi = window
            lo, hi = lo // unit, -(-hi // unit)
            if entry.dtype == "F4":  # safetensors cannot slice float4 (it reshapes by element count): whole
                t = entry.handle.get_tensor(entry.raw).narrow(dim, lo, hi - lo)
            else:
                t = entry.handle.get_slice(entry.raw)[(slice(None),) * dim + (slice(lo, hi),)]
        self.bytes_read += t.numel() * t.element_size()
        return t.to(self.device)

    def _packable(self, s_entry: _Entry, t: torch.Tensor, window) -> bool:
        """Float MXFP4 scales stay packed only when ALL the tensor's scales are powers of two (what a whole read
        decides), so a window decides on the whole scale tensor (UE8M0 bytes always are)."""
        if window is None or s_entry.dtype in ("U8", "F8_E8M0"):
            return True
        return mxfp4_as_bytes(t[:0], self._read(s_entry, None, 1)) is not None


@contextlib.contextmanager
def open_checkpoint(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    keep_mxfp4_experts: bool = False,
    keep_fp8: bool = False,
    mtp: bool = False,
):
    """Read every header, check names, shapes and formats against `cfg` (one ValueError listing every problem,
    before any tensor data is read), and yield a `Checkpoint` whose files stay open inside the `with`.
    mtp: also the MTP layers (`expected_weight_shapes(cfg, mtp=True)`); otherwise `mtp.*` is skipped."""
    expected = expected_weight_shapes(cfg, mtp)
    block = tuple(cfg.quantization.get("weight_block_size") or FP8_BLOCK)
    with contextlib.ExitStack() as stack:
        weights, scales, duplicates = _index(model_dir, stack, mtp)
        plan = _plan(model_dir, expected, weights, scales, duplicates, block)
        yield Checkpoint(cfg, weights, scales, plan, dtype, device, keep_mxfp4_experts, keep_fp8, mtp)


def load_weights(
    model_dir: str | os.PathLike,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    keep_mxfp4_experts: bool = False,
    keep_fp8: bool = False,
    skip: Callable[[str], bool] | None = None,
    progress: bool | None = None,
    mtp: bool = False,
) -> dict[str, torch.Tensor]:
    """Read, check and dequantise a checkpoint -> {original name: tensor on `device`}.

    Floating tensors come back in `dtype` except `keeps_fp32` ones (float32); `gate.tid2eid` as int64.
    Shapes are those of `expected_weight_shapes(cfg)`, except with `keep_mxfp4_experts`: MXFP4 routed
    experts (`layers.N.ffn.experts.E.w{1,2,3}.weight`) then stay packed, uint8 e2m1 bytes [N, K/2] plus
    a `...w1.scale` uint8 UE8M0 tensor [N, K/32], for kernels that dequantise in registers (a quarter of
    the bf16 bytes); experts stored in bf16/FP8 are unaffected. With `keep_fp8`, FP8 dense projections that
    `engine.model.linear.keeps_fp8` accepts stay as stored: float8_e4m3fn [N, K] plus `X.scale` fp32 block scales
    [N/128, K/128] (UE8M0 bytes converted exactly), for the FP8 GEMM path (no bf16 copy). Every problem
    (missing, unexpected or mis-shaped tensors, scales without weights, quantised bytes without scales) is
    collected first and reported in one ValueError, before any tensor data is read. `skip(name)` True: that
    tensor (and its scale) is checked but never read nor returned. progress: see engine.loading.load_progress.
    mtp: also read the MTP layers (`mtp.{i}.*`, routed experts kept packed like the main layers'); the engine
    loads them only with speculative decoding on.
    """
    with open_checkpoint(model_dir, cfg, dtype, device, keep_mxfp4_experts, keep_fp8, mtp) as ckpt:
        names = [n for n in ckpt.names if skip is None or not skip(n)]
        out: dict[str, torch.Tensor] = {}
        with LoadProgress(len(names), enabled=progress) as bar:
            for name in names:  # each tensor read once, in expected order so the dict order is stable
                out.update(ckpt.read(name))
                bar.advance(ckpt.bytes_read)
        return out
