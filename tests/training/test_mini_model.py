"""dsv4-mini-py (training/): the corpus split, the release-format export, and the exported model read by our
engine and by transformers, the engine's reference path agreeing with transformers' full forward on it.

Checkpoints under test: `fresh` (always): a seeded untrained model through the same export code, so the pipeline
is checked on every machine; `trained` (when models/dsv4-mini-py exists): the committed trained model, which
must also predict held-out stdlib text far better than chance. transformers cannot read the FP8 release file
on a CPU (its FP8 quantizer needs accelerate and a GPU), so it reads the same weights dequantised by our loader,
with the release's config.json (less quantization_config) and tokenizer; the engine reads the release dir.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from tests.support.oracle import oracle_logprobs, share_within
from training import corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINED_DIR = os.path.join(ROOT, "models", "dsv4-mini-py")
PROMPT_TOKENS = 300  # > 2 x 128: two HCA entries, 75 CSA windows for a top-16 indexer, window 64
LP_TOL = 2e-3
MIN_SHARE = 0.99
KINDS = ["fresh"] + (["trained"] if os.path.isdir(TRAINED_DIR) else [])


def test_split_is_fixed_and_disjoint():
    files = corpus.list_files()
    rels = [f.rel for f in files]
    assert rels == sorted(rels) and len(set(rels)) == len(rels)
    held = [f for f in files if f.heldout]
    assert 0.02 < len(held) / len(files) < 0.08, len(held)
    assert all(corpus.is_heldout(f.rel) == f.heldout for f in files)
    assert not any("site-packages" in f.rel for f in files)
    # The rule depends on the path alone: a name's side never changes between runs or machines.
    assert corpus.is_heldout("json/decoder.py") == corpus.is_heldout("json/decoder.py")
    assert {corpus.is_heldout(f"x{i}.py") for i in range(200)} == {True, False}


def _fresh_release(tmp) -> str:
    from training.export import export
    from training.mini_config import mini_config
    from training.mtp_head import MtpHead
    from training.tokenizer_train import train_tokenizer
    from training.train import build_model, save_state

    data, run = os.path.join(tmp, "data"), os.path.join(tmp, "run")
    os.makedirs(run)
    texts = [corpus.read_text(f.path) for f in corpus.list_files() if not f.heldout][:40]
    train_tokenizer([t for t in texts if t], 4096, data)
    model = build_model(seed=3)
    with torch.no_grad():  # transformers' 0.02 init gives near-uniform logits, where every path agrees
        torch.manual_seed(3)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.35)
    save_state(model, run, MtpHead(mini_config(), seed=3))
    return export(run, data, os.path.join(tmp, "release"))


def _dequantised_twin(release: str, out: str) -> str:
    """The release's weights as our loader dequantises them, saved unquantised with its config and tokenizer."""
    with open(os.path.join(release, "config.json")) as fh:
        raw = json.load(fh)
    weights = load_weights(release, ModelConfig.from_dict(raw), dtype=torch.float32, progress=False)
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"))
    raw.pop("quantization_config")
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(raw, fh)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(release, name), os.path.join(out, name))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, tuple[str, str]] = {}

    def get(kind: str) -> tuple[str, str]:
        if kind not in made:
            tmp = str(tmp_path_factory.mktemp(kind))
            release = _fresh_release(tmp) if kind == "fresh" else TRAINED_DIR
            made[kind] = (release, _dequantised_twin(release, os.path.join(tmp, "twin")))
        return made[kind]

    return get


def _heldout_prompt(tok) -> tuple[str, list[int]]:
    for f in corpus.list_files():
        text = corpus.read_text(f.path) if f.heldout else None
        ids = tok.encode(text) if text else []
        if len(ids) >= PROMPT_TOKENS:
            return f.rel, ids[:PROMPT_TOKENS]
    raise AssertionError("no held-out stdlib file has enough tokens")


