"""A transformers oracle checkpoint whose FP8 projections are whole 128x128 blocks, and its FP8 twin.

`make_fp8_pair(root, seed)` writes two checkpoint dirs of the same model:
- oracle: transformers' fp32 checkpoint (tests.support.oracle) with every projection the release stores in
  FP8 (engine.model.linear.FP8_LINEAR) replaced by its FP8-rounded value (128x128 block scales, UE8M0), so the
  oracle computes what an FP8 checkpoint means with exact activations;
- fp8: the same tensors, those projections stored as e4m3 + `weight_scale_inv` block scales (fp32 values),
  which the loader keeps as FP8 (engine.loading.weights, keep_fp8).
An engine on `fp8` differs from the oracle by its activation quantisation (and its dtype) only.
"""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from dsv4_kernels.quant import dequant_fp8_block, quant_fp8_block, ue8m0_to_float
from engine.loading.weights import canonical_name
from engine.model.linear import FP8_LINEAR
from tests.support import oracle

# Every FP8 projection in whole 128-blocks (wo_a: 2 groups of 128 rows over 128 features). Init scales of
# trained-like weights (0.02, head 0.2): with the oracle's default 0.08 / 0.35 at these widths the random model
# is so sensitive that even the bf16 engine misses the bf16 tolerances (measured: 68% within 0.1 nats on the
# H200), and FP8 activations move logprobs by ~0.8 nats on average, in the compiled and the reference FP8 paths
# alike.
FP8_OVERRIDES = dict(
    hidden_size=256,
    num_attention_heads=2,
    head_dim=128,
    qk_rope_head_dim=16,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=128,
    moe_intermediate_size=128,
    compress_ratios=[0, 4, 16, 4],
    index_topk=3,
    init_std=0.02,
    head_std=0.2,
)


def make_fp8_pair(root, seed: int = 21) -> tuple[str, str]:
    """-> (oracle_dir, fp8_dir) under `root` (see the module docstring)."""
    root = os.fspath(root)
    oracle_dir = oracle.make_hf_checkpoint(os.path.join(root, "oracle"), seed=seed, **FP8_OVERRIDES)
    path = os.path.join(oracle_dir, "model.safetensors")
    tensors = load_file(path)
    rounded, fp8 = dict(tensors), dict(tensors)
    for raw, t in tensors.items():
        name = canonical_name(raw)
        if name is None or not FP8_LINEAR.search(name):
            continue
        q, s = quant_fp8_block(t.float(), scale_fmt="ue8m0")
        rounded[raw] = dequant_fp8_block(q, s).to(t.dtype)
        fp8[raw] = q
        fp8[raw[: -len(".weight")] + ".weight_scale_inv"] = ue8m0_to_float(s)
    save_file(rounded, path, metadata={"format": "pt"})
    oracle._MODELS.pop(os.path.realpath(oracle_dir), None)  # the oracle must reload the rounded weights
    fp8_dir = os.path.join(root, "fp8")
    shutil.copytree(oracle_dir, fp8_dir, dirs_exist_ok=True)
    save_file(fp8, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    return oracle_dir, fp8_dir


def prompts(seed: int = 21, lens=(3, 17, 40, 61), vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def oracle_diffs(model_dir, prompt_list, outs) -> list[float]:
    """|engine - oracle| logprob per prompt and generated position (teacher forcing on the engine's tokens)."""
    import math

    diffs = []
    for prompt, out in zip(prompt_list, outs):
        ref = oracle.teacher_forced(model_dir, prompt, out.token_ids)
        diffs += [
            abs(e - o) if math.isfinite(e) else math.inf for e, o in zip(out.prompt_logprobs[1:], ref.prompt_lp[1:])
        ]
        diffs += [abs(e - o) if math.isfinite(e) else math.inf for e, o in zip(out.logprobs, ref.gen_lp)]
    return diffs
