"""KV-cache capacity from GPU memory: `--gpu-memory-utilization` (default 0.90) sizes the cache pool.

After the weights are on the GPU, the pool gets what is left of `utilization` x the device's memory, less a
reserve for activations and CUDA-graph pools (estimated from the step budget, below), and is never made larger
than `max_num_seqs` requests of the model's full context could use. `--max-cached-tokens` overrides all of it;
on the CPU the default stays 65536 tokens. The pool's bytes are affine in its token count (the growing groups,
kv{r} and index pages, scale with it; the per-request groups, SWA rings and compressor states, do not), so the
count comes from two evaluations of `engine.model.cache.group_specs`, then rounds down to whole pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from engine.execution.prefix_cache import snapshot_store_bytes
from engine.model.cache import CacheConfig, group_specs
from engine.model.config import ModelConfig

DEFAULT_UTILIZATION = 0.90
CPU_DEFAULT_TOKENS = 1 << 16
GIB = 1 << 30
log = logging.getLogger("dsv4.engine")


@dataclass(frozen=True)
class KvPlan:
    """How many tokens the cache pool holds and where the number came from (logged once at load)."""

    tokens: int
    pool_bytes: int
    source: str  # the log line's explanation

    def describe(self, cfg: ModelConfig, max_num_seqs: int) -> str:
        full = max(1, cfg.max_position_embeddings)
        return (
            f"KV cache: {self.tokens} tokens ({self.pool_bytes / GIB:.2f} GiB): {self.tokens // full} request(s) "
            f"at the full {full}-token context, or {max_num_seqs} concurrent requests of up to "
            f"{self.tokens // max(1, max_num_seqs)} tokens each; {self.source}"
        )


def pool_bytes(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Bytes of every cache group's page tensor for this config."""
    total = 0
    for s in group_specs(cfg, cache, dtype):
        total += len(s.layers) * s.num_pages * s.page_rows * s.width * torch.empty(0, dtype=s.dtype).element_size()
    return total