def test_release_format(models):
    from safetensors import safe_open

    release, _ = models("fresh")
    with safe_open(os.path.join(release, "model.safetensors"), "pt") as fh:
        dtypes = {k: fh.get_slice(k).get_dtype() for k in fh.keys()}
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.0.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert dtypes["layers.2.ffn.experts.7.w1.weight"] == "I8"  # MXFP4: two e2m1 a byte
    assert "layers.2.ffn.experts.7.w1.scale" in dtypes and "layers.1.attn.wq_b.scale" in dtypes
    assert dtypes["embed.weight"] == "BF16" and dtypes["layers.0.hc_attn_fn"] == "F32"
    assert "layers.0.ffn.gate.tid2eid" in dtypes and "layers.2.ffn.gate.bias" in dtypes
    assert dtypes["mtp.0.e_proj.weight"] == "F8_E4M3" and dtypes["mtp.0.ffn.experts.0.w2.weight"] == "I8"
    assert json.load(open(os.path.join(release, "config.json")))["num_nextn_predict_layers"] == 1
    assert {r for r in json.load(open(os.path.join(release, "config.json")))["compress_ratios"]} == {0, 4, 128}


@pytest.mark.parametrize("kind", KINDS)
def test_engine_matches_transformers(kind, models):
    from transformers import DeepseekV4Config, PreTrainedTokenizerFast

    from engine.execution.sampling_params import SamplingParams
    from engine.llm import LLM
    from engine.loading.tokenizer import load_tokenizer

    release, twin = models(kind)
    tok = load_tokenizer(release)
    rel, ids = _heldout_prompt(tok)
    # transformers reads the release's config and tokenizer as shipped.
    hf_cfg = DeepseekV4Config.from_pretrained(release)
    assert hf_cfg.layer_types[:3] == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert set(hf_cfg.mlp_layer_types) == {"hash_moe", "moe"}
    text = corpus.read_text(os.path.join(corpus.stdlib_root(), rel))
    assert PreTrainedTokenizerFast.from_pretrained(release)(text[:2000]).input_ids == tok.encode(text[:2000])

    with LLM(model_dir=release, device="cpu", dtype="float32", max_batch_tokens=128) as llm:
        out = llm.generate([ids], SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True))[0]
    ref = oracle_logprobs(twin, ids)
    diffs = [abs(out.prompt_logprobs[i] - float(ref[i - 1, ids[i]])) for i in range(1, len(ids))]
    share = share_within(diffs, LP_TOL)
    assert float(ref[:, :].max(dim=-1).values.exp().mean()) > 0.02, "near-uniform logits: the check would be void"
    assert share >= MIN_SHARE, (kind, rel, share, max(diffs))
    assert out.token_ids[0] == int(torch.argmax(ref[-1])) or float(ref[-1].max() - ref[-1, out.token_ids[0]]) < 1e-3
    if kind == "trained":
        nll = -sum(out.prompt_logprobs[1:]) / (len(ids) - 1)
        # Trained, not a quality bar: chance is ln(4096) = 8.3 nats a token, the shipped model's held-out mean is 3.5;
        # one 300-token window of one file varies around it (4.3 on _py_abc.py).
        assert nll < 0.6 * math.log(hf_cfg.vocab_size), (rel, nll)


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_decoding_keeps_tokens(kind, models):
    """The MTP layer drafts, the target decides: greedy tokens are those of plain decoding."""
    from engine.execution.sampling_params import SamplingParams
    from engine.llm import LLM
    from engine.loading.tokenizer import load_tokenizer

    release, _ = models(kind)
    prompt = load_tokenizer(release).encode("import os\n\n\ndef main(argv):\n    ")
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(model_dir=release, device="cpu", dtype="float32") as llm:
        plain = llm.generate([prompt], params)[0]
    with LLM(model_dir=release, device="cpu", dtype="float32", speculative_tokens=1) as llm:
        spec = llm.generate([prompt], params)[0]
    assert spec.token_ids == plain.token_ids
    assert spec.drafted_tokens > 0
    if kind == "trained":  # a trained MTP layer's drafts are right more often than a random one's never
        assert spec.accepted_tokens > 0, (spec.drafted_tokens, spec.accepted_tokens)
