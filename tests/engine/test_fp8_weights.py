"""FP8 dense projections kept as e4m3 + block scales (load_weights(keep_fp8=True), engine.model.linear): the loader's
contract, and an engine on them (reference FP8 linear with 1x128 activation quantisation on the CPU; DeepGEMM
on CUDA) against the engine on dequantised weights."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dsv4_kernels.fp8_linear import Fp8Weight, weight_from_checkpoint
from dsv4_kernels.quant import quant_fp8_block
from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from engine.loading.make_model import _QUANT_CONFIG, preset_config, quantize_weights, random_weights, write_tokenizer
from engine.loading.weights import load_weights
from engine.model import linear as engine_linear
from engine.model.config import ModelConfig
from engine.model.linear import FP8_LINEAR, grouped_projection, keeps_fp8, linear


def _fp8_config() -> dict:
    """The tiny preset widened so every FP8 projection is whole 128x128 blocks."""
    raw = preset_config("tiny")
    raw.update(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        qk_rope_head_dim=32,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        moe_intermediate_size=128,
        index_n_heads=4,
        index_head_dim=32,
        quantization_config=dict(_QUANT_CONFIG),
    )
    return raw


@pytest.fixture(scope="module")
def fp8_model_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fp8_model"))
    raw = _fp8_config()
    cfg = ModelConfig.from_dict(raw)
    save_file(quantize_weights(random_weights(cfg, seed=3)), os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(raw, fh)
    write_tokenizer(out, cfg.vocab_size)
    return out


def test_loader_keeps_fp8_projections(fp8_model_dir):
    cfg = ModelConfig.from_model_dir(fp8_model_dir)
    plain = load_weights(fp8_model_dir, cfg)
    kept = load_weights(fp8_model_dir, cfg, keep_fp8=True)
    fp8_names = [n for n in plain if FP8_LINEAR.search(n)]
    assert fp8_names and all(keeps_fp8(n, tuple(plain[n].shape), cfg.o_groups) for n in fp8_names)
    for name in fp8_names:
        w, s = kept[name], kept[name[: -len(".weight")] + ".scale"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert torch.equal(Fp8Weight(w, s).dequant(), plain[name])  # exact: the same bytes and scales
    assert set(kept) - set(plain) == {n[: -len(".weight")] + ".scale" for n in fp8_names}
    for name in set(plain) - set(fp8_names):
        assert torch.equal(kept[name], plain[name])


def test_keeps_fp8_rejects_partial_blocks():
    assert not keeps_fp8("layers.0.attn.wq_a.weight", (32, 64), 2)
    assert not keeps_fp8("layers.0.attn.wo_a.weight", (128, 128), 2)  # 64 rows a group
    assert not keeps_fp8("layers.0.attn.compressor.wkv.weight", (128, 128), 1)  # bf16 in the release
    assert keeps_fp8("layers.0.ffn.shared_experts.w2.weight", (256, 128), 1)


def test_linear_and_grouped_projection_dispatch():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=gen) * 0.1
    fw = weight_from_checkpoint(*quant_fp8_block(w, scale_fmt="ue8m0"))
    x = torch.randn(3, 2, 128, generator=gen)
    dense = fw.dequant()
    one, exact = linear(x[:, 0], fw), x[:, 0] @ dense.t()
    assert ((one - exact).norm() / exact.norm()).item() < 3e-2
    got = grouped_projection(x, fw, 2)
    want = grouped_projection(x, dense, 2)
    assert got.shape == want.shape == (3, 256)
    assert ((got - want).norm() / want.norm()).item() < 3e-2


def test_engine_on_fp8_weights_matches_dequantised(fp8_model_dir, monkeypatch):
    params = SamplingParams(max_new_tokens=4, prompt_logprobs=True)
    prompt = [5, 17, 99, 3, 250, 42, 7, 311, 8, 64, 120, 77]

    def run(**kw):
        out = LLM(fp8_model_dir, **kw).generate([prompt], params)[0]
        return torch.tensor(out.prompt_logprobs[1:])

    base = run(keep_fp8_weights=False)
    llm = LLM(fp8_model_dir, keep_fp8_weights=True)
    assert isinstance(llm.engine.model.attn[0].w["wq_a.weight"], Fp8Weight)
    assert isinstance(llm.engine.model.attn[0].w["wo_a.weight"], Fp8Weight)
    assert isinstance(llm.engine.model.moe[0].shared[0], Fp8Weight)
    assert "dense FP8 projections" in llm.engine.model.fast_paths
    fp8 = run(keep_fp8_weights=True)
    # FP8 activations are the only difference: finite, a modest shift on this random 4-layer model.
    assert torch.isfinite(fp8).all() and (fp8 - base).abs().mean().item() < 0.5
    # Without the activation rounding the FP8 engine computes exactly what the dequantised one does
    # (every projection is wired through engine.model.linear, nothing dropped or transposed).
    monkeypatch.setattr(engine_linear, "fp8_linear_ref", lambda x, w: (x.float() @ w.dequant().t()).to(x.dtype))
    assert torch.equal(run(keep_fp8_weights=True), base)