def fp8_moe_workspace(cfg: ModelConfig, tokens: int) -> int:
    """Peak bytes of the FP8 grouped MoE's padded buffers in one layer (dsv4_kernels.deepgemm_moe) for a step of
    `tokens` tokens: rows = the padded layout's bound (each used expert's segment rounded up to 128 rows), of which
    two buffers live at once at most: gate|up bf16 [rows, 2I] beside either the quantised input [rows, H] or the
    quantised activation [rows, I]; then that activation beside the down output bf16 [rows, H]."""
    from dsv4_kernels.fp8_experts import DEFAULT_ALIGN, padded_rows

    rows = padded_rows(tokens * cfg.num_experts_per_tok, cfg.n_routed_experts, DEFAULT_ALIGN)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return rows * max(4 * i + max(h, i) + 4 * (h // 128), i + 2 * h)


def speculative_buffers(cfg: ModelConfig, max_num_seqs: int, speculative_tokens: int) -> int:
    """Bytes that MTP speculation (K = speculative_tokens) holds beside the step's activations: the verify graphs'
    shared outputs (streams and fp32 logits of max_num_seqs x (K + 1) rows, engine.execution.verify_graphs), the
    MTP graphs' (streams and fp32 logits of max_num_seqs rows, engine.execution.mtp_graphs) and the sampled
    requests' draft distributions (K fp32 vocabulary rows each, engine.execution.spec_sampling); 0 when K = 0."""
    if speculative_tokens <= 0:
        return 0
    row = cfg.hc_mult * cfg.hidden_size * 4 + cfg.vocab_size * 4  # streams (fp32 at most) + fp32 logits
    verify, mtp = max_num_seqs * (speculative_tokens + 1) * row, max_num_seqs * row
    return verify + mtp + max_num_seqs * speculative_tokens * cfg.vocab_size * 4


def activation_reserve(
    cfg: ModelConfig,
    max_batch_tokens: int,
    max_num_seqs: int,
    fp8_experts: bool = False,
    speculative_tokens: int = 0,
    prefill_graphs: bool | None = None,
) -> int:
    """Bytes kept back for one step's activations and the decode CUDA-graph pool (an estimate, logged): per token
    of the largest step (the prefill budget, the decode batch, or with speculation its verify step of K + 1 rows a
    request), the fp32 hc streams and mixes, the attention query/output rows, the routed-expert intermediates and
    the logits row, with 2x headroom, plus 1 GiB, plus the step's context-dependent workspace at the longest context
    served (`step_workspace`); with FP8 experts (engine.model.fp8_expert_weights), their grouped GEMMs' padded
    buffers (`fp8_moe_workspace`); with speculation, its buffers (`speculative_buffers`); with prefill steps under
    CUDA graphs (prefill_graphs; None: $DSV4_PREFILL_GRAPHS), their pool (`prefill_graph_pool`)."""
    tokens = max(max_batch_tokens, max_num_seqs * (1 + max(speculative_tokens, 0)))
    moe = fp8_moe_workspace(cfg, max_batch_tokens) if fp8_experts else 0
    spec = speculative_buffers(cfg, max_num_seqs, speculative_tokens)
    if prefill_graphs is None:
        from dsv4_kernels.settings import settings

        prefill_graphs = settings().prefill_graphs
    graphs = prefill_graph_pool(cfg, max_batch_tokens, max_num_seqs, fp8_experts) if prefill_graphs else 0
    return (
        2 * tokens * _step_bytes_a_token(cfg)
        + GIB
        + step_workspace(cfg, tokens, max_num_seqs).total
        + moe
        + spec
        + graphs
    )


def _step_bytes_a_token(cfg: ModelConfig) -> int:
    """A step's activations a token: the fp32 hc streams and mixes, the attention query / output rows, the routed
    experts' intermediates and the logits row."""
    return (
        4 * cfg.hc_mult * cfg.hidden_size * 4
        + 2 * cfg.num_heads * cfg.head_dim * 2
        + 3 * cfg.num_experts_per_tok * cfg.moe_intermediate_size * 2
        + 4 * cfg.vocab_size
    )


def prefill_graph_pool(cfg: ModelConfig, max_batch_tokens: int, max_num_seqs: int, fp8_experts: bool = False) -> int:
    """Bytes the prefill CUDA graphs' memory pool holds (engine.execution.prefill_graphs): the activations of the
    largest bucket's step (its padded tokens are at most the step budget), estimated as one eager step's (2x
    headroom, the context-dependent workspace, the FP8 experts' buffers), plus the logits of its request rows. Kept
    on top of the eager step's reserve: the pool's blocks serve only graph replays, while steps no bucket holds
    (and decode graphs, their own pool) still need theirs."""
    moe = fp8_moe_workspace(cfg, max_batch_tokens) if fp8_experts else 0
    work = step_workspace(cfg, max_batch_tokens, max_num_seqs).total
    return 2 * max_batch_tokens * _step_bytes_a_token(cfg) + work + moe + (max_num_seqs + 1) * cfg.vocab_size * 4


@dataclass(frozen=True)
class StepWorkspace:
    """The largest context-dependent buffers of one step (bytes), at `context` (engine.model.batch, the indexer):
    visible: per-request candidate rows, int64 [B, context // r] for each group scored or attended in full
      (the indexer's kv4 keys, each HCA ratio), B = max_num_seqs (decode slots or prefill requests);
    scores: the indexer's fp32 scores of one query block, at most dsv4_kernels.indexer.SCORES_BUDGET
      (query_blocks), plus its top-k picks;
    attention_rows: the fast path's int32 row ids [T, window + max(index_topk, context // smallest HCA ratio)];
    hca_lists: the fp8-cache prefill path's per-token HCA lists (engine.model.attention_fp8.dequantised_attend
      takes [T, E] rows, visibility and store ids: ~25 bytes a token and entry, E = context // smallest HCA ratio);
    swa: the SWA sources, int64 x 3 + 2 flags [T, window]."""

    context: int
    tokens: int
    visible: int
    scores: int
    attention_rows: int
    hca_lists: int
    swa: int

    @property
    def total(self) -> int:
        return self.visible + self.scores + self.attention_rows + self.hca_lists + self.swa

    def describe(self) -> str:
        return (
            f"step workspace at {self.context} tokens of context, {self.tokens} tokens a step: "
            f"{self.total / GIB:.2f} GiB (visible-entry rows {self.visible / GIB:.3f}, indexer scores "
            f"{self.scores / GIB:.3f}, attention row ids {self.attention_rows / GIB:.3f}, fp8-path HCA lists "
            f"{self.hca_lists / GIB:.3f}, SWA sources "
            f"{self.swa / GIB:.3f})"
        )


def step_workspace(
    cfg: ModelConfig, max_batch_tokens: int, max_num_seqs: int, context: int | None = None
) -> StepWorkspace:
    """StepWorkspace of the largest step (max(max_batch_tokens, max_num_seqs) tokens) at `context` (default
    cfg.max_position_embeddings, which --max-model-len caps: no admitted request goes past it)."""
    from dsv4_kernels.indexer import SCORES_BUDGET, query_blocks

    context = cfg.max_position_embeddings if context is None else context
    tokens = max(max_batch_tokens, max_num_seqs)
    hca = [r for r in cfg.ratios if r != 4]
    scored = ([4] if cfg.indexer_layers else []) + hca
    visible = sum(8 * max_num_seqs * max(1, context // r) for r in scored)
    scores = 0
    if cfg.indexer_layers:
        entries = max(1, context // 4)
        t0, t1 = query_blocks(tokens, entries, SCORES_BUDGET)[0]
        scores = 4 * (t1 - t0) * entries + 8 * tokens * cfg.index_topk
    widest_hca = max([0] + [max(1, context // r) for r in hca])
    comp = max(cfg.index_topk if cfg.indexer_layers else 0, widest_hca)
    window = cfg.sliding_window
    return StepWorkspace(
        context, tokens, visible, scores, 4 * tokens * (window + comp), 25 * tokens * widest_hca, 26 * tokens * window
    )


def plan_kv_tokens(
    cfg: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    device,
    max_batch_tokens: int,
    utilization: float | None = None,
    max_cached_tokens: int | None = None,
    snapshot_slots: int = 0,
    fp8_experts: bool = False,
    speculative_tokens: int = 0,
) -> KvPlan:
    """-> the pool size: `max_cached_tokens` if given, 65536 off CUDA, else from `utilization` of the GPU.
    fp8_experts: the routed experts run as FP8 (activation_reserve counts their padded buffers); speculative_tokens:
    MTP speculation's K (its verify steps and buffers, activation_reserve).
    snapshot_slots: slots of the prefix cache's snapshot store (engine.execution.prefix_cache), allocated beside the pool:
    each holds one request's SWA ring and compressor state, so they come out of the same budget."""
    if max_cached_tokens is not None:
        c = replace(cache, max_tokens=max_cached_tokens)
        return KvPlan(max_cached_tokens, pool_bytes(cfg, c, dtype), "set by --max-cached-tokens")
    dev = torch.device(device)
    if dev.type != "cuda":
        c = replace(cache, max_tokens=CPU_DEFAULT_TOKENS)
        return KvPlan(CPU_DEFAULT_TOKENS, pool_bytes(cfg, c, dtype), "CPU default")
    util = DEFAULT_UTILIZATION if utilization is None else utilization
    if not 0.0 < util <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    free, total = torch.cuda.mem_get_info(dev)
    reserve = activation_reserve(cfg, max_batch_tokens, cache.max_requests, fp8_experts, speculative_tokens)
    snapshots = snapshot_store_bytes(group_specs(cfg, cache, dtype), snapshot_slots)
    # This process's own allocations (the weights), not the device-wide use: equal shards on equal GPUs then
    # size equal pools on every tensor-parallel rank. What other processes hold still caps it (free memory).
    ours = torch.cuda.memory_allocated(dev)
    budget = min(util * total - ours, free) - reserve - snapshots
    page = cache.page_tokens
    fixed = pool_bytes(cfg, replace(cache, max_tokens=0), dtype)
    probe = 1024 * page
    per_token = (pool_bytes(cfg, replace(cache, max_tokens=probe), dtype) - fixed) / probe
    cap = cache.max_requests * cfg.max_position_embeddings  # more could never be used at once
    tokens = min(cap, int((budget - fixed) // per_token) // page * page) if per_token > 0 else cap
    while tokens > 0 and pool_bytes(cfg, replace(cache, max_tokens=tokens), dtype) > budget:
        tokens -= page  # the ceil()s of the page counts can add a page per group
    if tokens < page:
        raise ValueError(
            f"gpu_memory_utilization {util} leaves no room for the KV cache: {total / GIB:.1f} GiB on "
            f"the device, {ours / GIB:.1f} GiB of weights, {(total - free) / GIB:.1f} GiB in use, "
            f"{reserve / GIB:.1f} GiB reserved for activations and CUDA graphs, "
            f"{snapshots / GIB:.1f} GiB for prefix-cache snapshots; raise it or set --max-cached-tokens"
        )
    workspace = step_workspace(cfg, max_batch_tokens, cache.max_requests)
    source = (
        f"from --gpu-memory-utilization {util:.2f} of {total / GIB:.1f} GiB ({ours / GIB:.1f} GiB of weights, "
        f"{(total - free) / GIB:.1f} GiB in use on the device, {reserve / GIB:.1f} GiB kept for activations "
        f"and CUDA graphs (with the {workspace.describe()}), {snapshots / GIB:.2f} GiB for {snapshot_slots} "
        f"prefix-cache snapshot slots" + (f"; capped at {cap} = max_num_seqs x max context)" if tokens == cap else ")")
    )
    c = replace(cache, max_tokens=tokens)
    return KvPlan(tokens, pool_bytes(cfg, c, dtype), source)


def cap_context(cfg: ModelConfig, max_model_len: int | None) -> ModelConfig:
    """`--max-model-len`: the longest request (prompt + output) this engine serves, which also bounds the
    minimum cache (engine.loading.fit_check), the pool's cap and the decode context buckets; None keeps the model's."""
    if max_model_len is None:
        return cfg
    if not 0 < max_model_len <= cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} must be in [1, {cfg.max_position_embeddings}] (the model's "
            "max_position_embeddings)"
        )
    return replace(cfg, max_position_embeddings=max_model_len)


def log_plan(plan: KvPlan, cfg: ModelConfig, max_num_seqs: int) -> None:
    log.info("%s", plan.describe(cfg, max_num_seqs))


__all__ = [
    "KvPlan",
    "plan_kv_tokens",
    "pool_bytes",
    "activation_reserve",
    "speculative_buffers",
    "prefill_graph_pool",
    "fp8_moe_workspace",
    "step_workspace",
    "StepWorkspace",
    "log_plan",
    "cap_context",
    "DEFAULT_UTILIZATION",
]
