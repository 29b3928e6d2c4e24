"""Random DeepSeek V4 checkpoints for tests, demos and CPU benchmarks.

`make_model(preset, out_dir)` writes a complete model directory the way DeepSeek ships one:
`config.json` in the LEGACY spelling (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling),
`model.safetensors` with the ORIGINAL tensor names (no `model.` prefix), and a small byte-level BPE
tokenizer (`tokenizer.json` + `tokenizer_config.json`). With `quantize=True` the dense projections are
FP8 e4m3 with 128x128 UE8M0 block scales and the routed experts MXFP4, each with a `.scale` companion,
following the V4 release (compressor, indexer weights_proj, router, embed and head stay unquantised).

`default_model_dir()` builds the "tiny" preset once into a cache dir and returns it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from dsv4_kernels.quant import quant_fp8_block, quant_mxfp4
from dsv4_kernels.settings import settings
from engine.loading.weights import expected_weight_shapes
from engine.model.config import ModelConfig

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
# The rest of V4's chat-format tokens, added after training (ids past the BPE vocabulary). Like V4's
# release the tokenizer ships no chat template: chat uses V4's encoding (service/chat_encoding.py).
THINK_TOKENS = ["<think>", "</think>"]  # plain added tokens: decoded text keeps them
V4_SPECIAL_TOKENS = [
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
]

_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "swiglu_limit": 10.0,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict] = {
    # Fast on CPU, yet every layer kind appears: SWA, CSA (ratio 4 + indexer), HCA (ratio 128).
    # 16 index heads: with few heads ReLU zeroes many indexer scores and top-k becomes a tie.
    "tiny": {
        **_COMMON,
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 128, 4],
        "num_hash_layers": 1,
        "sliding_window": 16,
        "num_attention_heads": 4,
        "head_dim": 32,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 2,
        "max_position_embeddings": 4096,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0,
            "mscale_all_dim": 0,
        },
    },
    # A CPU-sized benchmark model (~14M parameters) with the real hc_mult and a deeper schedule.
    "small": {
        **_COMMON,
        "vocab_size": 4096,
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "compress_ratios": [0, 4, 128, 4, 128, 4],
        "num_hash_layers": 2,
        "sliding_window": 64,
        "num_attention_heads": 8,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 128,
        "o_groups": 4,
        "o_lora_rank": 64,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 16,
        "hc_mult": 4,
        "max_position_embeddings": 16384,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0,
            "mscale_all_dim": 0,
        },
    },
    # V4's attention geometry (64 heads x 512 with RoPE 64, window 128, index 64 x 128 top-512, 128-wide
    # widths for the FP8 / MXFP4 blocks) with small widths elsewhere: the smallest model FlashMLA and the
    # default fp8 KV cache run on (a GPU preset; ~60M parameters).
    "mini_v4": {
        **_COMMON,
        "vocab_size": 4096,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 128, 4],
        "num_hash_layers": 1,
        "sliding_window": 128,
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 256,
        "o_groups": 8,
        "o_lora_rank": 128,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "max_position_embeddings": 65536,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0,
            "mscale_all_dim": 0,
        },
    },
}

# V4 quantisation layout: which original names are FP8 block-scaled / MXFP4 when quantize=True.
_FP8 = re.compile(
    r"\.attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$"
    r"|^mtp\.\d+\.[eh]_proj\.weight$"
)
_MXFP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
_FORMAT_VERSION = 2  # bump when the generated weights change, so cached default models are rebuilt

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "DeepSeek V4 compresses its key value cache with sparse attention.",
    "Once upon a time, there was a small model that answered questions.",
    "Hello, world! How are you today? I am fine, thank you.",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "A prefill worker hands its cache to a decode worker over the network.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
]


def preset_config(preset: str) -> dict:
    """A deep copy of the preset's config.json dict; ValueError naming the preset if unknown."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[preset])


