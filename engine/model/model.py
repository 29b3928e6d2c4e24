"""DeepSeek V4 forward over a StepBatch: embedding -> layers (mHC + attention + MoE) -> hc_head -> logits."""

from __future__ import annotations

import torch

from dsv4_kernels import mhc
from dsv4_kernels.fp8_linear import Fp8Weight
from dsv4_kernels.mhc import hc_head
from dsv4_kernels.norm import rms_norm
from dsv4_kernels.rope import rope_cos_sin, rope_inv_freq
from dsv4_kernels.settings import settings
from engine.model.attention import AttentionBlock
from engine.model.batch import StepBatch
from engine.model.cache import CachePool
from engine.model.config import ModelConfig, RopeSpec
from engine.model.fast_paths import describe, fast_path_states, log_fast_paths, use_triton
from engine.model.linear import QuantizedAct, Weight, shared_quant_pow2
from engine.model.moe import MoEBlock
from engine.model.parallel import SINGLE, ParallelContext, vocab_embed


class Rope:
    """Cached inverse frequencies of one RopeSpec; cos/sin computed per step from positions."""

    def __init__(self, spec: RopeSpec, device):
        self.spec = spec
        self.inv_freq = rope_inv_freq(
            spec.theta, spec.dim, spec.yarn_factor, spec.original_max_position, spec.beta_fast, spec.beta_slow
        ).to(device)

    def __call__(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.inv_freq, self.spec.attention_factor)


def _memo_by_tensor(fn):
    """fn(t) computed once per distinct tensor object for one step: every layer of a compress ratio passes the
    same CompressPlan.entry_pos, so cos/sin are built 3 times a step (kv4, kv128, index), not once a layer."""
    memo: dict[int, tuple] = {}

    def call(t: torch.Tensor):
        hit = memo.get(id(t))
        if hit is None:
            hit = memo[id(t)] = (t, fn(t))  # t kept alive: its id cannot be reused within the step
        return hit[1]

    return call


