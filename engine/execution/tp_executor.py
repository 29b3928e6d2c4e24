"""One rank schedules, every rank executes: the step inputs that cross from rank 0 to the others.

A tensor-parallel engine is one `EngineCore` per rank, all built alike (same config, same cache pool
geometry, weights cut by engine.model.sharding). Only rank 0 has requests: it schedules, samples and owns the
page allocator. Each step it hands `EngineCore.execute` one `StepInputs` (what `build_step` or the decode
runner needs: token ids, positions, page tables, logit rows), which is broadcast once (pickled, gloo /
NCCL `broadcast_object_list`) before rank 0 runs it; the other ranks sit in `follow(engine)` and execute
the same inputs on their own pool, so every rank derives the same StepBatch and writes the same rows.
This is vLLM v1's shape (the scheduler output is broadcast, each worker prepares its own input tensors):
the broadcast carries a few hundred bytes of Python lists, not the step's index tensors.

KV per rank: V4's attention is MQA (one K=V latent for all heads), and the compressor, indexer and SWA
rows depend on no head, so every rank computes and stores the SAME caches (as MLA TP implementations
keep the full latent cache on each rank). Rank 0's pages therefore hold everything a hand-off needs.
Whatever changes rank 0's pool outside a forward must reach the other ranks: `StepInputs.sync` names
pages (group -> page ids) whose rows rank 0 broadcasts before the step runs (`replicate_pages`, one
tensor broadcast per group). EngineCore uses it for a prefix-cache hit (the SWA / compressor-state
snapshot restored into the request's own pages on rank 0; shared history pages were written by every
rank's forwards already) and for a KV import (a transfer backend writes rank 0's pool; `commit_import`
replicates the request's pages before it joins the batch). So the other ranks never hold a snapshot
store, and a transfer plan only ever addresses rank 0's pages.

Sampling happens on rank 0 only; the logits every rank computes are identical (all-gathered), the
others drop theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORWARD, DECODE, SYNC, STOP = "forward", "decode", "sync", "stop"


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs. kind FORWARD: `engine.model.batch.build_step(pool, token_ids, starts, tables,
    logit_rows, snapshots)`; DECODE: `DecodeRunner.run(request_ids, [t[0] for t in token_ids], starts, tables)`;
    SYNC: only `sync`; STOP: the followers leave `follow`. Every kind first replicates the `sync` pages."""

    kind: str
    token_ids: tuple = ()  # per request: the token ids it runs this step
    starts: tuple = ()  # per request: position of its first token
    tables: tuple = ()  # per request: its page table {group: [page ids]} (rank 0's allocator)
    logit_rows: tuple = ()  # FORWARD: rows of the step whose logits are returned
    request_ids: tuple = ()  # DECODE: keys of the decode runner's persistent block tables
    sync: tuple = ()  # page tables {group: [page ids]} whose rows rank 0 broadcasts before running
    snapshots: tuple = ()  # FORWARD, per request (or empty): (point, {group: staging page}) or None

    def __post_init__(self):
        if self.kind not in (FORWARD, DECODE, SYNC, STOP):
            raise ValueError(f"StepInputs.kind must be one of {(FORWARD, DECODE, SYNC, STOP)}, got {self.kind!r}")
        n = len(self.token_ids)
        if len(self.starts) != n or len(self.tables) != n or len(self.snapshots) not in (0, n):
            raise ValueError(
                f"StepInputs: {n} token lists, {len(self.starts)} starts, {len(self.tables)} tables, "
                f"{len(self.snapshots)} snapshots"
            )
        if self.kind == DECODE and (len(self.request_ids) != n or any(len(t) != 1 for t in self.token_ids)):
            raise ValueError("StepInputs(decode) needs one request id and exactly one token per request")


def follow(engine) -> int:
    """A non-zero rank's loop: execute every step rank 0 broadcasts until it broadcasts STOP.

    -> the number of steps executed. engine: an EngineCore built with this rank's ParallelContext.
    """
    ctx = engine.parallel
    if ctx.is_driver:
        raise ValueError("follow() runs on ranks other than 0; rank 0 schedules")
    steps = 0
    while True:
        inputs = ctx.broadcast_object()
        if inputs.kind == STOP:
            return steps
        engine.execute(inputs)
        steps += 1


def release_followers(engine) -> None:
    """Rank 0: end the other ranks' `follow` loops (call once, when the engine is done)."""
    if engine.parallel.enabled and engine.parallel.is_driver:
        engine.parallel.broadcast_object(StepInputs(STOP))


def replicate_pages(pool, tables, ctx) -> None:
    """Copy rank 0's rows of the pages in `tables` (a sequence of {group: [page ids]}) to every rank.

    One broadcast per group, of [layers, rows, width] in the group's storage dtype (fp8 pools move bytes).
    """
    if not ctx.enabled or not tables:
        return
    for name, group in pool.groups.items():
        pages = sorted({p for t in tables for p in t.get(name, ())})
        if not pages:
            continue
        rows_per = group.spec.page_rows
        rows = (torch.tensor(pages, dtype=torch.long).unsqueeze(1) * rows_per + torch.arange(rows_per)).reshape(-1)
        rows = rows.to(group.tensor.device)
        data = (
            group.tensor.index_select(1, rows)
            if ctx.is_driver
            else group.tensor.new_empty(group.tensor.shape[0], rows.numel(), group.tensor.shape[2])
        )
        ctx.broadcast_tensor(data)
        if not ctx.is_driver:
            group.tensor.index_copy_(1, rows, data)
