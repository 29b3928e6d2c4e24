"""The engine's MTP draft layer(s) over a StepBatch (speculative decoding; docs: shared/docs/mtp.md section 1).

Layer i runs DeepSeek V4's MTPBlock on paged caches: its input at position t is the token at t+1 (the step's
`token_ids`: the batch is built with the next tokens) and the target's residual streams at t before hc_head
(`DeepseekV4Model.forward_streams`); e = enorm(embed(token)), h = hnorm(streams) per stream,
x = e_proj(e) broadcast + h_proj(h); then one V4 block whose attention is sliding-window only, run by the same
AttentionBlock / MoEBlock code as the main layers under layer id `num_layers + i`, which is also its slot in
the `swa` cache group (CacheConfig.mtp_layers): the MTP layer's KV lives in each request's ring page next to
the main layers' and rolls back, moves and snapshots with it. Logits: the layer's own hc_head and norm, then
the model's shared head. The plain-torch reference is dsv4_kernels.mtp (tests/engine/test_mtp_layer.py).
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4_kernels.norm import rms_norm
from engine.model.attention import AttentionBlock
from engine.model.batch import StepBatch
from engine.model.cache import CachePool
from engine.model.config import ModelConfig
from engine.model.linear import linear
from engine.model.model import head_input
from engine.model.moe import MoEBlock
from engine.model.parallel import vocab_embed

_BLOCK_KEYS = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
)


def mtp_block_config(cfg: ModelConfig) -> ModelConfig:
    """cfg with the MTP layers appended as layers num_layers.. (ratio 0: SWA only; score-routed MoE), so the
    main layers' block code builds them by layer id."""
    n = cfg.num_nextn_predict_layers
    return dataclasses.replace(
        cfg,
        num_layers=cfg.num_layers + n,
        compress_ratios=cfg.compress_ratios + (0,) * n,
        hash_layers=cfg.hash_layers + (False,) * n,
    )


class MtpLayer:
    """MTP layer `index` of `model` (a DeepseekV4Model); weights hold `mtp.{index}.*` (engine.loading.weights,
    mtp=True)."""

    def __init__(self, model, weights: dict, index: int):
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.layer = cfg.num_layers + index  # its id in the swa cache group
        p = f"mtp.{index}."
        own = {k[len(p) :]: v for k, v in weights.items() if k.startswith(p)}
        as_layer = {f"layers.{self.layer}.{k}": v for k, v in own.items()}
        ext = mtp_block_config(cfg)
        self.attn = AttentionBlock(ext, as_layer, self.layer, model.parallel.attention)
        self.moe = MoEBlock(ext, as_layer, self.layer, model.parallel)
        self.block = {k: own[k] for k in _BLOCK_KEYS}
        self.w = {
            k: own[k]
            for k in ("enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")
        }
        self.e_proj, self.h_proj = own["e_proj.weight"], own["h_proj.weight"]

    @torch.inference_mode()
    def forward(self, batch: StepBatch, pool: CachePool, hidden: torch.Tensor) -> torch.Tensor:
        """batch: the step built with the NEXT token of each position (token at t+1 at position t) over `pool`
        (made with CacheConfig.mtp_layers); hidden: [T, hc, D] the target's (or, chained, this layer's) streams
        at t -> this layer's output streams [T, hc, D] in the residual dtype."""
        model, eps = self.model, self.cfg.rms_norm_eps
        t, hc, d = hidden.shape
        emb = vocab_embed(model.embed, batch.token_ids, model.parallel.attention)
        e = linear(rms_norm(emb, self.w["enorm.weight"], eps).to(model.dtype), self.e_proj)  # [T, D]
        h = rms_norm(hidden, self.w["hnorm.weight"], eps).to(model.dtype).reshape(t * hc, d)  # per stream
        h = linear(h, self.h_proj).view(t, hc, d)
        streams = h.to(model.residual_dtype) + e.to(model.residual_dtype).unsqueeze(1)
        ropes = model.step_ropes(batch)
        x, qa, post, comb = model._hc(self.block, "attn", streams, self.attn.first_projection)
        out = self.attn.forward(x, batch, pool, ropes, qa)
        streams, x, qa, post, comb = model._post_then_hc(
            out, streams, post, comb, self.block, "ffn", self.moe.first_projection
        )
        out = self.moe.forward(x, batch.token_ids, qa=qa)
        return model._mhc(streams).hc_post(out, streams, post, comb)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """streams: [N, hc, D] (this layer's output) -> fp32 [N, vocab]: its own hc_head and norm, the shared head."""
        cfg, w, head = self.cfg, self.w, self.model.head
        x = head_input(
            streams, None, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], w["norm.weight"], cfg, head.dtype
        )
        return self.model.parallel.attention.gather_vocab((x @ head.t()).float(), cfg.vocab_size)
