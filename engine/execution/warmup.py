"""Start-up warm-up of a CUDA serving engine: compile now what the first requests would otherwise wait on.

Run by `load_engine(warmup=True)`: the prefill / decode workers and the local dispatchers; one-shot use (LLM,
`dsv4 generate`) skips it, as one prompt would pay minutes of compiles it never needs.

Why: on a machine whose caches are cold, DeepGEMM compiles a kernel with nvcc for each (N, K) and each
configuration its heuristic picks for a step's M, and Triton compiles each kernel on its first launch, seconds
each. Served without a warm-up, the first requests of new lengths stall on it for seconds (BENCHMARKS.md, "Cold
start on a GPU: per-request stalls without and with the engine warm-up"). vLLM compiles its
DeepGEMM kernels for every M before serving (deep_gemm_warmup); SGLang sends a warm-up request at start. Here:
1. a ladder of requests through the engine itself, one at a time so each prefill step has exactly its prompt's
   tokens (no chunk ends at a prefix-cache snapshot point here): 1, 2, 4, ... up to max_batch_tokens (and the
   model's length), with an odd step beside each power from 8 (prompt_ladder). Our Triton kernels depend on a
   step's token count only through its power-of-two bucket (their count, stride and index-pointer arguments are
   not specialised); the odd steps cover library kernels that do specialise. So these steps compile every
   variant a serving step of up to max_batch_tokens tokens can need. Each runs its prefill, one decode step
   (under CUDA graphs: the batch-1 graphs of those contexts are captured now; an engine that only prefills, a
   prefill worker's, stops at the first token as its requests do) and sampling; every page returns and the
   prefix cache forgets the prompts;
2. every decode bucket's CUDA graph is captured (DecodeRunner.capture_all: each (batch slots, context) pair, on
   padding rows that write only the scratch page; a speculative engine captures its verify buckets instead,
   VerifyRunner.capture_all, with 1 and K + 1 rows a request, and its MTP pass and chain graphs,
   MtpRunner.capture_all), so no step mid-stream waits on a capture or on the Triton
   compiles its shapes need (on a cold machine a single decode step otherwise stalls for seconds); with prefill
   graphs ($DSV4_PREFILL_GRAPHS, engine.execution.prefill_graphs) the buckets of one request's first chunk too
   (PrefillRunner.capture_all; the ladder's prefill steps already replayed, so captured, some of them), the others
   (several requests a step, a long prompt's later chunks) on first use;
3. every FP8 GEMM shape those steps ran (dsv4_kernels.deepgemm_linear records them) at the M values whose DeepGEMM
   configuration can differ: all M up to 128, then the lowest and highest M of each 64-row block count up to
   max_batch_tokens (the heuristic sees a larger M through its number of M-blocks, whose sizes are multiples of
   64, and through thresholds on block edges). The compiles are spread over spawned processes
   ($DSV4_WARMUP_PROCS, default half the CPUs up to 8): one after another they take minutes (each shape an nvcc
   compile of seconds). Each process holds a CUDA context (~0.5 GB) and M x K
   activations until the sweep ends, from the memory the KV pool left free (1 - --gpu-memory-utilization);
   DSV4_WARMUP_PROCS=1 sweeps in this process where that is tight. Then the MXFP4 MoE (triton_kernels' matmul),
   whose variants also follow its row-block count: one call per class of token count (sweep_moe_variants); and
   on an engine holding FP8 routed experts (a prefill engine's, engine.model.fp8_expert_weights), both of their
   grouped GEMMs at every row count a step's contiguous layout can have (sweep_fp8_experts: the exact layout's
   M follows the routing, so the ladder's steps do not meet them all).
A data-parallel attention rank (engine.execution.dp_attention) warms up with its group: every rank runs the same ladder
(the lengths all of them fit), each prompt drained in lockstep (`run_lockstep`: one forward a tick on every
rank, so each MoE layer's exchange pairs up), as its serving loop steps; its load_engine returns once all ranks
are through. Its decode steps run eager (no graphs on these ranks yet), so phase 2 has nothing to capture.
Not done: tensor-parallel ranks (the request would need the followers' step loop, which starts after loading).

$DSV4_WARMUP: 1 (default) all three; quick: 1 and 2 only (the DeepGEMM configurations of other M values and the
MoE's other variants then compile when a step first needs them); 0: none. Each phase's seconds are logged: on a cold
cache the warm-up takes minutes even for a small model (the compiles, not the steps; BENCHMARKS.md, "Cold start"), so
deployments keep the caches on a volume ($DG_JIT_CACHE_DIR, $TRITON_CACHE_DIR; the Helm chart's compileCache).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from dsv4_kernels.settings import BY_NAME, WARMUP, settings
from engine.execution.dp_attention import run_lockstep
from engine.execution.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GEMM_ALL_M_UPTO = 128  # every M up to here; beyond, one M per 64-row block count
GEMM_M_STEP = 64


WARMUP_MODES = BY_NAME[WARMUP].choices  # ("1", "quick", "0")


@dataclass(frozen=True)
class WarmupReport:
    prompts: tuple[int, ...]  # prompt lengths run through the engine
    graphs: int  # decode CUDA graphs captured
    gemm_shapes: int  # distinct FP8 GEMM (N, K) warmed at every M class
    gemm_calls: int
    seconds: tuple[float, float, float]  # ladder, graphs, GEMM + MoE sweeps
    moe_calls: int = 0  # MXFP4 MoE calls of the variant sweep (sweep_moe_variants)
    fp8_moe_calls: int = 0  # FP8 experts' grouped GEMM calls (sweep_fp8_experts)
    prefill_graphs: int = 0  # prefill CUDA graphs captured by phase 2 (the ladder's steps captured others)


def warmup_mode() -> str:
    return settings().warmup  # one of WARMUP_MODES (checked when parsed)


def gemm_processes() -> int:
    """Processes compiling the GEMM sweep side by side: $DSV4_WARMUP_PROCS, else half the CPUs this process may
    use (at most 8; each holds a small CUDA context)."""
    procs = settings().warmup_procs
    if procs is not None:
        return procs
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def warmup_enabled(engine) -> bool:
    """On a CUDA engine that schedules its own steps (one rank, or a data-parallel attention rank, which warms up
    in lockstep with its group) unless $DSV4_WARMUP=0."""
    return warmup_mode() != "0" and engine.device.type == "cuda" and not engine.parallel.enabled


def prompt_ladder(max_batch_tokens: int, max_prompt: int) -> list[int]:
    """1, 2, 4, ... below max_batch_tokens, then max_batch_tokens itself, each from 8 up preceded by its odd
    neighbour n - 1 (same power-of-two bucket); none above max_prompt.

    Why the odd steps: Triton specialises integer arguments on == 1 and on divisibility by 16 (and pointers on
    16-byte alignment). Our kernels leave their step-dependent arguments unspecialised, but a library kernel's
    may not be (triton_kernels' matmul_ogs specialises its write-back size, T * top-k): the powers of two only
    meet the divisible class, so an odd step per bucket compiles the other (else it compiles mid-request)."""
    top = max(1, min(max_batch_tokens, max_prompt))
    out, n = [], 1
    while n < top:
        out += [n - 1, n] if n >= 8 else [n]
        n *= 2
    return out + ([top - 1, top] if top >= 8 and top - 1 not in out else [top])


def gemm_m_values(max_tokens: int) -> list[int]:
    """The M values at which one FP8 GEMM shape is run (module docstring, item 3): every M up to 128, then both
    ends of each 64-row block count (the lowest and highest M with that count: a threshold of the heuristic
    such as m >= 512 falls on a block edge, so each side of it is run)."""
    small = range(1, min(GEMM_ALL_M_UPTO, max_tokens) + 1)
    tops = range(GEMM_ALL_M_UPTO + GEMM_M_STEP, max_tokens + GEMM_M_STEP, GEMM_M_STEP)
    ends = {min(m, max_tokens) for m in tops} | {m - GEMM_M_STEP + 1 for m in tops if m - GEMM_M_STEP < max_tokens}
    return sorted({*small, *ends})


def warm_engine(engine, sweep_gemms: bool | None = None, decodes: bool = True) -> WarmupReport:
    """Run the warm-up on `engine` (an idle EngineCore); -> what ran. Leaves the pool as it found it.
    sweep_gemms: run phase 3 (None: unless $DSV4_WARMUP=quick). decodes: False for an engine that only prefills
    (a prefill worker's requests are prefill-only): the ladder's requests stop after their first token, as the
    worker's do, and no decode graph is captured (phase 2 skipped: it would hold graph memory never replayed)."""
    if sweep_gemms is None:
        sweep_gemms = warmup_mode() != "quick"
    t0 = time.perf_counter()
    if engine.has_work or engine.requests:
        raise RuntimeError("warm-up needs an idle engine (requests are queued or running)")
    max_tokens = engine.scheduler_config.max_batch_tokens
    lengths = prompt_ladder(max_tokens, engine.cfg.max_position_embeddings - 2)
    lengths = [n for n in lengths if engine._fits_empty_pool(n + 2)]
    dp = engine.data_parallel
    if dp is not None:  # the same ladder on every rank of the group: what all of their pools fit
        top = min(dp.gather_counts(max(lengths, default=0)))
        lengths = [n for n in lengths if n <= top]
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    # Each prompt runs as one step of exactly its length: the scheduler may otherwise end chunks at the prefix
    # cache's snapshot points (block boundaries), and a prompt of 512 would run as 256 + 256, leaving the step
    # sizes of 257..512 tokens to compile mid-request. Blocks are still registered and
    # snapshots taken as the steps run; the cache is emptied after.
    scheduler_prefix, engine.scheduler.prefix = engine.scheduler.prefix, None
    try:
        for n in lengths:
            tn = time.perf_counter()
            prompt = torch.randint(2, engine.cfg.vocab_size, (n,), generator=g).tolist()
            rid = engine.add_request(prompt, params, request_id=f"warmup-{n}", prefill_only=not decodes)
            request = engine.requests[rid]
            if dp is not None:
                run_lockstep(engine)
            while engine.has_work:
                engine.step()
            if decodes:
                engine.pop_finished(rid)
            else:
                engine.release(rid)  # the held caches, as the decode side's confirmation frees them
            if engine.prefix is not None:
                engine.prefix.forget(request)  # (the scheduler, which forgets finished requests, had no cache)
            logger.info("warm-up prompt of %d tokens: %.1f s", n, time.perf_counter() - tn)
    finally:
        engine.scheduler.prefix = scheduler_prefix
    if engine.prefix is not None:
        engine.prefix.clear()  # (the prompts are random: nothing to share)
    t1 = time.perf_counter()
    graphs = _capture_decode_graphs(engine) if decodes and engine.decode_runner is not None else 0
    prefill_graphs = engine.prefill_runner.capture_all() if engine.prefill_runner is not None else 0
    t2 = time.perf_counter()
    logger.info(
        "warm-up: ladder %.1f s, %d decode and %d prefill graphs %.1f s", t1 - t0, graphs, prefill_graphs, t2 - t1
    )
    shapes = calls = moe_calls = fp8_calls = 0
    if engine.device.type == "cuda":
        from engine.model.fast_paths import use_fp8_gemm

        if sweep_gemms and use_fp8_gemm(engine.device, engine.dtype):
            from dsv4_kernels.deepgemm_linear import seen_shapes, warm_shapes

            todo = seen_shapes()  # this process's engines: one, in a worker
            shapes = len(todo)
            calls = warm_shapes(todo, gemm_m_values(max_tokens), gemm_processes())
        if sweep_gemms:
            moe_calls = sweep_moe_variants(engine, max_tokens)
            fp8_calls = sweep_fp8_experts(engine, max_tokens)
        torch.cuda.synchronize(engine.device)
    report = WarmupReport(
        tuple(lengths),
        graphs,
        shapes,
        calls,
        (t1 - t0, t2 - t1, time.perf_counter() - t2),
        moe_calls,
        fp8_calls,
        prefill_graphs,
    )
    logger.info(
        "warm-up: %d prompts (%s tokens) %.1f s, %d decode graphs captured %.1f s, %d FP8 GEMM shapes x %d "
        "M values, %d MXFP4 MoE token counts and %d FP8 expert GEMMs %.1f s",
        len(lengths),
        ",".join(map(str, lengths)),
        report.seconds[0],
        graphs,
        report.seconds[1],
        shapes,
        calls // max(shapes, 1),
        moe_calls,
        fp8_calls,
        report.seconds[2],
    )
    return report


def _capture_decode_graphs(engine) -> int:
    """Phase 2: every decode bucket's graph; for a speculative engine, whose decode-only steps are verify steps
    (engine.execution.verify_graphs), every verify bucket with 1 and with K + 1 rows a request instead, and the MTP
    graphs drafting after them (engine.execution.mtp_graphs: the pass on each of those buckets, the chain steps on
    the one-row buckets when K > 1)."""
    spec = engine.speculator
    if spec is not None and spec.verify is not None:
        queries = sorted({1, spec.k + 1})
        graphs = spec.verify.capture_all(queries)  # first: the MTP pass graphs read their streams buffer
        return graphs + (spec.mtp.capture_all(queries, spec.k - 1) if spec.mtp is not None else 0)
    return engine.decode_runner.capture_all()


def sweep_moe_variants(engine, max_tokens: int) -> int:
    """Phase 3's MoE half: triton_kernels' matmul (dsv4_kernels.mxfp4_ogs) compiles a variant per class of a step's
    token count that the ladder's powers of two and their odd neighbours do not all meet (its row-block count is
    specialised too: a serving step of ~520 tokens would otherwise compile one mid-request). One
    call per `mxfp4_ogs.variant_key` class up to max_tokens, on random tokens through the first MoE layer's
    experts (every layer has the same shapes). -> calls run (0: no layer runs triton_kernels)."""
    blocks = [m for m in engine.model.moe if m.ogs is not None]
    if not blocks:
        return 0
    from dsv4_kernels import mxfp4_ogs  # imports triton_kernels: only where a layer runs it

    ex, k, dev = blocks[0].ogs, engine.cfg.num_experts_per_tok, engine.device
    counts = mxfp4_ogs.variant_tokens(max_tokens, ex.num_experts, k)
    g = torch.Generator(device=dev).manual_seed(0)
    top = max(counts)
    x = torch.randn(top, ex.hidden, generator=g, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, ex.num_experts, (top, k), generator=g, device=dev)
    weights = torch.rand(top, k, generator=g, device=dev)
    for t in counts:
        mxfp4_ogs.ogs_moe(x[:t], weights[:t], ids[:t], ex, engine.cfg.swiglu_limit, shared=x[:t])
    return len(counts) + _sweep_gemv(blocks[0], x, weights, ids)


def _sweep_gemv(block, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> int:
    """With DSV4_MXFP4_GEMV=1, the few-route steps' GEMV kernels (dsv4_kernels.triton_mxfp4_gemv: one variant per
    weight shape, compiled by the first call; the others make sure) -> calls run."""
    from engine.model.fast_paths import use_mxfp4_gemv

    k = ids.shape[1]
    counts = [t for t in range(1, x.shape[0] + 1) if use_mxfp4_gemv(x[:t], k)]
    if not counts:
        return 0
    from dsv4_kernels import triton_mxfp4_gemv

    if block.gemv is None:
        block.gemv = triton_mxfp4_gemv.from_ogs(block.ogs)
    for t in counts:
        triton_mxfp4_gemv.gemv_moe(x[:t], weights[:t], ids[:t], block.gemv, block.cfg.swiglu_limit, shared=x[:t])
    return len(counts)


def sweep_fp8_experts(engine, max_tokens: int) -> int:
    """Phase 3's FP8-expert half: an engine whose routed experts are (also) FP8 and run through DeepGEMM's grouped
    GEMM (engine.model.moe.MoEBlock.takes_fp8) runs both GEMMs at every row count a step of up to max_tokens tokens
    can lay out (dsv4_kernels.deepgemm_moe.warm), through the first such layer's experts (every layer has the same
    shapes). -> GEMM calls run (0: no FP8 experts, or not on DeepGEMM)."""
    from engine.model.fast_paths import use_fp8_expert_gemm

    blocks = [m for m in engine.model.moe if m.fp8 is not None]
    if not blocks or engine.dtype != torch.bfloat16 or not use_fp8_expert_gemm(engine.device):
        return 0
    from dsv4_kernels import deepgemm_moe  # imports deep_gemm: only where a layer runs it

    return deepgemm_moe.warm(blocks[0].fp8, max_tokens, engine.cfg.num_experts_per_tok)
