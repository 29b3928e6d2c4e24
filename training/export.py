"""Step 3 (CPU): a training run's state dict -> a model dir in V4's release format.

    python -m training.export --run RUN_DIR --data .cache/dsv4_train --out models/dsv4-mini-py

The trained transformers model is written with `save_pretrained` (transformers' own names), read back by the
engine's loader (`load_weights`: original DeepSeek names, experts split), then stored the way DeepSeek ships V4
(`engine.loading.make_model.quantize_weights`): dense projections FP8 e4m3 with 128x128 UE8M0 block scales,
routed experts MXFP4, each with a `.scale` companion (the MTP layer's `mtp.0.*` alike, when the run trained
one); the remaining large tensors (embedding, head, compressor and indexer projections, router) in bf16, and in
fp32 the small ones and those the engine keeps in fp32 (norms, mHC, sinks, position biases, router bias:
`engine.loading.weights.keeps_fp32`). config.json carries the release's quantization_config (and
num_nextn_predict_layers with an MTP layer); the tokenizer comes from the data dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from engine.loading.make_model import quantize_weights
from engine.loading.weights import keeps_fp32, load_weights
from engine.model.config import ModelConfig
from training.mini_config import mini_config
from training.mtp_head import PREFIX as MTP_PREFIX
from training.mtp_head import mtp_config
from training.train import build_model, load_state

QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
BF16_MIN_NUMEL = 1 << 14  # smaller float tensors stay fp32: they feed fp32 maths and cost nothing
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def original_weights(state: dict[str, torch.Tensor], raw: dict) -> dict[str, torch.Tensor]:
    """transformers state dict -> {original DeepSeek name: fp32 tensor}, through save_pretrained + our loader."""
    model = build_model(0, raw)
    model.load_state_dict(state, strict=True)  # raises on any missing or unexpected name
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return load_weights(tmp, ModelConfig.from_dict(raw), dtype=torch.float32, progress=False)


def release_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in quantize_weights(weights).items():
        if t.dtype == torch.float32 and t.numel() >= BF16_MIN_NUMEL and not keeps_fp32(name):
            t = t.to(torch.bfloat16)
        out[name] = t.contiguous()
    return out


def export(run_dir: str, data_dir: str, out_dir: str) -> str:
    raw = mini_config()
    state = load_state(run_dir)
    mtp = {k: state.pop(k) for k in [k for k in state if k.startswith(MTP_PREFIX)]}
    weights = original_weights(state, raw)
    if mtp:  # already in checkpoint names; the config declares the layer (num_nextn_predict_layers)
        weights.update(mtp)
        raw = mtp_config(raw)
    raw["quantization_config"] = dict(QUANT_CONFIG)
    os.makedirs(out_dir, exist_ok=True)
    save_file(release_tensors(weights), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(raw, fh, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}, fh, indent=2)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(data_dir, name), os.path.join(out_dir, name))
    log_path = os.path.join(run_dir, "train_log.json")
    if os.path.exists(log_path):
        with open(log_path) as fh:
            log = json.load(fh)
        summary = {
            "args": log["args"],
            "params": log["params"],
            "final": log.get("final"),
            "curve": [
                {k: r[k] for k in ("step", "loss", "heldout_loss", "heldout_bits_per_byte", "tokens")}
                for r in log["steps"]
            ],
        }
        with open(os.path.join(out_dir, "training.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    return out_dir


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the train run's --out dir (state-NN.pt, train_log.json)")
    ap.add_argument("--data", required=True, help="training.prepare's --out dir (the tokenizer)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = export(args.run, args.data, args.out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
