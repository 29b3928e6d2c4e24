"""Data-parallel attention: N ranks, each with its own requests, scheduler and KV pool, sharing one set of routed
experts split by expert parallelism.

Why: under tensor parallelism every rank stores the same MQA latent cache (engine.tp_executor), so more ranks do not
hold more requests' KV; and a decode step's attention at small per-rank batches is latency-bound. With attention
data-parallel, each rank holds whole attention weights and its own requests' caches: N ranks hold N times the
requests, and only the MoE layers talk (DeepSeek's own serving layout, SGLang's --enable-dp-attention).

Per step, every rank runs one forward of its own tokens (engine.model.DeepseekV4Model.forward): the token counts
(a host-side all-gather) and token ids are exchanged once (ParallelContext.token_exchange), and each MoE layer
gathers every rank's activations, runs this rank's
experts on the pairs routed to them, and returns the partial sums to the tokens' ranks (engine.moe.MoEBlock
._forward_dp). So the ranks must step together: `run_lockstep` has each rank say whether it has work, and while
any has, every rank runs exactly one forward a step: its own step, or `idle_forward` (no tokens, its experts
still serve the others) when it has none or its scheduler ran nothing.

Here: `run_lockstep` (every rank), and the one-host driver for `LLM(..., data_parallel_attention=True)`: rank 0
broadcasts each generate() call's prompts, every rank takes its share (prompt i goes to rank i % N), they run in
lockstep, and rank 0 gathers the outputs in prompt order (`dp_generate` on rank 0, `dp_follow` on the others).

The serving workers run the same lockstep in their engine loops (engine.engine_loop): with `dsv4 serve
--data-parallel-attention` every rank is a worker of its own to the router (service.rank_placement).

Not yet: CUDA graphs and overlapped decode for these engines (each rank's token count varies per step; a graph
per padded bucket, agreed across ranks, is the way). The tokens and log-probs equal one engine's
(tests/engine/test_dp_attention.py, tests/service/test_service_dp_attention.py).
"""

from __future__ import annotations

import torch.distributed as dist

from engine.parallel import ParallelContext
from engine.request import GenerationOutput
from engine.sampling_params import SamplingParams

STOP = "stop"


def run_lockstep(engine) -> int:
    """Every rank of a data-parallel attention group: step this rank's requests until no rank has work, one
    forward a step on every rank. -> the steps run. engine: an EngineCore built with the group's context."""
    ctx: ParallelContext = engine.data_parallel
    if ctx is None:
        raise ValueError("run_lockstep needs an engine built with a data-parallel attention context")
    steps = 0
    while any(ctx.gather_counts(int(engine.has_work))):
        lockstep_forward(engine, engine.step)
        steps += 1
    return steps


def lockstep_forward(engine, step) -> None:
    """This rank's one forward of a tick in which some rank has work: `step()` (an EngineCore step) when this
    rank has work, else -- or when its scheduler ran nothing -- `idle_forward`, whose experts serve the others."""
    before = engine.model.forwards
    if engine.has_work:
        step()
    ran = engine.model.forwards - before
    if ran == 0:
        engine.model.idle_forward()
    elif ran > 1:  # (an EngineCore step runs at most one forward without graphs or overlap)
        raise RuntimeError(f"a data-parallel step ran {ran} forwards; the ranks' exchanges no longer pair up")


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
