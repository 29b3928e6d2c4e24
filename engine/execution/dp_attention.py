"""Data-parallel attention: N ranks, each with its own requests, scheduler and KV pool, sharing one set of routed
experts split by expert parallelism.

Why: under tensor parallelism every rank stores the same MQA latent cache (engine.execution.tp_executor), so more ranks do not
hold more requests' KV; and a decode step's attention at small per-rank batches is latency-bound. With attention
data-parallel, each rank holds whole attention weights and its own requests' caches: N ranks hold N times the
requests, and only the MoE layers talk (DeepSeek's own serving layout, SGLang's --enable-dp-attention).

Per step, every rank runs one forward of its own tokens (engine.model.model.DeepseekV4Model.forward): the token counts
and token ids are exchanged once (ParallelContext.token_exchange), and each MoE layer gathers every rank's
activations, runs this rank's experts on the pairs routed to them, and returns the partial sums to the tokens'
ranks (engine.model.moe.MoEBlock._forward_dp). So the ranks must step together: `run_lockstep` has each rank say
whether it has work, and while any has, every rank runs one EngineCore step a tick (EngineCore._step_lockstep).
The ranks agree on its kind first: when every rank runs only decode tokens, one decode bucket for all (the
largest batch and context any needs; the counts are then known, so the exchange needs no host-side gather and
CUDA graphs can hold the step; a rank with no requests replays the bucket on padding rows), else eager forwards
(host-side count gather; a rank with no tokens joins through `idle_forward`, its experts serving the others).

Here: `run_lockstep` (every rank), and the one-host driver for `LLM(..., data_parallel_attention=True)`: rank 0
broadcasts each generate() call's prompts, every rank takes its share (prompt i goes to rank i % N), they run in
lockstep, and rank 0 gathers the outputs in prompt order (`dp_generate` on rank 0, `dp_follow` on the others).

The serving workers run the same lockstep in their engine loops (engine.runtime.engine_loop): with `dsv4 serve
--data-parallel-attention` every rank is a worker of its own to the router (service.rank_placement).

Decode modes: 'bucketed' runs the agreed buckets without graphs (the CPU tests); 'graphs' captures them (every
rank the same shapes in the same order, so the captures' collectives pair up) but has run on no multi-GPU
machine yet, so 'auto' does not pick it for these ranks. Not yet: overlapped decode. The tokens and log-probs
equal one engine's (tests/engine/test_dp_attention.py, tests/service/test_service_dp_attention.py).
"""

from __future__ import annotations

import torch.distributed as dist

from engine.execution.request import GenerationOutput
from engine.execution.sampling_params import SamplingParams
from engine.model.parallel import ParallelContext

STOP = "stop"


def run_lockstep(engine) -> int:
    """Every rank of a data-parallel attention group: step this rank's requests until no rank has work, one
    forward a step on every rank. -> the steps run. engine: an EngineCore built with the group's context."""
    ctx: ParallelContext = engine.data_parallel
    if ctx is None:
        raise ValueError("run_lockstep needs an engine built with a data-parallel attention context")
    steps = 0
    while any(ctx.gather_counts(int(engine.has_work))):
        engine.step()  # with or without requests of its own (EngineCore._step_lockstep agrees the tick)
        steps += 1
    return steps


def _run_share(engine, job) -> list[tuple[int, GenerationOutput]]:
    """This rank's share of one generate() call: (prompt index, output) of prompts i with i % N == rank."""
    ctx = engine.data_parallel
    prompts, params = job
    mine = [i for i in range(len(prompts)) if i % ctx.tp_size == ctx.rank]
    ids = {i: engine.add_request(list(prompts[i]), params[i]) for i in mine}
    run_lockstep(engine)
    return [(i, engine.pop_finished(rid).to_output()) for i, rid in ids.items()]


def dp_generate(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
    """Rank 0: run one generate() call across the group -> outputs in prompt order."""
    ctx = engine.data_parallel
    parts = _gather_outputs(ctx, _run_share(engine, ctx.broadcast_object((prompts, params))))
    out: list = [None] * len(prompts)
    for part in parts:
        for i, o in part:
            out[i] = o
    return out


def dp_follow(engine) -> int:
    """Ranks other than 0: serve rank 0's generate() calls until it releases them. -> calls served."""
    ctx = engine.data_parallel
    calls = 0
    while True:
        job = ctx.broadcast_object()
        if job == STOP:
            return calls
        _gather_outputs(ctx, _run_share(engine, job))
        calls += 1


def _gather_outputs(ctx: ParallelContext, mine: list) -> list[list]:
    """Every rank's (prompt index, output) pairs, in rank order, over the host-side group."""
    parts: list = [None] * ctx.tp_size
    dist.all_gather_object(parts, mine, group=ctx.cpu_group if ctx.cpu_group is not None else ctx.group)
    return parts


def release(engine) -> None:
    """Rank 0: end the other ranks' dp_follow loops."""
    engine.data_parallel.broadcast_object(STOP)
