"""Each tensor-parallel rank reads only its shard from the safetensors files (engine.loading.shard_reader).

`load_shard` must equal today's load-then-cut, `shard_weights(load_weights(...))`, bit for bit, for every
tensor and rank: tiny and small presets, plain and in the release formats (FP8 e4m3 + UE8M0 128x128 block
scales, MXFP4 int8 experts + UE8M0 scales), dequantised or kept compact (keep_fp8 / keep_mxfp4_experts),
TP 2 and 4 where the model divides, with and without expert parallelism, from one file with DeepSeek's
names and from a sharded index with transformers' names and float scales; a vocab that does not split
evenly; float4-typed experts. And a rank must really read less: the elements materialised through
safetensors are counted per tensor and must be exactly the rank's cut (or its block-grid window).
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.loading.weights as weights_mod
from dsv4_kernels.quant import ue8m0_to_float
from engine.loading.make_model import make_model, preset_config, random_weights
from engine.loading.shard_reader import load_shard
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from engine.model.parallel import ParallelContext
from engine.model.sharding import cut_of, owns, shard_weights

FP4 = getattr(torch, "float4_e2m1fn_x2", None)


def _write(out_dir, raw: dict, tensors: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(raw, fh)
    return str(out_dir)


def _hf_name(name: str, float_scale: bool) -> str:
    """DeepSeek name -> a transformers-style spelling the loader accepts (scales as weight_scale[_inv])."""
    special = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale",
    }
    if name in special:
        return special[name]
    if name.endswith(".scale"):
        return "model." + name[: -len(".scale")] + (".weight_scale_inv" if float_scale else ".weight_scale")
    return "model." + name


def _hf_sharded(src: str, dst, files: int = 3) -> str:
    """src's tensors over `files` shards + model.safetensors.index.json, transformers names; FP8 scales as
    float32 (V3-style `weight_scale_inv`), MXFP4 scales as float32 powers of two (`weight_scale`)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    os.makedirs(dst, exist_ok=True)
    parts: list[dict] = [{} for _ in range(files)]
    for i, (name, t) in enumerate(sorted(tensors.items())):
        is_scale = name.endswith(".scale")
        if is_scale:
            t = ue8m0_to_float(t)
        parts[i % files][_hf_name(name, is_scale and ".experts." not in name)] = t
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(part, os.path.join(dst, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    with open(os.path.join(src, "config.json")) as fh, open(os.path.join(dst, "config.json"), "w") as out:
        out.write(fh.read())
    return str(dst)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard_reader")
    out = {}
    for preset in ("tiny", "small"):
        out[preset] = make_model(preset, root / preset, seed=2)
        out[preset + "_q"] = make_model(preset, root / f"{preset}_q", seed=2, quantize=True)
        out[preset + "_q_hf_index"] = _hf_sharded(out[preset + "_q"], root / f"{preset}_q_hf")
    raw = preset_config("small")
    raw["vocab_size"] = 4090  # ceil(4090 / 4) = 1023 rows a rank: the last rank's shard is zero-padded
    out["small_v4090"] = _write(root / "small_v4090", raw, random_weights(ModelConfig.from_dict(raw), 5))
    return out


def _ranks(cfg: ModelConfig):
    """Every (tp, ep) group the model divides, as lists of rank contexts."""
    for tp in (2, 4):
        for ep in (False, True):
            try:
                ParallelContext(tp, 0, ep).local(cfg.o_groups, "o_groups")
                ParallelContext(tp, 0, ep).local(cfg.num_heads, "heads")
                if ep:
                    ParallelContext(tp, 0, ep).local(cfg.n_routed_experts, "experts")
            except ValueError:
                continue
            yield [ParallelContext(tp, r, ep) for r in range(tp)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.uint8):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _assert_equal_to_load_then_cut(model_dir: str, dtype=torch.float32, keeps=((False, False),)) -> int:
    cfg = ModelConfig.from_model_dir(model_dir)
    checked = 0
    for keep_mx, keep_fp8 in keeps:
        full = load_weights(model_dir, cfg, dtype=dtype, keep_mxfp4_experts=keep_mx, keep_fp8=keep_fp8)
        for group in _ranks(cfg):
            for ctx in group:
                want = shard_weights(full, cfg, ctx, dtype)
                got = load_shard(model_dir, cfg, ctx, dtype, "cpu", keep_mxfp4_experts=keep_mx, keep_fp8=keep_fp8)
                what = (
                    f"{os.path.basename(model_dir)} tp{ctx.tp_size} ep={ctx.expert_parallel} rank {ctx.rank} "
                    f"keep_mxfp4={keep_mx} keep_fp8={keep_fp8}"
                )
                assert list(got) == list(want), what
                bad = [n for n in want if not _same(got[n], want[n])]
                assert not bad, f"{what}: {bad[:5]}"
                checked += 1
    return checked


@pytest.mark.parametrize("name", ["tiny", "small", "small_v4090"])
def test_plain_checkpoint_equals_load_then_cut(models, name):
    assert _assert_equal_to_load_then_cut(models[name]) == (2 * 2 if name == "tiny" else 2 * (2 + 4))


@pytest.mark.parametrize("name", ["tiny_q", "small_q", "tiny_q_hf_index", "small_q_hf_index"])
def test_release_formats_equal_load_then_cut(models, name):
    """Dequantised, and kept compact (FP8 e4m3 + fp32 scales where keeps_fp8 allows; MXFP4 packed bytes):
    at TP 4 small's wo_b / shared w1 cuts miss the 128-grid (dequantised from their windows)."""
    _assert_equal_to_load_then_cut(models[name], keeps=((False, False), (True, True)))


def test_bf16_release_format_equals_load_then_cut(models):
    _assert_equal_to_load_then_cut(models["small_q"], dtype=torch.bfloat16, keeps=((False, False), (True, True)))


@pytest.mark.skipif(FP4 is None, reason="torch has no float4_e2m1fn_x2")
def test_float4_typed_experts_equal_load_then_cut(models, tmp_path):
    """float4_e2m1fn_x2 experts (safetensors "F4", which it cannot slice: read whole, then cut)."""
    tensors = load_file(os.path.join(models["tiny_q"], "model.safetensors"))
    for name in [n for n in tensors if ".experts." in n and "shared" not in n and n.endswith(".weight")]:
        tensors[name] = tensors[name].view(torch.uint8).view(FP4)
    with open(os.path.join(models["tiny_q"], "config.json")) as fh:
        raw = json.load(fh)
    _assert_equal_to_load_then_cut(_write(tmp_path / "f4", raw, tensors), keeps=((False, False), (True, False)))


# ---- fewer bytes per rank --------------------------------------------------------------------------
class _Counting:
    """safe_open that records how many elements each tensor materialises (get_tensor or get_slice[...])."""

    def __init__(self, counts: dict, real):
        self.counts, self.real = counts, real

    def __call__(self, *args, **kwargs):
        return _CountingFile(self.real(*args, **kwargs), self.counts)


class _CountingFile:
    def __init__(self, f, counts):
        self.f, self.counts = f, counts

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.counts[name] = self.counts.get(name, 0) + t.numel()
        return t

    def get_slice(self, name):
        return _CountingSlice(self.f.get_slice(name), name, self.counts)


class _CountingSlice:
    def __init__(self, sl, name, counts):
        self.sl, self.name, self.counts = sl, name, counts

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, index):
        t = self.sl[index]
        self.counts[self.name] = self.counts.get(self.name, 0) + t.numel()
        return t


def _read_counts(monkeypatch, model_dir, ctx, **kwargs) -> dict:
    counts: dict = {}
    monkeypatch.setattr(weights_mod, "safe_open", _Counting(counts, weights_mod.safe_open))
    cfg = ModelConfig.from_model_dir(model_dir)
    load_shard(model_dir, cfg, ctx, torch.float32, "cpu", **kwargs)
    monkeypatch.undo()
    return counts


@pytest.mark.parametrize("ep", [False, True])
def test_a_rank_reads_only_its_cut(models, monkeypatch, ep):
    """Plain small model, TP 4: every split tensor materialises exactly its cut's elements (a rank reading
    whole tensors fails here), replicated ones their whole, other ranks' experts nothing; the four ranks'
    reads of a split tensor add up to the tensor once."""
    model_dir = models["small"]
    cfg = ModelConfig.from_model_dir(model_dir)
    shapes = weights_mod.expected_weight_shapes(cfg)
    full = sum(torch.Size(s).numel() for s in shapes.values())
    split_total = {}
    for rank in range(4):
        ctx = ParallelContext(4, rank, ep)
        counts = _read_counts(monkeypatch, model_dir, ctx)
        for name, shape in shapes.items():
            numel = torch.Size(shape).numel()
            cut = cut_of(name, shape, ctx)
            if not owns(name, cfg, ctx):
                want = 0
            elif cut is None:
                want = numel
            else:
                want = numel // shape[cut.dim] * (cut.stop - cut.start)
                split_total[name] = split_total.get(name, 0) + counts.get(name, 0)
            assert counts.get(name, 0) == want, f"rank {rank} {name}: read {counts.get(name, 0)}, cut {want}"
        total = sum(counts.values())
        assert total < 0.5 * full, f"rank {rank} read {total} of {full} elements"
    assert all(split_total[n] == torch.Size(shapes[n]).numel() for n in split_total)
    assert "layers.0.attn.wo_b.weight" in split_total and "head.weight" in split_total


def test_release_format_rank_reads_its_windows(models, monkeypatch):
    """MXFP4 experts (int8 bytes + UE8M0 scales) and FP8 projections at TP 2 without EP: each expert weight
    and scale is read at half its size; FP8 tensors at most their block-grid window."""
    model_dir = models["small_q"]
    ctx = ParallelContext(2, 1, False)
    counts = _read_counts(monkeypatch, model_dir, ctx, keep_mxfp4_experts=True, keep_fp8=True)
    with weights_mod.safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        stored = {k: torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys()}
    for name in (
        "layers.2.ffn.experts.5.w1.weight",
        "layers.2.ffn.experts.5.w1.scale",
        "layers.2.ffn.experts.5.w2.weight",
        "layers.2.ffn.experts.5.w2.scale",
        "layers.1.attn.wq_b.weight",
        "layers.1.attn.wq_b.scale",
        "layers.1.attn.wo_b.weight",
        "layers.1.attn.wo_b.scale",
    ):
        assert counts[name] * 2 == stored[name], f"{name}: read {counts[name]} of {stored[name]}"
    # shared w1: 64 of 128 rows, a half block: the whole 128-row block (one scale row) is the window
    assert counts["layers.1.ffn.shared_experts.w1.weight"] == stored["layers.1.ffn.shared_experts.w1.weight"]
    assert counts["layers.1.attn.wkv.weight"] == stored["layers.1.attn.wkv.weight"]  # replicated
    assert sum(counts.values()) < 0.6 * sum(stored.values())


# ---- progress ---------------------------------------------------------------------------------------
def test_progress_on_rank_zero_only(models, caplog):
    model_dir = models["tiny"]
    cfg = ModelConfig.from_model_dir(model_dir)
    with caplog.at_level(logging.INFO, logger="dsv4.engine"):
        load_shard(model_dir, cfg, ParallelContext(2, 1), torch.float32, "cpu", progress=True)
        assert not [r for r in caplog.records if "loading" in r.getMessage()]
        load_shard(model_dir, cfg, ParallelContext(2, 0), torch.float32, "cpu")  # auto: quiet under pytest
        assert not [r for r in caplog.records if "loading" in r.getMessage()]
        load_shard(model_dir, cfg, ParallelContext(2, 0), torch.float32, "cpu", progress=True)
    lines = [r.getMessage() for r in caplog.records if "loading rank 0/2 shard" in r.getMessage()]
    assert len(lines) >= 5 and "MiB read in" in lines[-1], lines
