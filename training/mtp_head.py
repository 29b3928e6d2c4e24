"""The MTP layer trained beside dsv4-mini-py: predicts token t+2 from the target's pre-hc_head streams at t and
the embedding of token t+1 (V4's multi-token prediction; shared/docs/mtp.md).

The forward is `dsv4_kernels.mtp.mtp_layer_reference`, the plain-torch reference the engine's MTP layer
(engine.model.mtp) is tested against, so what is trained is exactly what the engine drafts with. Its tensors
carry the checkpoint's names relative to `mtp.0.` (dots spelled `__` inside the ParameterDict); the embedding and
the LM head are the main model's (shared, as in V4), so the MTP loss also trains them and the trunk.
It runs in fp32 outside autocast (the reference mixes dtypes on purpose) and one sequence at a time.
"""

from __future__ import annotations

import torch

from dsv4_kernels.mtp import MtpSpec, mtp_layer_reference
from engine.loading.make_model import with_mtp_layers
from engine.loading.weights import expected_weight_shapes
from engine.model.config import ModelConfig

PREFIX = "mtp.0."


def mtp_config(raw: dict) -> dict:
    """The config.json dict with one MTP layer declared the way V4's release does."""
    return with_mtp_layers(raw, 1)


def _init(name: str, shape, gen: torch.Generator, std: float) -> torch.Tensor:
    if name.endswith("norm.weight") or name.endswith("_scale"):
        return torch.ones(shape)
    if name.endswith("_base") or name.endswith("attn_sink") or name.endswith("gate.bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * std


class MtpHead(torch.nn.Module):
    def __init__(self, raw: dict, seed: int, std: float = 0.02):
        super().__init__()
        cfg = ModelConfig.from_dict(mtp_config(raw))
        self.spec = MtpSpec.of(cfg)
        gen = torch.Generator().manual_seed(seed + 2)
        self.params = torch.nn.ParameterDict()
        for name, shape in expected_weight_shapes(cfg, mtp=True).items():
            if name.startswith(PREFIX):
                rel = name[len(PREFIX) :]
                # gate.bias is V4's balancing bias, not a learnt weight: it stays zero here.
                self.params[rel.replace(".", "__")] = torch.nn.Parameter(
                    _init(rel, shape, gen, std), requires_grad=not rel.endswith("gate.bias")
                )

    def weights(self) -> dict[str, torch.Tensor]:
        """{name relative to `mtp.0.`: tensor}, as the reference takes them."""
        return {k.replace("__", "."): v for k, v in self.params.items()}

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        return {PREFIX + k: v.detach().float().cpu() for k, v in self.weights().items()}

    def loss(
        self, streams: torch.Tensor, ids: torch.Tensor, embed: torch.Tensor, head: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """streams: [B, T, hc, D] target streams for input ids[:, :T]; ids: [B, T + 1] -> mean CE of predicting
        ids[:, t + 2] at t = 0 .. T-2, over the first `rows` sequences."""
        w, t = self.weights(), streams.shape[1]
        positions = torch.arange(t - 1, device=ids.device)
        losses = []
        with torch.autocast(device_type=ids.device.type, enabled=False):
            for b in range(min(rows, ids.shape[0])):
                _, logits = mtp_layer_reference(
                    w, self.spec, embed.float(), head.float(), ids[b, 1:t], streams[b, :-1].float(), positions
                )
                losses.append(torch.nn.functional.cross_entropy(logits, ids[b, 2 : t + 1]))
        return torch.stack(losses).mean()


class StreamTap:
    """Keeps the input of the model's hc_head (the pre-hc_head streams) from the last forward."""

    def __init__(self, model):
        self.streams: torch.Tensor | None = None
        model.model.hc_head.register_forward_hook(self._hook)

    def _hook(self, _mod, inputs, _output):
        self.streams = inputs[0]
