"""Step 2 (GPU, or a short CPU smoke run): train dsv4-mini-py with transformers' DeepseekV4ForCausalLM.

    python3 -m training.train --data .cache/dsv4_train --device cuda --minutes 6 --out $OUT/run

Needs torch, numpy and transformers >= 5.23 (the model itself: the project's correctness oracle, so what is
trained is V4 as transformers defines it, and the exported checkpoint is checked against it). Reads the token
arrays of `training.prepare` (no tokenizer needed here). Writes into --out: `state-NN.pt` (the fp32 state dict
in transformers' names, split into files of <= 12 MiB: the device tool brings back files of at most 16 MiB),
`config.json` and `train_log.json` (every logged step's loss, held-out loss and bits per byte, tokens seen,
throughput, the arguments). Saved every `--save-every-s` seconds and at the end, so a run stopped at its time
limit still leaves a checkpoint.

What the model learns and does not: next-token prediction with AdamW on random windows of the training split
(seeded: same data order and init for the same --seed). The router biases of score-routed layers follow V4's
auxiliary-loss-free balancing (bias += rate * sign(mean load - expert load) after each step); hash layers route
by a seeded random `tid2eid` table. The lightning indexer gets no gradient through its top-k (V4 trains it with
a separate distillation loss, which this trainer does not have), so its weights stay at their seeded init.
With --mtp-weight > 0 (default 0.3) one MTP layer (training.mtp_head: the engine's reference MTP forward) learns
to predict token t+2 from the pre-hc_head streams at t and the embedding of t+1, on the first --mtp-rows
sequences of each batch; its loss is added with that weight (it also trains the shared embedding, head and trunk).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from training.mini_config import mini_config
from training.mtp_head import MtpHead, StreamTap, mtp_config

MAX_SHARD_BYTES = 12 << 20


@dataclass(frozen=True)
class TrainArgs:
    data: str
    out: str
    device: str = "cuda"
    minutes: float = 6.0
    max_steps: int = 0  # 0: as many as the time allows; the LR schedule follows max(step, time) progress
    seq_len: int = 1024
    batch: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    bias_rate: float = 1e-3
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 16
    save_every_s: float = 120.0
    mtp_weight: float = 0.3  # 0: no MTP layer
    mtp_rows: int = 8  # sequences of a batch the MTP layer trains on (it runs one sequence at a time)
    bf16: int = 1  # 1: bf16 autocast on CUDA (fp32 master weights); 0: fp32 (TF32 matmuls)


def _transformers():
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as exc:  # the GPU image's own transformers is older than V4
        raise SystemExit(
            f"training.train needs transformers >= 5.23 with DeepseekV4ForCausalLM ({exc}); on the GPU machine "
            "carry the wheels that training/README.md lists and install them with pip --target"
        ) from exc
    return DeepseekV4Config, DeepseekV4ForCausalLM


def build_model(seed: int, raw: dict | None = None):
    """A freshly initialised DeepseekV4ForCausalLM (fp32) for the mini config, seeded; hash tables drawn."""
    config_cls, model_cls = _transformers()
    raw = raw or mini_config()
    cfg = config_cls.from_dict(raw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    # The per-expert loop: autocast covers its F.linear, while torch._grouped_mm on CUDA wants matching bf16
    # operands (fp32 master weights under autocast would not be), and the 8 experts make the loop cheap.
    model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in model.modules():
            if hasattr(mod, "tid2eid"):  # transformers leaves it zero: every token would pick expert 0 twice
                k = mod.tid2eid.shape[1]
                rows = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen).argsort(dim=1)[:, :k]
                mod.tid2eid.copy_(rows.to(mod.tid2eid.dtype))
    return model


class Windows:
    """Random (seeded) training windows and fixed held-out windows of T + 1 tokens."""

    def __init__(self, data_dir: str, seq_len: int, seed: int):
        self.train = np.load(os.path.join(data_dir, "train.npy"), mmap_mode="r")
        self.heldout = np.load(os.path.join(data_dir, "heldout.npy"), mmap_mode="r")
        with open(os.path.join(data_dir, "manifest.json")) as fh:
            m = json.load(fh)
        self.heldout_bytes_per_token = m["heldout"]["bytes"] / m["heldout"]["tokens"]
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)

    def batch(self, n: int) -> torch.Tensor:
        starts = self.rng.integers(0, len(self.train) - self.seq_len - 1, size=n)
        return torch.from_numpy(np.stack([self.train[s : s + self.seq_len + 1] for s in starts]).astype(np.int64))

    def heldout_batch(self, n: int) -> torch.Tensor:
        """The first n non-overlapping windows of the held-out split (the same every eval)."""
        n = min(n, (len(self.heldout) - 1) // self.seq_len)
        w = [self.heldout[i * self.seq_len : (i + 1) * self.seq_len + 1] for i in range(n)]
        return torch.from_numpy(np.stack(w).astype(np.int64))


def lm_loss(model, ids: torch.Tensor, autocast: bool) -> torch.Tensor:
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


class LoadBalancer:
    """V4's auxiliary-loss-free balancing: count each score-routed layer's picks, nudge its bias after a step."""

    def __init__(self, model, rate: float):
        self.rate = rate
        self.counts: dict[torch.nn.Module, torch.Tensor] = {}
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.register_forward_hook(self._hook)

    def _hook(self, mod, _inputs, outputs):
        indices = outputs[2]
        c = torch.bincount(indices.reshape(-1), minlength=mod.num_experts).float()
        self.counts[mod] = self.counts.get(mod, 0) + c

    @torch.no_grad()
    def step(self) -> float:
        """Apply the update; -> the worst max/mean load ratio seen this step (1.0 = perfectly balanced)."""
        worst = 1.0
        for mod, c in self.counts.items():
            mod.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            worst = max(worst, float(c.max() / c.mean().clamp_min(1e-9)))
        self.counts.clear()
        return worst


def lr_at(a: TrainArgs, step: int, progress: float) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * cos)


def param_groups(model, weight_decay: float):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(model, windows: Windows, a: TrainArgs, device, autocast: bool, mtp=None, tap=None) -> dict:
    model.eval()
    ids = windows.heldout_batch(a.eval_windows)
    losses, mtp_losses = [], []
    for i in range(0, len(ids), 4):
        chunk = ids[i : i + 4].to(device)
        losses.append(float(lm_loss(model, chunk, autocast)))
        if mtp is not None:
            mtp_losses.append(
                float(mtp.loss(tap.streams, chunk, model.model.embed_tokens.weight, model.lm_head.weight, rows=1))
            )
    model.train()
    loss = sum(losses) / len(losses)
    out = {"heldout_loss": loss, "heldout_bits_per_byte": loss / math.log(2) / windows.heldout_bytes_per_token}
    if mtp_losses:
        out["heldout_mtp_loss"] = sum(mtp_losses) / len(mtp_losses)
    return out


def save_state(model, out: str, mtp=None) -> list[str]:
    """The fp32 state dict (+ the MTP layer's `mtp.0.*` tensors) in shards of <= MAX_SHARD_BYTES (whole
    tensors), written atomically."""
    shards, cur, size = [], {}, 0
    tensors = dict(model.state_dict())
    if mtp is not None:
        tensors.update(mtp.checkpoint_weights())
    for name, t in tensors.items():
        t = t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > MAX_SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += nbytes
    shards.append(cur)
    names = []
    for i, shard in enumerate(shards):
        name = f"state-{i:02d}.pt"
        torch.save(shard, os.path.join(out, name + ".tmp"))
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
        names.append(name)
    return names


def load_state(run_dir: str) -> dict[str, torch.Tensor]:
    """Every saved tensor: the model's (transformers' names) and the MTP layer's (`mtp.0.*`)."""
    state: dict[str, torch.Tensor] = {}
    for name in sorted(f for f in os.listdir(run_dir) if f.startswith("state-") and f.endswith(".pt")):
        state.update(torch.load(os.path.join(run_dir, name), map_location="cpu", weights_only=True))
    return state


