"""Checkpoint names, shapes and loading: make_model round trips, transformers checkpoints, shards, errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.loading.make_model import PRESETS, default_model_dir, make_model, random_weights
from engine.loading.tokenizer import load_tokenizer
from engine.loading.weights import canonical_name, expected_weight_shapes, keeps_fp32, load_weights
from engine.model.config import ModelConfig

E8M0 = getattr(torch, "float8_e8m0fnu", None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def tiny_q(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("tiny_q"), seed=3, quantize=True)


@pytest.fixture(scope="module")
def cfg(tiny):
    return ModelConfig.from_model_dir(tiny)


def _write_variant(src: str, dst, edit) -> str:
    """Copy a model dir's config with an edited tensor dict (edit(tensors) mutates in place)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh, open(os.path.join(dst, "config.json"), "w") as out:
        out.write(fh.read())
    return str(dst)


# ---- make_model -> load_weights ----------------------------------------------------------------
def test_round_trip_exact(tiny, cfg):
    with open(os.path.join(tiny, "config.json")) as fh:
        raw = json.load(fh)
    assert raw["compress_ratios"] == [0, 4, 128, 4] and raw["num_hash_layers"] == 1
    assert raw["architectures"] == ["DeepseekV4ForCausalLM"] and "rope_scaling" in raw
    assert cfg.compress_rope.yarn_factor == 16 and cfg.hash_layers == (True, False, False, False)
    weights = load_weights(tiny, cfg)
    source = random_weights(cfg, seed=3)
    assert list(weights) == list(expected_weight_shapes(cfg))
    for name, t in source.items():
        assert torch.equal(weights[name], t), name
    assert weights["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    tid = weights["layers.0.ffn.gate.tid2eid"]
    assert int(tid.min()) >= 0 and int(tid.max()) < cfg.n_routed_experts
    assert all(len(set(row)) == len(row) for row in tid.tolist())  # no repeated expert per token
    assert len({tuple(r) for r in tid.tolist()}) > 1
    assert weights["layers.1.attn.compressor.ape"].abs().min() > 0
    assert weights["layers.1.ffn.gate.bias"].abs().sum() > 0
    # A different seed gives different weights.
    assert not torch.equal(random_weights(cfg, seed=4)["embed.weight"], weights["embed.weight"])


def test_dtype_and_fp32_exceptions(tiny, cfg):
    weights = load_weights(tiny, cfg, dtype=torch.bfloat16)
    for name, t in weights.items():
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64
        elif keeps_fp32(name):
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name
    for name in (
        "norm.weight",
        "hc_head_fn",
        "layers.1.hc_attn_scale",
        "layers.2.attn.attn_sink",
        "layers.1.attn.indexer.compressor.ape",
        "layers.1.ffn.gate.bias",
        "layers.1.attn.q_norm.weight",
    ):
        assert weights[name].dtype == torch.float32, name
    assert weights["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16


def test_quantized_round_trip(tiny, tiny_q, cfg):
    with safe_open(os.path.join(tiny_q, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("layers.1.attn.wq_a.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.1.ffn.experts.2.w2.weight").get_dtype() == "I8"
        assert f.get_slice("layers.1.ffn.experts.2.w2.weight").get_shape() == [64, 16]
        assert f.get_slice("layers.1.ffn.experts.2.w2.scale").get_shape() == [64, 1]
    assert "layers.3.attn.indexer.wq_b.scale" in keys and "layers.0.ffn.shared_experts.w2.scale" in keys
    assert "layers.1.attn.compressor.wkv.scale" not in keys and "embed.scale" not in keys
    qcfg = ModelConfig.from_model_dir(tiny_q)
    assert qcfg.quantization["weight_block_size"] == [128, 128]
    exact = load_weights(tiny, cfg)
    deq = load_weights(tiny_q, qcfg)
    n_fp8 = n_fp4 = 0
    for name, w in exact.items():
        d = deq[name]
        assert d.shape == w.shape and d.dtype == w.dtype, name
        if f"{name[: -len('.weight')]}.scale" not in keys:
            assert torch.equal(d, w), name
        elif ".experts." in name and "shared" not in name:
            n_fp4 += 1  # MXFP4: error <= one grid unit <= block amax / 3
            blocks = w.reshape(w.shape[0], -1, 32)
            err = (d - w).reshape_as(blocks).abs()
            assert torch.all(err <= blocks.abs().amax(-1, keepdim=True) / 3 + 1e-7), name
            assert err.mean() < 0.15 * blocks.abs().mean(), name  # FP4 typically ~12%
        else:
            n_fp8 += 1  # FP8 e4m3: relative half-ulp 2**-4 (plus a subnormal floor)
            assert torch.all((d - w).abs() <= w.abs() * 2.0**-4 + w.abs().max() * 2.0**-12), name
    assert n_fp8 == 4 * 5 + 2 + 4 * 3 and n_fp4 == 4 * 8 * 3


# ---- transformers checkpoints ------------------------------------------------------------------
def _hf_tiny_config():
    transformers = pytest.importorskip("transformers")
    return transformers, transformers.DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        qk_rope_head_dim=8,
        q_lora_rank=16,
        num_experts_per_tok=2,
        n_routed_experts=4,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=4,
        index_head_dim=8,
        index_topk=4,
        sliding_window=8,
        hc_mult=2,
        compress_ratios=[0, 4, 128],
        num_hash_layers=1,
    )


def test_transformers_save_pretrained_loads(tmp_path):
    transformers, hf_cfg = _hf_tiny_config()
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_cfg)
    with torch.no_grad():  # randomise what transformers inits to zero / constant
        for name, p in model.named_parameters():
            if "position_bias" in name or name.endswith("sinks"):
                p.normal_()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_()
    model.save_pretrained(tmp_path)
    cfg = ModelConfig.from_model_dir(tmp_path)
    # The file's names, mapped back, are exactly our expected set with the expected shapes.
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        on_disk = {canonical_name(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert on_disk == expected_weight_shapes(cfg)

    w = load_weights(tmp_path, cfg)
    sd = model.state_dict()
    inter = hf_cfg.moe_intermediate_size
    assert torch.equal(w["embed.weight"], sd["model.embed_tokens.weight"])
    assert torch.equal(w["head.weight"], sd["lm_head.weight"])
    assert torch.equal(w["hc_head_fn"], sd["model.hc_head.hc_fn"])
    assert torch.equal(w["layers.1.attn.compressor.ape"], sd["model.layers.1.self_attn.compressor.position_bias"])
    assert torch.equal(w["layers.2.attn.compressor.ape"], sd["model.layers.2.self_attn.compressor.position_bias"])
    assert torch.equal(
        w["layers.1.attn.indexer.compressor.ape"], sd["model.layers.1.self_attn.compressor.indexer.position_bias"]
    )
    assert torch.equal(w["layers.1.attn.attn_sink"], sd["model.layers.1.self_attn.sinks"])
    assert torch.equal(w["layers.2.ffn.gate.bias"], sd["model.layers.2.mlp.gate.e_score_correction_bias"])
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H] = cat(w1, w3)
    assert torch.equal(w["layers.1.ffn.experts.3.w1.weight"], gate_up[3, :inter])
    assert torch.equal(w["layers.1.ffn.experts.3.w3.weight"], gate_up[3, inter:])
    assert torch.equal(w["layers.1.ffn.experts.3.w2.weight"], sd["model.layers.1.mlp.experts.down_proj"][3])
    assert torch.equal(w["layers.0.ffn.gate.tid2eid"], sd["model.layers.0.mlp.gate.tid2eid"].long())


def test_transformers_loads_make_model_output(tiny, cfg):
    """The oracle can read make_model's original-name checkpoint and sees the same tensors."""
    transformers = pytest.importorskip("transformers")
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tiny, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.layer_types[1:3] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    sd = model.state_dict()
    w = load_weights(tiny, cfg)
    assert torch.equal(sd["model.layers.3.self_attn.q_a_proj.weight"], w["layers.3.attn.wq_a.weight"])
    assert torch.equal(sd["model.layers.0.mlp.gate.tid2eid"].long(), w["layers.0.ffn.gate.tid2eid"])
    assert torch.equal(sd["model.layers.2.attn_hc.fn"], w["layers.2.hc_attn_fn"])


# ---- sharded checkpoints and alternative spellings ---------------------------------------------
def test_sharded_index_round_trip(tiny_q, tmp_path):
    """Two shards + index; shard 2 uses transformers spelling with float32 `weight_scale_inv` scales."""
    tensors = load_file(os.path.join(tiny_q, "model.safetensors"))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    shard2 = {}
    for n in second:
        t = tensors[n]
        key = {"embed.weight": "model.embed_tokens.weight", "hc_head_fn": "model.hc_head.hc_fn"}.get(n)
        if key is None and n.endswith(".scale") and ".experts." not in n:
            key, t = "model." + n[: -len(".scale")] + ".weight_scale_inv", t.view(torch.uint8)
            t = torch.exp2(t.float() - 127)  # V3-style float32 block scale
        shard2[key or ("model." + n if n.startswith("layers.") else n)] = t
    files = {
        "model-00001-of-00002.safetensors": {n: tensors[n] for n in first},
        "model-00002-of-00002.safetensors": shard2,
    }
    weight_map = {}
    for fname, part in files.items():
        save_file(part, os.path.join(tmp_path, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    cfg = ModelConfig.from_model_dir(tiny_q)
    sharded = load_weights(tmp_path, cfg)
    single = load_weights(tiny_q, cfg)
    assert list(sharded) == list(single)
    for name in single:
        assert torch.equal(sharded[name], single[name]), name


def test_glob_of_safetensors_without_index(tiny, tmp_path, cfg):
    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:100]}, os.path.join(tmp_path, "a.safetensors"))
    save_file({n: tensors[n] for n in names[100:]}, os.path.join(tmp_path, "b.safetensors"))
    w = load_weights(tmp_path, cfg)
    assert torch.equal(w["embed.weight"], tensors["embed.weight"])


def test_mtp_is_skipped(tiny, tmp_path, cfg):
    def add_mtp(t):
        t["mtp.0.attn.wq_a.weight"] = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
        t["mtp.0.attn.wq_a.scale"] = torch.ones(1, 1)
        t["model.mtp.0.emb.tok_emb.weight"] = torch.zeros(3)

    w = load_weights(_write_variant(tiny, tmp_path, add_mtp), cfg)
    assert not any("mtp" in n for n in w) and len(w) == len(expected_weight_shapes(cfg))


# ---- errors ------------------------------------------------------------------------------------
def test_missing_tensors_are_named(tiny, tmp_path, cfg):
    def drop(t):
        del t["layers.2.attn.compressor.ape"]
        for e in range(8):
            for k in ("w1", "w2", "w3"):
                del t[f"layers.3.ffn.experts.{e}.{k}.weight"]

    d = _write_variant(tiny, tmp_path, drop)
    with pytest.raises(ValueError) as err:
        load_weights(d, cfg)
    msg = str(err.value)
    assert "25 missing" in msg and "layers.2.attn.compressor.ape" in msg and "more" in msg


def test_misshaped_and_unexpected_tensors_are_named(tiny, tmp_path, cfg):
    def corrupt(t):
        t["layers.1.attn.wq_b.weight"] = torch.zeros(10, 32)
        t["layers.0.attn.bogus.weight"] = torch.zeros(2)

    d = _write_variant(tiny, tmp_path, corrupt)
    with pytest.raises(ValueError) as err:
        load_weights(d, cfg)
    msg = str(err.value)
    assert "layers.1.attn.wq_b.weight: expected (128, 32), got (10, 32)" in msg
    assert "unexpected" in msg and "layers.0.attn.bogus.weight" in msg


def test_bad_quantised_tensors(tiny_q, tmp_path):
    cfg = ModelConfig.from_model_dir(tiny_q)

    def corrupt(t):
        del t["layers.0.attn.wkv.scale"]  # FP8 bytes without scales
        t["layers.1.ffn.experts.0.w1.scale"] = t["layers.1.ffn.experts.0.w1.scale"][:, :1].contiguous()  # wrong scale
        t["layers.0.attn.nothing.scale"] = torch.ones(1, 1)  # scale without weight

    d = _write_variant(tiny_q, tmp_path, corrupt)
    with pytest.raises(ValueError) as err:
        load_weights(d, cfg)
    msg = str(err.value)
    assert "layers.0.attn.wkv.weight: quantised F8_E4M3 tensor without a .scale" in msg
    assert "layers.1.ffn.experts.0.w1.weight (quantised)" in msg
    assert "layers.0.attn.nothing.scale" in msg


def test_no_checkpoint(tmp_path, cfg):
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path, cfg)


def test_unknown_preset(tmp_path):
    with pytest.raises(ValueError, match="'huge'"):
        make_model("huge", tmp_path)
    assert {"tiny", "small"} <= set(PRESETS)
    ModelConfig.from_dict(PRESETS["small"])  # parses


# ---- tokenizer and default model -------------------------------------------------------------
def test_tokenizer(tiny, tmp_path):
    tok = load_tokenizer(tiny)
    assert tok is not None and tok.bos_id == 0 and tok.eos_id == 1
    assert tok.vocab_size <= PRESETS["tiny"]["vocab_size"]
    text = "Hello, world! The quick brown fox. Ünïcödé ✓"
    ids = tok.encode(text)
    assert ids[0] == 0 and ids.count(0) == 1 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode([0] + ids[1:] + [1]) == text  # specials dropped
    assert load_tokenizer(tmp_path) is None
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(tiny, "tokenizer.json"))
    assert raw.token_to_id("<｜begin▁of▁sentence｜>") == 0 and raw.token_to_id("<｜end▁of▁sentence｜>") == 1


