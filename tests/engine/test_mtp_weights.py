"""MTP layer weights (issue 34 step 1): `make_model(mtp_layers=N)` writes `mtp.{i}.*` with the V4 release's names
and formats, the loader reads them in both naming schemes only when asked (`mtp=True`), and transformers (the
oracle, which has no MTP) still loads a checkpoint that carries them."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.loading.make_model import make_model
from engine.loading.weights import expected_weight_shapes, load_weights, mtp_weight_shapes
from engine.model.config import ModelConfig


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {
        "plain": make_model("tiny", root / "plain", seed=5),
        "mtp": make_model("tiny", root / "mtp", seed=5, mtp_layers=2),
        "mtp_q": make_model("tiny", root / "mtp_q", seed=5, quantize=True, mtp_layers=1),
    }


def test_config_declares_the_mtp_layers(dirs):
    with open(os.path.join(dirs["mtp"], "config.json")) as fh:
        raw = json.load(fh)
    assert raw["num_nextn_predict_layers"] == 2 and raw["compress_ratios"] == [0, 4, 128, 4, 0, 0]
    cfg = ModelConfig.from_model_dir(dirs["mtp"])
    assert cfg.num_nextn_predict_layers == 2 and cfg.compress_ratios == (0, 4, 128, 4)
    names = mtp_weight_shapes(cfg)
    assert all(n.startswith(("mtp.0.", "mtp.1.")) for n in names)
    for leaf in (
        "enorm.weight",
        "hnorm.weight",
        "norm.weight",
        "e_proj.weight",
        "h_proj.weight",
        "hc_head_fn",
        "hc_attn_fn",
        "hc_ffn_scale",
        "attn.wkv.weight",
        "attn.attn_sink",
        "ffn.gate.bias",
        "ffn.experts.7.w2.weight",
        "ffn.shared_experts.w1.weight",
    ):
        assert f"mtp.1.{leaf}" in names, leaf
    assert not any(".compressor." in n or ".indexer." in n or "tid2eid" in n for n in names)


def test_skipped_unless_asked_and_main_weights_unchanged(dirs):
    cfg = ModelConfig.from_model_dir(dirs["mtp"])
    plain = load_weights(dirs["plain"], ModelConfig.from_model_dir(dirs["plain"]))
    without = load_weights(dirs["mtp"], cfg)
    assert list(without) == list(plain)  # mtp.* never read without speculation
    assert all(torch.equal(without[n], plain[n]) for n in plain)
    both = load_weights(dirs["mtp"], cfg, mtp=True)
    assert list(both) == list(expected_weight_shapes(cfg, mtp=True))
    for name, shape in mtp_weight_shapes(cfg).items():
        assert tuple(both[name].shape) == shape, name
    assert both["mtp.0.hc_head_fn"].dtype == torch.float32
    bf16 = load_weights(dirs["mtp"], cfg, dtype=torch.bfloat16, mtp=True)
    assert bf16["mtp.1.hc_head_scale"].dtype == torch.float32 and bf16["mtp.1.e_proj.weight"].dtype == torch.bfloat16


def test_model_prefixed_names(dirs, tmp_path):
    """`model.mtp.{i}.*` reads like `model.layers.N.*`: the same tensors as the original names."""
    tensors = load_file(os.path.join(dirs["mtp"], "model.safetensors"))
    renamed = {(n if n == "head.weight" else f"model.{n}"): t for n, t in tensors.items()}
    save_file(renamed, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(dirs["mtp"], "config.json")) as src, open(tmp_path / "config.json", "w") as dst:
        dst.write(src.read())
    cfg = ModelConfig.from_model_dir(tmp_path)
    a, b = load_weights(dirs["mtp"], cfg, mtp=True), load_weights(tmp_path, cfg, mtp=True)
    assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_missing_mtp_weights_are_reported(dirs):
    cfg = ModelConfig.from_model_dir(dirs["mtp"])
    with pytest.raises(ValueError, match="missing tensor.*mtp.0"):
        load_weights(dirs["plain"], cfg, mtp=True)


def test_quantised_mtp_layer(dirs):
    with safe_open(os.path.join(dirs["mtp_q"], "model.safetensors"), "pt") as f:
        assert f.get_slice("mtp.0.e_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("mtp.0.attn.wq_a.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("mtp.0.ffn.experts.1.w1.weight").get_dtype() == "I8"
        assert "mtp.0.ffn.experts.1.w1.scale" in f.keys() and "mtp.0.enorm.scale" not in f.keys()
    cfg = ModelConfig.from_model_dir(dirs["mtp_q"])
    deq = load_weights(dirs["mtp_q"], cfg, mtp=True)
    exact = load_weights(dirs["mtp"], ModelConfig.from_model_dir(dirs["mtp"]), mtp=True)
    for name in ("mtp.0.e_proj.weight", "mtp.0.ffn.experts.1.w1.weight", "mtp.0.attn.wo_b.weight"):
        err = (deq[name] - exact[name]).abs().mean() / exact[name].abs().mean()
        assert 0 < err < 0.2, (name, err)
    assert torch.equal(deq["mtp.0.enorm.weight"], exact["mtp.0.enorm.weight"])
    packed = load_weights(dirs["mtp_q"], cfg, mtp=True, keep_mxfp4_experts=True)
    assert packed["mtp.0.ffn.experts.1.w1.weight"].dtype == torch.uint8


def test_transformers_ignores_mtp_tensors(tmp_path):
    """The oracle loads a transformers checkpoint with `model.mtp.0.*` added, and its logits do not change."""
    from tests.support.oracle import load_oracle, make_hf_checkpoint, oracle_logprobs

    d = make_hf_checkpoint(tmp_path / "hf", seed=1, num_hidden_layers=2, compress_ratios=[0, 4])
    ids = [0, 5, 9, 3, 7, 11, 2]
    before = oracle_logprobs(d, ids)
    cfg = ModelConfig.from_model_dir(d)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(0)
    cfg1 = ModelConfig.from_dict({**json.load(open(os.path.join(d, "config.json"))), "num_nextn_predict_layers": 1})
    for name, shape in mtp_weight_shapes(cfg1).items():
        tensors[f"model.{name}"] = torch.randn(shape, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})
    raw = json.load(open(os.path.join(d, "config.json")))
    raw["num_nextn_predict_layers"] = 1
    json.dump(raw, open(os.path.join(d, "config.json"), "w"))
    import tests.support.oracle as oracle

    oracle._MODELS.clear()
    after = oracle_logprobs(d, ids)
    assert torch.equal(before, after)
    cfg = ModelConfig.from_model_dir(d)
    assert cfg.num_nextn_predict_layers == 1
    w = load_weights(d, cfg, mtp=True)
    assert torch.equal(w["mtp.0.e_proj.weight"], tensors["model.mtp.0.e_proj.weight"])
    assert load_oracle(d) is not None