def train(a: TrainArgs) -> dict:
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    autocast = device.type == "cuda" and bool(a.bf16)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(a.seed).to(device).train()
    mtp = MtpHead(mini_config(), a.seed).to(device) if a.mtp_weight > 0 else None
    tap = StreamTap(model) if mtp is not None else None
    windows = Windows(a.data, a.seq_len, a.seed)
    balancer = LoadBalancer(model, a.bias_rate)
    groups = param_groups(model, a.weight_decay)
    if mtp is not None:
        groups += param_groups(mtp, a.weight_decay)
    opt = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
    )
    with open(os.path.join(a.out, "config.json"), "w") as fh:
        json.dump(mtp_config(mini_config()) if mtp is not None else mini_config(), fh, indent=2)
    log = {"args": asdict(a), "params": sum(p.numel() for p in model.parameters()), "steps": []}
    budget = a.minutes * 60.0
    start = last_save = time.time()
    step, tokens = 0, 0
    while True:
        elapsed = time.time() - start
        progress = max(elapsed / budget, step / a.max_steps if a.max_steps else 0.0)
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(a, step, progress)
        ids = windows.batch(a.batch).to(device)
        loss = lm_loss(model, ids, autocast)
        mtp_loss = None
        if mtp is not None:
            mtp_loss = mtp.loss(tap.streams, ids, model.model.embed_tokens.weight, model.lm_head.weight, a.mtp_rows)
        opt.zero_grad(set_to_none=True)
        (loss if mtp_loss is None else loss + a.mtp_weight * mtp_loss).backward()
        params = [p for g in opt.param_groups for p in g["params"]]
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        imbalance = balancer.step()
        step += 1
        _STARTED.add(a.out)
        tokens += a.batch * a.seq_len
        if step % a.eval_every == 0 or step == 1:
            row = {
                "step": step,
                "loss": float(loss.detach()),
                "mtp_loss": None if mtp_loss is None else float(mtp_loss.detach()),
                "lr": opt.param_groups[0]["lr"],
                "grad_norm": gnorm,
                "max_over_mean_load": imbalance,
                "tokens": tokens,
                "elapsed_s": round(time.time() - start, 1),
                **evaluate(model, windows, a, device, autocast, mtp, tap),
            }
            log["steps"].append(row)
            print(json.dumps(row), flush=True)
        if time.time() - last_save > a.save_every_s:
            save_state(model, a.out, mtp)
            last_save = time.time()
    final = {
        "step": step,
        "tokens": tokens,
        "elapsed_s": round(time.time() - start, 1),
        "tokens_per_s": round(tokens / max(1e-9, time.time() - start)),
        **evaluate(model, windows, a, device, autocast, mtp, tap),
    }
    log["final"] = final
    print(json.dumps({"final": final}), flush=True)
    log["shards"] = save_state(model, a.out, mtp)
    with open(os.path.join(a.out, "train_log.json"), "w") as fh:
        json.dump(log, fh, indent=1)
    return log


_STARTED: set[str] = set()  # runs that completed a step (a later failure is not retried)


def train_with_fallbacks(a: TrainArgs) -> dict:
    """A run that fails before its first step completes (an op missing on this GPU / torch build) is retried
    in fp32, then also without the MTP layer, so a one-shot GPU session still trains; each failure is printed."""
    ladder = [a, replace(a, bf16=0), replace(a, bf16=0, mtp_weight=0.0)]
    for i, attempt in enumerate(ladder):
        try:
            return train(attempt)
        except Exception:
            if a.out in _STARTED or i == len(ladder) - 1:
                raise
            traceback.print_exc()
            print(json.dumps({"fallback": asdict(ladder[i + 1])}), flush=True)
    raise AssertionError("unreachable")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainArgs(data="", out="")
    for field, value in asdict(defaults).items():
        flag = "--" + field.replace("_", "-")
        if field in ("data", "out"):
            ap.add_argument(flag, required=True)
        else:
            ap.add_argument(flag, type=type(value), default=value)
    train_with_fallbacks(TrainArgs(**vars(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
