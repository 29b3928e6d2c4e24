"""The V4 MoE block: router, routed experts, one shared expert.

Routed experts run one of five ways, chosen per call:
- MXFP4 experts kept packed (`load_weights(..., keep_mxfp4_experts=True)`) and
  `engine.model.fast_paths.mxfp4_moe_backend(device)` == "triton_kernels" (default on CUDA where it imports): the
  fused router of `dsv4_kernels.triton_moe`, then OpenAI's triton_kernels matmul (`dsv4_kernels.mxfp4_ogs`); the packed
  bytes are moved into its Hopper layouts at the first call and the originals dropped (no bf16 copy);
- packed, backend "marlin" (where triton_kernels does not import, or by request): the same router, then Marlin's
  W4A16 grouped GEMM (`dsv4_kernels.marlin_moe`) on its own repack of the bytes (again replacing the originals);
- packed, backend "engine": `dsv4_kernels.triton_moe` (fused router + grouped experts that dequantise the e2m1
  tiles in registers);
- packed without that: the reference on just the experts this call uses, dequantised on the fly;
- dequantised (bf16/fp32) stacks: `moe_experts_grouped` (torch._grouped_mm, sync-free) where
  `use_grouped_moe` says so, else the per-expert reference `moe_experts`.
Before all of these: FP8 128x128 experts (a prefill engine's format, converted at load:
engine.model.fp8_expert_weights) run every step of an engine that holds only them, and the steps of at least
`FP8_EXPERT_MIN_TOKENS` tokens of one that holds both formats, through DeepGEMM's contiguous grouped FP8 GEMM
(`dsv4_kernels.deepgemm_moe`) where `use_fp8_expert_gemm` says so, else the reference on the dequantised experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4_kernels.fp8_linear import Fp8Weight
from dsv4_kernels.moe import moe_experts, moe_experts_grouped, route, swiglu
from dsv4_kernels.quant import dequant_mxfp4
from engine.model.config import ModelConfig
from engine.model.fast_paths import (
    FP8_EXPERT_MIN_TOKENS,
    mxfp4_moe_backend,
    use_fp8_expert_gemm,
    use_grouped_moe,
    use_mxfp4_gemv,
    use_mxfp4_moe,
    use_triton,
)
from engine.model.fp8_expert_weights import has_packed_experts, take_fp8_experts
from engine.model.linear import (
    QuantizedAct,
    Weight,
    can_concat_rows,
    concat_rows,
    linear,
    linear_from,
    pow2_activations,
    split_rows,
    take_fp8_weights,
    uses_fp8_gemm,
)
from engine.model.parallel import SINGLE, ParallelContext, TokenExchange

if TYPE_CHECKING:  # the library layouts' modules import GPU libraries where they are used, not here
    from dsv4_kernels.marlin_moe import MarlinExperts
    from dsv4_kernels.mxfp4_ogs import OgsExperts
    from dsv4_kernels.triton_mxfp4_gemv import GemvExperts


@dataclass(frozen=True)
class PackedExperts:
    """MXFP4 routed experts of one layer: uint8 e2m1 bytes w [E, N, K/2] and UE8M0 scales s [E, N, K/32].

    w1, w3: [E, I, H/2] (gate, up); w2: [E, H, I/2] (down); low nibble = even element (dsv4_kernels.quant).
    """

    w1: torch.Tensor
    s1: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    w3: torch.Tensor
    s3: torch.Tensor

    def __post_init__(self):
        for name in ("w1", "s1", "w2", "s2", "w3", "s3"):
            t = getattr(self, name)
            if t.dtype != torch.uint8 or t.dim() != 3:
                raise ValueError(f"PackedExperts.{name} must be uint8 [E, N, K'], got {t.dtype} {tuple(t.shape)}")

    def dequant(self, experts: torch.Tensor, dtype: torch.dtype):
        """Dense (w1, w2, w3) of the given expert ids only, [len(experts), ...] in `dtype`."""
        return tuple(
            dequant_mxfp4(w[experts], s[experts]).to(dtype)
            for w, s in ((self.w1, self.s1), (self.w2, self.s2), (self.w3, self.s3))
        )


def is_packed(weights: dict, name: str) -> bool:
    """Was expert weight `name` kept as MXFP4 bytes (a uint8 tensor with a `.scale` companion)?"""
    return weights[name].dtype == torch.uint8 and name[: -len(".weight")] + ".scale" in weights


def _pop_stack(weights: dict, names: list[str]) -> torch.Tensor:
    # Stacked [E, ...] so a grouped kernel indexes experts by id, without Python lists.
    return torch.stack([weights.pop(n) for n in names])


def take_experts(
    weights: dict, prefix: str, num_experts: int | range, dtype: torch.dtype
) -> PackedExperts | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pop the routed experts under `prefix` (all of them, or the id range an expert-parallel rank holds)
    -> PackedExperts, or dense (w1, w2, w3) stacks indexed by id - range.start.

    A layer whose experts are not all packed (a mixed checkpoint) is dequantised to `dtype` here.
    """
    ids = num_experts if isinstance(num_experts, range) else range(num_experts)
    names = {w: [f"{prefix}experts.{e}.{w}.weight" for e in ids] for w in ("w1", "w2", "w3")}
    every = [n for ns in names.values() for n in ns]
    packed = [is_packed(weights, n) for n in every]
    scales = {w: [n[: -len(".weight")] + ".scale" for n in ns] for w, ns in names.items()}
    if all(packed):
        parts = {}
        for w in ("w1", "w2", "w3"):
            parts[w] = _pop_stack(weights, names[w])
            parts["s" + w[1]] = _pop_stack(weights, scales[w])
        return PackedExperts(**parts)
    if any(packed):
        for n in every:
            if weights[n].dtype == torch.uint8:
                weights[n] = dequant_mxfp4(weights[n], weights.pop(n[: -len(".weight")] + ".scale")).to(dtype)
    w1, w2, w3 = (_pop_stack(weights, names[w]) for w in ("w1", "w2", "w3"))
    return w1, w2, w3