class DeepseekV4Model:
    """Holds the weights (original DeepSeek names) and runs one step. Stateless apart from the caches."""

    def __init__(self, cfg: ModelConfig, weights: dict, device, parallel: ParallelContext | None = None):
        """parallel: this rank's tensor-parallel context (weights already cut by engine.model.sharding); None = one rank."""
        self.cfg = cfg
        self.parallel = parallel or SINGLE
        self.device = torch.device(device)
        self.forwards = 0  # forward() calls: engine.execution.dp_attention keeps every rank at one a step
        weights = dict(weights)
        self.embed = weights["embed.weight"]
        self.head = weights["head.weight"]
        self.norm = weights["norm.weight"]
        self.hc_head_params = (weights["hc_head_fn"], weights["hc_head_base"], weights["hc_head_scale"])
        # Under data-parallel attention only the MoE blocks see the group (engine.execution.dp_attention)
        self.attn = [AttentionBlock(cfg, weights, i, self.parallel.attention) for i in range(cfg.num_layers)]
        self.moe = [MoEBlock(cfg, weights, i, self.parallel) for i in range(cfg.num_layers)]
        self.layer_weights = [
            {
                k: weights[f"layers.{i}.{k}"]
                for k in (
                    "attn_norm.weight",
                    "ffn_norm.weight",
                    "hc_attn_fn",
                    "hc_attn_base",
                    "hc_attn_scale",
                    "hc_ffn_fn",
                    "hc_ffn_base",
                    "hc_ffn_scale",
                )
            }
            for i in range(cfg.num_layers)
        ]
        fp8 = any(isinstance(v, Fp8Weight) for a in self.attn for v in a.w.values())
        packed = any(m.mxfp4 for m in self.moe)
        fp8_experts = any(m.fp8 is not None for m in self.moe)  # a prefill engine's FP8 experts
        self.fast_paths = describe(
            self.device,
            self.dtype,
            fp8,
            packed,
            all(m.ogs_fits for m in self.moe),
            all(m.marlin_fits for m in self.moe),
            fp8_experts,
        )
        self.fast_path_states = fast_path_states(
            self.device,
            self.dtype,
            fp8,
            packed,
            all(m.ogs_fits for m in self.moe),
            all(m.marlin_fits for m in self.moe),
            fp8_experts,
        )
        log_fast_paths(self.fast_paths, self.fast_path_states, self.device)  # a WARNING on CUDA for each fallback
        self.ropes = {"main": Rope(cfg.main_rope, self.device), "compress": Rope(cfg.compress_rope, self.device)}
        # (inv_freq [2, 1, half], attention factors [2, 1, 1]) for _position_ropes
        self._rope_stack: tuple[torch.Tensor, torch.Tensor] | None = None
        # The hc residual streams stay fp32 in 16-bit engines (each block's input and output still round to
        # the model dtype). On the H200 this lifted bf16 teacher-forced greedy agreement with the fp32 engine
        # from 0.93 to 0.96 (small preset, decided positions; BENCHMARKS.md) for ~4% more decode bytes at
        # batch 64. DSV4_FP32_RESIDUAL=0 keeps them in the model dtype, as the transformers reference does.
        self.residual_dtype = torch.float32 if settings().fp32_residual else self.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @staticmethod
    def _mhc(streams: torch.Tensor):
        """The mHC implementation for these streams: dsv4_kernels.triton_mhc (fused) or the dsv4_kernels.mhc
        reference."""
        # CUDA only: under the CPU interpreter the fused kernel's Sinkhorn loop is far too slow for whole-model
        # runs (tests/kernels/test_triton_mhc.py checks it against the reference there).
        if streams.is_cuda and use_triton(streams.device):
            from dsv4_kernels import triton_mhc  # imports triton: only on this path

            return triton_mhc
        return mhc

    def _hc(self, lw: dict, kind: str, streams: torch.Tensor, first: Weight | None = None):
        """mHC pre of block `kind` ("attn" / "ffn") -> (the block's input: RMSNorm(collapsed) in the model dtype
        [T, D], that input's QuantizedAct or None, post [T, hc], comb [T, hc, hc]). The Triton kernel fuses the
        norm and the cast in; where `first` (the block's first projection of its input) runs DeepGEMM's FP8 GEMM,
        the 1x128 quantisation it needs is fused into the norm's launch too (triton_mhc.hc_pre_quant)."""
        cfg, impl = self.cfg, self._mhc(streams)
        args = (streams, *self._hc_params(lw, kind))
        weight, eps = lw[f"{kind}_norm.weight"], cfg.rms_norm_eps
        if impl is mhc:
            collapsed, post, comb = impl.hc_pre(*args)
            return rms_norm(collapsed, weight, eps).to(self.dtype), None, post, comb
        pow2 = shared_quant_pow2(streams.device, self.dtype, first)
        chain = self._mhc_chain(streams)
        if chain is not None:
            x, q, s, post, comb = chain.pre_norm_quant(
                *args, norm_weight=weight, out_eps=eps, out_dtype=self.dtype, pow2=pow2
            )
            return x, None if q is None else QuantizedAct(q, s), post, comb
        if pow2 is None:
            x, post, comb = impl.hc_pre(*args, norm_weight=weight, out_eps=eps, out_dtype=self.dtype)
            return x, None, post, comb
        x, q, s, post, comb = impl.hc_pre_quant(*args, norm_weight=weight, out_eps=eps, out_dtype=self.dtype, pow2=pow2)
        return x, QuantizedAct(q, s), post, comb

    def _hc_params(self, lw: dict, kind: str) -> tuple:
        """Block `kind`'s mHC parameters as the pre functions take them after the streams: (fn, base, scale,
        Sinkhorn iterations, hc eps, the mixing norm's eps)."""
        cfg = self.cfg
        fn, base, scale = lw[f"hc_{kind}_fn"], lw[f"hc_{kind}_base"], lw[f"hc_{kind}_scale"]
        return fn, base, scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps

    def _mhc_chain(self, streams: torch.Tensor):
        """dsv4_kernels.triton_mhc_chain where a block boundary over these streams takes its two launches (the
        Triton mHC, steps of <= CHAIN_MAX_TOKENS tokens), else None."""
        if self._mhc(streams) is mhc:
            return None
        from dsv4_kernels import triton_mhc_chain  # imports triton: only on this path

        return triton_mhc_chain if triton_mhc_chain.takes_chain(streams) else None

    def _post_then_hc(
        self,
        out: torch.Tensor,
        streams: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        lw: dict,
        kind: str,
        first: Weight | None = None,
    ):
        """The boundary after a block: its mHC post (out [T, D], post, comb), then block `kind`'s pre as `_hc`
        -> (the new streams [T, hc, D], then `_hc`'s four outputs). Decode-sized steps run the whole boundary in
        two launches (dsv4_kernels.triton_mhc_chain: post with the next mix, then pre with the norm and quant)."""
        chain = self._mhc_chain(streams)
        if chain is None:
            streams = self._mhc(streams).hc_post(out, streams, post, comb)
            return (streams, *self._hc(lw, kind, streams, first))
        new, x, q, s, post, comb = chain.post_pre_norm_quant(
            out,
            streams,
            post,
            comb,
            *self._hc_params(lw, kind),
            norm_weight=lw[f"{kind}_norm.weight"],
            out_eps=self.cfg.rms_norm_eps,
            out_dtype=self.dtype,
            pow2=shared_quant_pow2(streams.device, self.dtype, first),
        )
        return new, x, None if q is None else QuantizedAct(q, s), post, comb

    @torch.inference_mode()
    def forward(
        self, batch: StepBatch, pool: CachePool, exchange_counts: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Run every token of the step through the model; -> fp32 logits [len(batch.logit_rows), vocab]."""
        return self.logits(self.forward_streams(batch, pool, exchange_counts), batch.logit_rows)

    @torch.inference_mode()
    def forward_streams(
        self, batch: StepBatch, pool: CachePool, exchange_counts: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Run every token of the step through the layers -> the residual streams before hc_head [T, hc, D] in
        the residual dtype (what the MTP draft layer takes as its hidden input, engine.model.mtp)."""
        cfg = self.cfg
        self.forwards += 1
        dp = (
            self.parallel.token_exchange(batch.token_ids, exchange_counts)
            if self.parallel.data_parallel_attention
            else None
        )
        streams, ropes = self._step_inputs(batch)
        # Each block's mHC post runs with the next block's pre (_post_then_hc); the last post stands alone.
        x, qa, post, comb = self._hc(self.layer_weights[0], "attn", streams, self.attn[0].first_projection)
        for i in range(cfg.num_layers):
            lw = self.layer_weights[i]
            out = self.attn[i].forward(x, batch, pool, ropes, qa)
            streams, x, qa, post, comb = self._post_then_hc(
                out, streams, post, comb, lw, "ffn", self.moe[i].first_projection
            )
            out = self.moe[i].forward(x, batch.token_ids, dp, qa)
            if i + 1 < cfg.num_layers:
                streams, x, qa, post, comb = self._post_then_hc(
                    out, streams, post, comb, self.layer_weights[i + 1], "attn", self.attn[i + 1].first_projection
                )
        return self._mhc(streams).hc_post(out, streams, post, comb)

    def step_ropes(self, batch: StepBatch) -> dict:
        """The step's RoPE tables as the attention blocks take them."""
        main, compress = self._position_ropes(batch.positions)
        return self._rope_dict(main, compress)

    def _rope_dict(self, main: tuple, compress: tuple) -> dict:
        return {"main": main, "compress": compress, "compress_at": _memo_by_tensor(self.ropes["compress"])}

    def _step_inputs(self, batch: StepBatch) -> tuple[torch.Tensor, dict]:
        """-> (the residual streams [T, hc, hidden] in the residual dtype: each token's embedding in every stream;
        the step's RoPE tables, as step_ropes). With the Triton fast paths (CUDA; the CPU interpreter when forced),
        one rank's whole vocabulary and equal RoPE widths: one launch (dsv4_kernels.triton_step_inputs; 8 torch
        kernels otherwise)."""
        cfg, ids = self.cfg, batch.token_ids
        if self._fused_step_inputs():
            from dsv4_kernels.triton_step_inputs import step_inputs  # imports triton: only on this path

            inv, factor = self._rope_tables()
            streams, cs = step_inputs(
                self.embed, ids, batch.positions, cfg.hc_mult, self.residual_dtype, inv[:, 0], factor.view(-1)
            )
            return streams, self._rope_dict((cs[0, 0], cs[0, 1]), (cs[1, 0], cs[1, 1]))
        ropes = self.step_ropes(batch)
        h = vocab_embed(self.embed, ids, self.parallel.attention)
        # [T, hc, hidden] in the residual dtype: the cast and the hc broadcast as one copy (one kernel, not two)
        streams = torch.empty((h.shape[0], cfg.hc_mult, h.shape[1]), dtype=self.residual_dtype, device=h.device)
        streams.copy_(h.unsqueeze(1).expand(-1, cfg.hc_mult, -1))
        return streams, ropes

    def _fused_step_inputs(self) -> bool:
        main, comp = self.ropes["main"], self.ropes["compress"]
        return (
            use_triton(self.device)
            and not self.parallel.attention.enabled  # a vocab-parallel table needs its all-reduce
            and main.inv_freq.shape == comp.inv_freq.shape
            and self.embed.stride(-1) == 1
        )

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both RoPEs' (inverse frequencies fp32 [2, 1, half], attention factors fp32 [2, 1, 1]), built once."""
        if self._rope_stack is None:
            main, comp = self.ropes["main"], self.ropes["compress"]
            self._rope_stack = (
                torch.stack([main.inv_freq, comp.inv_freq]).to(torch.float32).unsqueeze(1),
                torch.tensor(
                    [main.spec.attention_factor, comp.spec.attention_factor], dtype=torch.float32, device=self.device
                ).view(2, 1, 1),
            )
        return self._rope_stack

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """Data-parallel attention: a step in which this rank has no tokens. It still joins every MoE layer's
        exchange (its routed experts serve the other ranks' tokens), in the order a forward would."""
        if not self.parallel.data_parallel_attention:
            raise RuntimeError("idle_forward is for ranks of a data-parallel attention group")
        ids = torch.empty(0, dtype=torch.long, device=self.device)
        dp = self.parallel.token_exchange(ids)
        x = torch.empty((0, self.cfg.hidden_size), dtype=self.dtype, device=self.device)
        for moe in self.moe:
            moe.forward(x, ids, dp)

    def _position_ropes(self, positions: torch.Tensor) -> tuple[tuple, tuple]:
        """(cos, sin) of the main and the compress RoPE at `positions`, each fp32 [T, dim // 2]: both from one
        [2, T, dim // 2] pass (6 kernels, not 12), the same fp32 ops element for element as Rope.__call__."""
        main, comp = self.ropes["main"], self.ropes["compress"]
        if main.inv_freq.shape != comp.inv_freq.shape:
            return main(positions), comp(positions)
        inv, factor = self._rope_tables()
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv  # [2, T, half]
        cos, sin = freqs.cos() * factor, freqs.sin() * factor
        return (cos[0], sin[0]), (cos[1], sin[1])

    def logits(self, streams: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """streams: [T, hc, hidden]; rows: int [N] of T whose logits to take (None: all) -> fp32 [N, vocab]."""
        cfg = self.cfg
        x = head_input(streams, rows, *self.hc_head_params, self.norm, cfg, self.head.dtype)
        return self.parallel.attention.gather_vocab((x @ self.head.t()).float(), cfg.vocab_size)


def head_input(
    streams: torch.Tensor,
    rows: torch.Tensor | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    cfg: ModelConfig,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The LM head's input: hc_head of streams[rows] ([T, hc, D]; rows None = all), then the final RMSNorm, in
    out_dtype [N, D]. With the Triton fast paths (CUDA; the CPU interpreter when forced) the gather, hc_head and
    norm are two launches (dsv4_kernels.triton_hc_head; ~20 torch kernels otherwise); elsewhere the reference ops."""
    if use_triton(streams.device):
        from dsv4_kernels.triton_hc_head import hc_head_norm  # imports triton: only on this path

        return hc_head_norm(
            streams, fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps, norm_weight, cfg.rms_norm_eps, out_dtype, rows
        )
    x = hc_head(streams if rows is None else streams[rows], fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps)
    return rms_norm(x, norm_weight, cfg.rms_norm_eps).to(out_dtype)