def test_auto_tokenizer_loads(tiny):
    transformers = pytest.importorskip("transformers")
    at = transformers.AutoTokenizer.from_pretrained(tiny)
    assert at.bos_token_id == 0 and at.eos_token_id == 1
    assert at("Hello").input_ids == load_tokenizer(tiny).encode("Hello")
    # Like V4's release: no chat template (chat uses service/chat_encoding.py); its chat tokens are single tokens.
    assert at.chat_template is None
    assert len(at("<｜User｜><think></think><｜latest_reminder｜>", add_special_tokens=False).input_ids) == 4


def test_default_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_HOME", str(tmp_path))
    d = default_model_dir()
    assert d == os.path.join(str(tmp_path), "tiny")
    assert os.path.exists(os.path.join(d, "model.safetensors")) and os.path.exists(os.path.join(d, "tokenizer.json"))
    mtime = os.path.getmtime(os.path.join(d, "model.safetensors"))
    assert default_model_dir() == d and os.path.getmtime(os.path.join(d, "model.safetensors")) == mtime
    # A stale cache (no/different stamp) is replaced, and nothing is left behind.
    os.remove(os.path.join(d, ".dsv4_stamp"))
    assert default_model_dir() == d and os.path.exists(os.path.join(d, ".dsv4_stamp"))
    assert sorted(os.listdir(tmp_path)) == ["tiny"]
    cfg = ModelConfig.from_model_dir(d)
    assert load_weights(d, cfg)["embed.weight"].shape == (512, 64)