class MoEBlock:
    """One layer's FFN. forward(x [T, H], token_ids [T]) -> [T, H] (routed + shared expert)."""

    def __init__(self, cfg: ModelConfig, weights: dict, layer: int, parallel: ParallelContext | None = None):
        """parallel: with tp ranks the shared expert (and, without expert parallelism, every routed expert) is
        split on its intermediate dim, and with expert parallelism this rank holds experts
        `parallel.expert_range(E)` whole; either way the block's output is a partial sum, all-reduced here."""
        self.cfg = cfg
        self.parallel = parallel or SINGLE
        self.experts = self.parallel.expert_range(cfg.n_routed_experts)
        p = f"layers.{layer}.ffn."
        self.gate = weights[p + "gate.weight"]
        self.bias = weights.get(p + "gate.bias")
        self.tid2eid = weights.get(p + "gate.tid2eid") if cfg.hash_layers[layer] else None
        shared = take_fp8_weights(
            {
                k: weights[f"{p}shared_experts.{k}"]
                for k in ("w1.weight", "w2.weight", "w3.weight", "w1.scale", "w2.scale", "w3.scale")
                if f"{p}shared_experts.{k}" in weights
            },
            pow2_activations(cfg.quantization),
        )
        # w1 and w3 are multiplied as one [2I, H] weight (one GEMM, one activation quantisation); self.shared
        # keeps (w1, w2, w3) as views of it.
        # (Where they cannot stack, engine.model.linear.can_concat_rows, they stay two GEMMs.)
        w1, w3 = shared["w1.weight"], shared["w3.weight"]
        self.shared_w13 = None
        if can_concat_rows(w1, w3):
            self.shared_w13 = concat_rows(w1, w3)
            w1, w3 = split_rows(self.shared_w13, w1.shape[0])
        self.shared = (w1, shared["w2.weight"], w3)  # tensors or Fp8Weight
        # dsv4_kernels.fp8_experts.Fp8Experts when converted at load (alone, or beside the MXFP4 bytes)
        self.fp8 = take_fp8_experts(weights, p, pow2_activations(cfg.quantization))
        experts = (
            take_experts(weights, p, self.experts, self.gate.dtype)
            if self.fp8 is None or has_packed_experts(weights, p, self.experts.start)
            else None
        )
        self.packed = experts if isinstance(experts, PackedExperts) else None
        self.mxfp4 = self.packed is not None  # routed experts held as MXFP4 (packed, or in triton_kernels layouts)
        self.ogs: OgsExperts | None = None  # built from `packed` at the first triton_kernels call
        self.gemv: GemvExperts | None = None  # views of `ogs`' storage, built at the first GEMV call
        # triton_kernels' tiles were measured at V4 widths only (tests/kernels/test_mxfp4_ogs.py, >= 128);
        # narrower toy models take the engine's own kernel.
        self.ogs_fits = cfg.hidden_size % 128 == 0 and cfg.moe_intermediate_size % 128 == 0
        self.marlin: MarlinExperts | None = None  # built from `packed` at the first Marlin call
        self.marlin_fits = cfg.hidden_size % 256 == 0 and cfg.moe_intermediate_size % 64 == 0  # Marlin's tiles
        # dense experts (stacks indexed by id - experts.start): neither packed nor FP8
        self.dense = experts if isinstance(experts, tuple) else None
        # The fused router's weights: bf16 as stored (multiplied with fp32 output, triton_moe.router_logits), else
        # fp32 once here, not per call as the reference does (no copy for an fp32 gate: the dense CPU models').
        self.router_gate = self.gate if self.gate.dtype == torch.bfloat16 else self.gate.float()

    def _route_args(self, token_ids: torch.Tensor) -> dict:
        cfg = self.cfg
        return {
            "top_k": cfg.num_experts_per_tok,
            "scaling": cfg.routed_scaling_factor,
            "scoring_func": cfg.scoring_func,
            "bias": None if self.tid2eid is not None else self.bias,
            "tid2eid": self.tid2eid,
            "token_ids": token_ids,
            "renormalize": cfg.norm_topk_prob,
        }

    def takes_ogs(self, x: torch.Tensor) -> bool:
        """Do the routed experts of this call go through triton_kernels' matmul (dsv4_kernels.mxfp4_ogs)?"""
        return (
            self.mxfp4
            and x.is_cuda
            and x.dtype == torch.bfloat16
            and (self.ogs is not None or (self.ogs_fits and mxfp4_moe_backend(x.device) == "triton_kernels"))
        )

    def takes_marlin(self, x: torch.Tensor) -> bool:
        """Do the routed experts of this call go through Marlin's grouped GEMM (dsv4_kernels.marlin_moe)?"""
        return (
            self.mxfp4
            and x.is_cuda
            and x.dtype == torch.bfloat16
            and (self.marlin is not None or (self.marlin_fits and mxfp4_moe_backend(x.device) == "marlin"))
        )

    def takes_fp8(self, x: torch.Tensor) -> bool:
        """Do the routed experts of this call run on the FP8 experts? Always when they are the only format held;
        beside MXFP4, for steps of at least FP8_EXPERT_MIN_TOKENS tokens (decode-sized steps keep MXFP4)."""
        return self.fp8 is not None and (not self.mxfp4 or x.shape[0] >= FP8_EXPERT_MIN_TOKENS)

    def routed(self, x: torch.Tensor, token_ids: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum, [T, H], plus `shared` [T, H] when given."""
        out, added = self._routed(x, token_ids, shared)
        return out if shared is None or added else out + shared

    def _routed(self, x: torch.Tensor, token_ids: torch.Tensor, shared: torch.Tensor | None):
        """-> (the routed sum [T, H], whether `shared` is already added in: the MXFP4 kernel's k-way sum adds it)."""
        limit = self.cfg.swiglu_limit
        fp8 = self.fp8 if self.takes_fp8(x) else None
        if fp8 is not None and x.dtype == torch.bfloat16 and use_fp8_expert_gemm(x.device):
            from dsv4_kernels import deepgemm_moe, triton_moe  # import deep_gemm / triton: only on this path

            weights, ids = self._local(*triton_moe.route(x, self.router_gate, **self._route_args(token_ids)), True)
            return deepgemm_moe.deepgemm_moe(x, weights, ids, fp8, limit, shared=shared), True
        if fp8 is not None:
            return self._reference(x, token_ids, fp8), False
        if self.takes_marlin(x):
            from dsv4_kernels import marlin_moe, triton_moe  # imports triton / the Marlin library: only here

            if self.marlin is None:
                pk = self._packed_experts()
                self.marlin = marlin_moe.prepare(pk.w1, pk.s1, pk.w2, pk.s2, pk.w3, pk.s3)
                self.packed = None  # Marlin's tiles replace the checkpoint bytes
            weights, ids = self._local(*triton_moe.route(x, self.router_gate, **self._route_args(token_ids)), False)
            return marlin_moe.marlin_moe(x, weights, ids, self.marlin, limit, shared=shared), True
        if self.takes_ogs(x):
            from dsv4_kernels import mxfp4_ogs, triton_moe  # import triton / triton_kernels: only on this path

            if self.ogs is None:
                pk = self._packed_experts()
                self.ogs = mxfp4_ogs.prepare(pk.w1, pk.s1, pk.w2, pk.s2, pk.w3, pk.s3)
                self.packed = None  # the Hopper-layout copy replaces the checkpoint bytes
            if use_mxfp4_gemv(x, self.cfg.num_experts_per_tok):
                from dsv4_kernels import triton_mxfp4_gemv  # imports triton: only on this path

                if self.gemv is None:
                    self.gemv = triton_mxfp4_gemv.from_ogs(self.ogs)  # views of the same storage: no copy
                # -1 for another rank's experts: the GEMV skips them without reading expert 0
                weights, ids = self._local(*triton_moe.route(x, self.router_gate, **self._route_args(token_ids)), True)
                return triton_mxfp4_gemv.gemv_moe(x, weights, ids, self.gemv, limit, shared=shared), True
            weights, ids = self._local(*triton_moe.route(x, self.router_gate, **self._route_args(token_ids)), False)
            return mxfp4_ogs.ogs_moe(x, weights, ids, self.ogs, limit, shared=shared), True
        if self.packed is not None and use_mxfp4_moe(x.device):
            from dsv4_kernels import triton_moe  # imports triton: only on this path

            weights, ids = self._local(*triton_moe.route(x, self.router_gate, **self._route_args(token_ids)), False)
            pk = self.packed
            return triton_moe.mxfp4_moe(x, weights, ids, pk.w1, pk.s1, pk.w2, pk.s2, pk.w3, pk.s3, limit), False
        if self.packed is not None:
            return self._reference(x, token_ids, self.packed), False
        if self.dense is None:
            raise RuntimeError("MoE block holds no routed experts for this call (MXFP4 bytes already handed over)")
        weights, ids = self._local(*route(x, self.gate, **self._route_args(token_ids)), True)
        experts = moe_experts_grouped if use_grouped_moe(x) else moe_experts
        return experts(x, weights, ids, *self.dense, limit), False

    def _packed_experts(self) -> PackedExperts:
        """The MXFP4 checkpoint bytes, which a library layout (Marlin, triton_kernels) is built from once."""
        if self.packed is None:
            raise RuntimeError("the MXFP4 experts were already handed to another layout")
        return self.packed

    def _reference(self, x: torch.Tensor, token_ids: torch.Tensor, held) -> torch.Tensor:
        """Reference on quantised experts (PackedExperts or Fp8Experts): dequantise only the experts in use (host
        sync; not a fast path), then dsv4_kernels.moe.moe_experts."""
        weights, ids = self._local(*route(x, self.gate, **self._route_args(token_ids)), True)
        used = ids.unique()
        used = used[used >= 0]
        w1, w2, w3 = held.dequant(used, x.dtype)
        ids = torch.where(ids >= 0, torch.searchsorted(used, ids), -1)
        return moe_experts(x, weights, ids, w1, w2, w3, self.cfg.swiglu_limit)

    def _local(self, weights: torch.Tensor, ids: torch.Tensor, skip: bool):
        """Expert parallelism: global expert ids [T, k] -> ids into this rank's experts. Pairs routed to
        another rank's experts become -1, which dsv4_kernels.moe skips; for the fused GPU kernels (`skip` False,
        they take no -1) they become local expert 0 with routing weight 0: correct, but computed."""
        if len(self.experts) == self.cfg.n_routed_experts:
            return weights, ids
        local = ids - self.experts.start
        mine = (local >= 0) & (local < len(self.experts))
        if skip:
            return weights, torch.where(mine, local, -1)
        return torch.where(mine, weights, 0), torch.where(mine, local, 0)

    @property
    def first_projection(self) -> Weight | None:
        """The FP8 projection that reads the block input first (the shared expert's w1 | w3 stacked), whose
        activation quantisation the mHC pre can fuse into its norm (engine.model.model._hc); None if unstacked."""
        return self.shared_w13

    def shared_expert(self, x: torch.Tensor, qa: QuantizedAct | None = None) -> torch.Tensor:
        """dsv4_kernels.moe.expert_mlp through engine.model.linear (FP8 weights where kept): x [T, H] -> [T, H].
        qa: x already quantised for `first_projection`."""
        w1, w2, w3 = self.shared
        if self.shared_w13 is not None:
            h = linear_from(x, qa, self.shared_w13)  # [T, 2I]: gate | up
        else:
            h = torch.cat([linear(x, w1), linear(x, w3)], dim=-1)
        inter, limit = h.shape[-1] // 2, self.cfg.swiglu_limit
        gate, up = h[..., :inter], h[..., inter:]
        if h.dim() == 2 and isinstance(w2, Fp8Weight) and uses_fp8_gemm(h, w2):
            from dsv4_kernels import triton_moe_glue
            from dsv4_kernels.deepgemm_linear import fp8_gemm_quantized  # imports deep_gemm: only on this path

            # SwiGLU and the down projection's 1x128 activation quantisation in one launch.
            return fp8_gemm_quantized(*triton_moe_glue.swiglu_quant(gate, up, limit, w2.pow2_act), w2)
        if use_triton(x.device) and h.dim() == 2:
            from dsv4_kernels import triton_moe_glue  # imports triton: only on this path

            act = triton_moe_glue.swiglu(gate, up, limit)
        else:
            act = swiglu(gate, up, limit)
        return linear(act, w2)

    def forward(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        dp: TokenExchange | None = None,
        qa: QuantizedAct | None = None,
    ) -> torch.Tensor:
        """x: [T, H] -> [T, H]. dp: the step's token exchange, under data-parallel attention. qa: x already
        quantised for `first_projection`."""
        if self.parallel.data_parallel_attention:
            return self._forward_dp(x, dp, qa)
        # One all-reduce for the block: routed (this rank's experts or expert slices) + shared (its slice).
        return self.parallel.all_reduce(self.routed(x, token_ids, self.shared_expert(x, qa)))

    def _forward_dp(self, x: torch.Tensor, dp: TokenExchange | None, qa: QuantizedAct | None = None) -> torch.Tensor:
        """Data-parallel attention (engine.execution.dp_attention): each rank brings its own tokens. They are gathered
        from every rank (zero-padded to the largest count), every rank routes them all (the router is
        replicated, so all agree) and runs its own experts on the pairs routed there, the partial sums go back
        to the tokens' ranks summed (reduce-scatter), and the shared expert (whole on every rank) runs on the
        rank's own tokens. An idle rank comes with no tokens and still serves its experts."""
        if dp is None or len(dp.counts) != self.parallel.tp_size or dp.counts[self.parallel.rank] != x.shape[0]:
            raise ValueError(
                f"data-parallel MoE needs every rank's token count (this rank has {x.shape[0]}), "
                f"got {dp.counts if dp is not None else None}"
            )
        counts = dp.counts
        if max(counts) == 0:  # a step in which no rank had tokens (every rank agrees: nothing to exchange)
            return torch.zeros_like(x)
        xs = self.parallel.gather_rows(x, counts)
        routed = self.parallel.reduce_rows(self.routed(xs, dp.token_ids), counts)
        return routed + self.shared_expert(x, qa) if x.shape[0] else routed
