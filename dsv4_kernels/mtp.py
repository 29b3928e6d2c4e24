"""Plain-torch reference of DeepSeek V4's multi-token-prediction (MTP) layer (docs: shared/docs/mtp.md section 1).

One MTP step at position t takes the token id at t+1 and the target's residual streams at t taken BEFORE its
hc_head (all hc_mult streams, [T, hc, D]):
1. e = enorm(embed(token)); h = hnorm(streams), the norm over D applied to each stream;
2. x = e_proj(e) broadcast onto every stream + h_proj(h) per stream -> [T, hc, D];
3. one V4 block on those streams: mHC pre/post around an attention that is sliding-window only (compress
   ratio 0: no compressor, no indexer) and around a score-routed MoE (gate.bias, no tid2eid) + shared expert;
4. the block's output streams are kept (the hidden input of the next chained step); logits come from the MTP
   layer's OWN hc_head, then `mtp.{i}.norm`, then the model's shared LM head (`head.weight`).

`mtp_layer_reference` runs a whole sequence at once (causal, window mask): a chained draft step at position
n is the same call on the sequence extended by one row (token = the previous draft, hidden = the layer's own
output at n - 1), because every row only sees rows before it. The engine's paged implementation
(engine.model.mtp) is tested against it; a trainer can call it directly (weights named as in the checkpoint,
relative to `mtp.{i}.`: `enorm.weight`, `e_proj.weight`, `attn.wq_a.weight`, `ffn.experts.3.w1.weight`, ...).
Everything here runs in fp32 on unquantised weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4_kernels.attention import grouped_output_projection, sparse_attention
from dsv4_kernels.mhc import hc_head, hc_post, hc_pre
from dsv4_kernels.moe import expert_mlp, moe_experts, route
from dsv4_kernels.norm import rms_norm, unweighted_rms_norm
from dsv4_kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq


@dataclass(frozen=True)
class MtpSpec:
    """The model dimensions one MTP layer needs (a V4 config's fields of the same names)."""

    num_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    o_groups: int
    sliding_window: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_experts_per_tok: int
    n_routed_experts: int
    routed_scaling_factor: float
    scoring_func: str
    norm_topk_prob: bool
    swiglu_limit: float

    @classmethod
    def of(cls, cfg) -> MtpSpec:
        """From any object with these fields (engine.model.config.ModelConfig: its `main_rope.theta`)."""
        theta = cfg.main_rope.theta if hasattr(cfg, "main_rope") else cfg.rope_theta
        return cls(
            cfg.num_heads,
            cfg.head_dim,
            cfg.rope_dim,
            float(theta),
            cfg.o_groups,
            cfg.sliding_window,
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
            cfg.num_experts_per_tok,
            cfg.n_routed_experts,
            cfg.routed_scaling_factor,
            cfg.scoring_func,
            cfg.norm_topk_prob,
            cfg.swiglu_limit,
        )


def mtp_input(
    embedded: torch.Tensor,
    streams: torch.Tensor,
    enorm: torch.Tensor,
    hnorm: torch.Tensor,
    e_proj: torch.Tensor,
    h_proj: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """embedded: [T, D] (embed rows of the tokens at t+1); streams: [T, hc, D] (target, pre-hc_head, at t);
    e_proj, h_proj: [D, D] -> the block's input streams [T, hc, D] in streams' dtype."""
    e = rms_norm(embedded, enorm, eps) @ e_proj.t().to(embedded.dtype)  # [T, D]
    h = rms_norm(streams, hnorm, eps) @ h_proj.t().to(streams.dtype)  # [T, hc, D]: per stream
    return h + e.unsqueeze(1).to(h.dtype)


def mtp_logits(streams: torch.Tensor, w: dict, head: torch.Tensor, hc_eps: float, eps: float) -> torch.Tensor:
    """streams: [N, hc, D] (the MTP block's output) -> fp32 logits [N, V] through the layer's own hc_head and
    norm, then the shared head [V, D]. w: the layer's tensors (names relative to `mtp.{i}.`)."""
    x = hc_head(streams, w["hc_head_fn"], w["hc_head_base"], w["hc_head_scale"], hc_eps, eps)
    return (rms_norm(x, w["norm.weight"], eps).to(head.dtype) @ head.t()).float()


def swa_attention(x: torch.Tensor, positions: torch.Tensor, w: dict, spec: MtpSpec) -> torch.Tensor:
    """One sequence's sliding-window V4 attention. x: [T, D] normed block input at `positions` [T] (increasing,
    contiguous); w: names relative to `attn.` -> [T, D]."""
    t, eps = x.shape[0], spec.rms_norm_eps
    cos, sin = rope_cos_sin(positions, rope_inv_freq(spec.rope_theta, spec.rope_dim).to(x.device))
    q_res = rms_norm(x @ w["wq_a.weight"].t(), w["q_norm.weight"], eps)
    q = (q_res @ w["wq_b.weight"].t()).view(t, spec.num_heads, spec.head_dim)
    q = apply_rope(unweighted_rms_norm(q, eps), cos, sin)
    kv = apply_rope(rms_norm(x @ w["wkv.weight"].t(), w["norm.weight"], eps), cos, sin)  # [T, hd]: K = V
    # keys of query i: rows i - W + 1 .. i (the window), as one [T, W] gather with a validity mask
    rows = (
        torch.arange(t, device=x.device).unsqueeze(1)
        - spec.sliding_window
        + 1
        + torch.arange(spec.sliding_window, device=x.device)
    )
    keys = kv[rows.clamp(min=0)]  # [T, W, hd]
    o = sparse_attention(q, keys, rows >= 0, w["attn_sink"], spec.head_dim**-0.5)
    o = apply_rope(o, cos, sin, inverse=True)
    return grouped_output_projection(o, w["wo_a.weight"], w["wo_b.weight"], spec.o_groups)


def moe(x: torch.Tensor, w: dict, spec: MtpSpec) -> torch.Tensor:
    """Score-routed MoE + shared expert. x: [T, D]; w: names relative to `ffn.` -> [T, D]."""
    weights, ids = route(
        x,
        w["gate.weight"],
        spec.num_experts_per_tok,
        spec.routed_scaling_factor,
        spec.scoring_func,
        bias=w["gate.bias"],
        renormalize=spec.norm_topk_prob,
    )
    w1, w2, w3 = (torch.stack([w[f"experts.{e}.w{k}.weight"] for e in range(spec.n_routed_experts)]) for k in (1, 2, 3))
    routed = moe_experts(x, weights, ids, w1, w2, w3, spec.swiglu_limit)
    shared = expert_mlp(
        x,
        w["shared_experts.w1.weight"],
        w["shared_experts.w2.weight"],
        w["shared_experts.w3.weight"],
        spec.swiglu_limit,
    )
    return routed + shared


def _sub(w: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}


def mtp_block(x: torch.Tensor, positions: torch.Tensor, w: dict, spec: MtpSpec) -> torch.Tensor:
    """The MTP layer's V4 block on streams x [T, hc, D] -> [T, hc, D] (mHC pre/post around attention and MoE)."""
    eps = spec.rms_norm_eps
    streams = x
    for site, run in (
        ("attn", lambda h: swa_attention(h, positions, _sub(w, "attn."), spec)),
        ("ffn", lambda h: moe(h, _sub(w, "ffn."), spec)),
    ):
        collapsed, post, comb = hc_pre(
            streams,
            w[f"hc_{site}_fn"],
            w[f"hc_{site}_base"],
            w[f"hc_{site}_scale"],
            spec.hc_sinkhorn_iters,
            spec.hc_eps,
            eps,
        )
        out = run(rms_norm(collapsed, w[f"{site}_norm.weight"], eps))
        streams = hc_post(out, streams, post, comb)
    return streams


def mtp_layer_reference(
    w: dict,
    spec: MtpSpec,
    embed: torch.Tensor,
    head: torch.Tensor,
    next_tokens: torch.Tensor,
    streams: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP layer over one sequence. w: the layer's tensors (names relative to `mtp.{i}.`); embed, head:
    the model's [V, D]; next_tokens: [T] token ids at t+1; streams: [T, hc, D] hidden at t; positions: [T] = t
    (contiguous, increasing; the layer's SWA covers only these rows) -> (output streams [T, hc, D],
    fp32 logits [T, V] predicting the token at t+2)."""
    x = mtp_input(
        embed[next_tokens],
        streams,
        w["enorm.weight"],
        w["hnorm.weight"],
        w["e_proj.weight"],
        w["h_proj.weight"],
        spec.rms_norm_eps,
    )
    out = mtp_block(x, positions, w, spec)
    return out, mtp_logits(out, w, head, spec.hc_eps, spec.rms_norm_eps)