def with_mtp_layers(raw: dict, n: int) -> dict:
    """A config.json dict with `n` MTP layers declared the way V4's release does (a copy; n = 0: unchanged)."""
    if n < 0:
        raise ValueError(f"mtp_layers must be >= 0, got {n}")
    if not n:
        return raw
    raw = copy.deepcopy(raw)
    raw["num_nextn_predict_layers"] = n
    ratios = raw.get("compress_ratios")
    if ratios is not None:
        raw["compress_ratios"] = list(ratios)[: raw["num_hidden_layers"]] + [0] * n  # the MTP slots: SWA only
    return raw


# ---- random weights ---------------------------------------------------------------------------
def _proj_std(fan_in: int) -> float:
    # ~unit-variance outputs for small widths, capped into the 0.02-0.1 range of trained weights.
    return min(0.1, max(0.02, 1.0 / math.sqrt(fan_in)))


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 random weights {original name: tensor} shaped by `expected_weight_shapes(cfg, mtp=True)`.

    Deterministic in `seed`; draws happen in the (stable) expected-name order, the MTP layers' last, so a
    model with MTP layers has the same main-model weights as one without.
    """
    g = torch.Generator().manual_seed(seed)

    def randn(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(cfg, mtp=True).items():
        leaf = name.rsplit(".", 1)[-1]  # hc_{attn,ffn}_{fn,base,scale}, hc_head_*, or "weight"
        if name == "embed.weight":
            t = randn(shape, 1.0)
        elif name.endswith("norm.weight"):
            t = randn(shape, 0.05, 1.0)  # RMSNorm gains near 1
        elif name.endswith("attn_sink"):
            t = randn(shape, 0.5)  # nonzero sinks so the sink column actually matters
        elif name.endswith(".ape"):
            t = randn(shape, 0.2)  # transformers inits to 0, which would hide position-bias bugs
        elif name.endswith("gate.bias"):
            t = randn(shape, 0.1)  # shifts selection without being the only thing that matters
        elif name.endswith("gate.tid2eid"):
            v, k = shape
            # k distinct experts per token: first k columns of a random permutation per row.
            t = torch.rand(v, cfg.n_routed_experts, generator=g).argsort(dim=1)[:, :k].to(torch.int64)
        elif leaf.endswith("_fn"):
            t = randn(shape, 0.02)  # transformers: normal(0, initializer_range)
        elif leaf.endswith("_base"):
            t = randn(shape, 0.1)  # transformers: zeros
        elif leaf.endswith("_scale"):
            t = randn(shape, 0.1, 1.0).clamp_min(0.5)  # transformers: ones
        elif name == "head.weight":
            t = randn(shape, 0.1)
        else:  # 2-D projections, router gate
            t = randn(shape, _proj_std(shape[-1]))
        out[name] = t.contiguous()
    return out


def quantize_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original-name weights -> the V4 release layout: FP8/MXFP4 tensors plus `.scale` companions."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        base = name[: -len(".weight")]
        if _MXFP4.search(name):
            # int8 packed bytes, as in DeepSeek's release (the seed loader views them as int8 too).
            out[name], out[base + ".scale"] = quant_mxfp4(t, packed_dtype=torch.int8)
        elif _FP8.search(name):
            out[name], out[base + ".scale"] = quant_fp8_block(t, scale_fmt="ue8m0")
        else:
            out[name] = t
    return out


# ---- tokenizer --------------------------------------------------------------------------------
def save_v4_tokenizer(tok, vocab_size: int, out_dir: str) -> None:
    """A trained byte-level BPE finished the V4 way (think tokens, the special tokens at their ids, BOS added like
    DeepSeek's tokenizer) and saved with its tokenizer_config.json into out_dir. ValueError when the vocabulary
    outgrows the model's `vocab_size`."""
    from tokenizers import AddedToken, processors

    tok.add_tokens([AddedToken(t, normalized=False) for t in THINK_TOKENS])
    tok.add_special_tokens(V4_SPECIAL_TOKENS)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer vocab {tok.get_vocab_size()} exceeds model vocab {vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(tok_cfg, fh, indent=2, ensure_ascii=False)


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """Train a byte-level BPE on a few built-in sentences; write tokenizer.json + tokenizer_config.json.

    Ids: 0 = BOS, 1 = EOS, 2/3 = chat role markers, then the BPE vocabulary, then V4's other chat tokens
    (think markers, latest_reminder, task tokens); the vocabulary never exceeds `vocab_size`.
    """
    train_v4_tokenizer(_CORPUS * 4, vocab_size, out_dir)


def train_v4_tokenizer(texts, vocab_size: int, out_dir: str) -> None:
    """A byte-level BPE trained on `texts` with V4's special tokens (save_v4_tokenizer), written into `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS) - len(V4_SPECIAL_TOKENS),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    save_v4_tokenizer(tok, vocab_size, out_dir)


# ---- model directories --------------------------------------------------------------------------
def make_model(
    preset: str, out_dir: str | os.PathLike, seed: int = 0, quantize: bool = False, mtp_layers: int = 0
) -> str:
    """Write config.json, model.safetensors and the tokenizer for `preset` into `out_dir`; return it.

    The same (preset, seed) gives the same underlying weights whether or not `quantize` is set, so a
    quantised model can be compared with its unquantised source. mtp_layers: N adds N random MTP draft layers
    (`mtp.{i}.*`, as V4's release ships them) with `num_nextn_predict_layers: N` and N trailing 0 entries in
    `compress_ratios`; the main model's weights are those of the same preset and seed without them.
    """
    raw = with_mtp_layers(preset_config(preset), mtp_layers)
    if quantize:
        raw["quantization_config"] = dict(_QUANT_CONFIG)
    cfg = ModelConfig.from_dict(raw)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    weights = random_weights(cfg, seed)
    if quantize:
        weights = quantize_weights(weights)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(raw, fh, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}, fh, indent=2)
    write_tokenizer(out_dir, cfg.vocab_size)
    return out_dir


def _stamp(preset: str, seed: int) -> str:
    blob = json.dumps({"preset": PRESETS[preset], "seed": seed, "v": _FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _is_current(path: str, stamp: str) -> bool:
    try:
        with open(os.path.join(path, ".dsv4_stamp")) as fh:
            return fh.read().strip() == stamp
    except OSError:
        return False


def default_model_dir() -> str:
    """The built-in tiny model: `$DSV4_HOME/tiny` (default `~/.cache/dsv4/tiny`), built on first use.

    The model is built in a temp dir next to the target and renamed into place, so concurrent first
    uses never see a half-written directory; the loser of the race discards its copy. A stamp file
    (hash of the preset + format version) makes a stale cache from an older preset get rebuilt.
    """
    home = os.path.expanduser(settings().home or os.path.join("~", ".cache", "dsv4"))
    target = os.path.join(home, "tiny")
    stamp = _stamp("tiny", 0)
    if _is_current(target, stamp):
        return target
    os.makedirs(home, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-build-", dir=home)
    try:
        make_model("tiny", tmp, seed=0)
        with open(os.path.join(tmp, ".dsv4_stamp"), "w") as fh:
            fh.write(stamp)
        for _ in range(3):
            try:
                os.rename(tmp, target)  # atomic; fails if target exists (non-empty dir)
                return target
            except OSError:
                if _is_current(target, stamp):
                    return target  # another process won the race
                # A stale or broken cache: move it aside (atomic) and retry the rename.
                stale = tempfile.mkdtemp(prefix=".tiny-stale-", dir=home)
                try:
                    os.rename(target, os.path.join(stale, "old"))
                except OSError:
                    pass  # someone else moved it already
                shutil.rmtree(stale, ignore_errors=True)
        raise RuntimeError(f"could not install the default model into {target!r}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
