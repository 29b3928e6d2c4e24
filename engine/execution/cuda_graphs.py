"""Decode under CUDA graphs: one graph per DecodeShape bucket, captured at start-up (engine.execution.warmup) or on first
use, replayed after.

A decode step's Python work (per-layer op dispatch, Triton launch setup) costs far more than its GPU
time at decode batch sizes, so decode steps replay a captured graph instead. Shapes come from
`engine.model.decode_batch` (fixed per bucket, padding rows on the scratch page). Per bucket:
- the graph holds the whole step: deriving the StepBatch's index tensors on the device from its static
  DecodeInputs ([3, slots] int64: tokens, positions, BlockTables rows) and the forward; refreshing a
  step's inputs is one host-to-device copy, and page tables live in the persistent BlockTables;
- capture: two warm-up forwards on a side stream (Triton compiles, allocator settles), then the capture;
  every bucket shares one memory pool (replays never overlap and each output is consumed before the
  next replay);
- the output is the first `slots` rows of one logits buffer all graphs share: valid until the next replay (any
  bucket's); the graph also holds the greedy pick of every row (argmax + its log-prob, fp64 [2, slots]), so an
  all-greedy step reads its tokens with one device-to-host copy and no launch outside the graph (`take_greedy`).
Warm-up and capture run on a padding-only batch, so they write the scratch page and nothing else.

`DecodeRunner(mode="eager")` runs the same fixed-shape batches without graphs: the CPU tests use it
to pin that a bucketed step computes what `build_step`'s batch computes.

Data-parallel attention (`dp_ranks` > 1, engine.execution.dp_attention): the ranks of a group agree on one shape a decode
step (EngineCore's lockstep tick: the largest any rank needs), so every rank's MoE exchange moves `slots` rows
a rank; the forward gets those counts instead of gathering them on the host (ParallelContext.token_exchange),
which leaves only device collectives in the step, and a rank without requests replays the same shape on padding
rows (`run_idle`) to serve its experts. Every rank captures the same shapes in the same order (capture_all at
warm-up, or the same first use on every rank), so the captures' collectives pair up.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from engine.execution.sampling import greedy_pick
from engine.model.batch import copy_nonblocking_
from engine.model.cache import CachePool
from engine.model.decode_batch import BlockTables, DecodeInputs, DecodeShape, derive_decode_batch, doublings_and_halves

logger = logging.getLogger(__name__)
Result = TypeVar("Result")

MIN_CONTEXT_BUCKET = 256


def slot_buckets(max_slots: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 32, of 16 to 128, of 32 beyond; always ending at max_slots."""
    out, n = [], 1
    while n < max_slots:
        out.append(n)
        n = n * 2 if n < 8 else n + (8 if n < 32 else 16 if n < 128 else 32)
    return out + [max_slots]


def context_buckets(max_context: int) -> list[int]:
    """256, 384, 512, 768, 1024, ... (powers of two and 1.5x them), ending at max_context: a step reads
    at most 1.5x the entries it needs, with two graphs per doubling of the context."""
    return doublings_and_halves(MIN_CONTEXT_BUCKET, max_context) + [max_context]


def warm_up(forward: Callable[[], Result], device: torch.device, times: int = 2) -> Result:
    """Run `forward` `times` times on a side stream before capturing it (Triton compiles, DeepGEMM's JIT, the caching
    allocator settles, all off the stream that captures) -> its last result."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            out = forward()
    torch.cuda.current_stream(device).wait_stream(side)
    return out


@dataclass
class _Graph:
    inputs: DecodeInputs  # static device inputs the graph reads
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # static output [slots, vocab]
    greedy: torch.Tensor  # static output fp64 [2, slots]: engine.execution.sampling.greedy_pick(logits), in the graph


class DecodeRunner:
    """Runs fixed-shape decode steps; mode "graphs" (CUDA) replays captured graphs, "eager" just forwards."""

    def __init__(self, model, pool: CachePool, mode: str, max_slots: int, max_context: int):
        if mode not in ("graphs", "eager"):
            raise ValueError(f"DecodeRunner mode must be 'graphs' or 'eager', got {mode!r}")
        if mode == "graphs" and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.pool, self.mode = model, pool, mode
        self.slots = slot_buckets(max_slots)
        self.contexts = context_buckets(max_context)
        self.graphs: dict[DecodeShape, _Graph] = {}
        self.steps = 0  # decode steps this runner ran (graphs replayed or eager bucketed)
        self.block_tables = BlockTables(pool, max_slots, max_context, model.device)
        self._mempool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        self._greedy: torch.Tensor | None = None  # [2, n] of the last replay, until taken
        self._logits: torch.Tensor | None = None  # [max slots, vocab]: every graph's output rows (module doc)
        self.dp_ranks = 0  # > 1: a data-parallel attention rank (module docstring), set by its EngineCore

    def _forward(self, batch, shape: DecodeShape) -> torch.Tensor:
        counts = (shape.slots,) * self.dp_ranks if self.dp_ranks > 1 else None
        return self.model.forward(batch, self.pool, counts)

    def shape_for(self, num_requests: int, context: int) -> DecodeShape | None:
        """The smallest bucket holding num_requests rows at positions < context; None when none does."""
        i = bisect.bisect_left(self.slots, num_requests)
        j = bisect.bisect_left(self.contexts, context)
        if i == len(self.slots) or j == len(self.contexts):
            return None
        return DecodeShape(self.slots[i], self.contexts[j])

    def run(
        self,
        request_ids: list[str],
        token_ids: list[int],
        positions: list[int],
        tables: list[dict],
        token_source: torch.Tensor | None = None,
        shape: DecodeShape | None = None,
    ) -> torch.Tensor | None:
        """One decode step: request b runs token_ids[b] at positions[b] with page table tables[b].

        token_source: device [n] token ids (any dtype holding integers) that replace token_ids, copied on the
        device in stream order (engine.execution.decode_overlap: the previous step's greedy picks, not yet on the host).
        shape: the bucket to run (a data-parallel group's agreed one; it must hold the step), else the smallest.
        -> fp32 logits [len(token_ids), vocab] (a view of a static buffer under graphs: read it before the
        next step), or None when no bucket fits (the caller runs the step eagerly).
        """
        n = len(token_ids)
        shape = shape or self.shape_for(n, max(positions) + 1)
        if shape is None:
            return None
        rows = self.block_tables.rows_for(request_ids, tables)
        self.steps += 1
        host = DecodeInputs.make(token_ids, positions, rows, shape, self.block_tables.pad_row)
        if self.mode == "eager":
            inputs = DecodeInputs(host.packed.to(self.model.device))
            if token_source is not None:
                inputs.packed[0, :n].copy_(token_source)
            batch = derive_decode_batch(self.pool, self.block_tables, inputs, shape)
            return self._forward(batch, shape)[:n]
        graph = self.graphs.get(shape) or self._capture(shape)
        # Pinned + non_blocking: the host does not wait for the steps queued before this one.
        copy_nonblocking_(graph.inputs.packed, host.packed)
        if token_source is not None:
            graph.inputs.packed[0, :n].copy_(token_source)
        graph.graph.replay()
        self._greedy = graph.greedy[:, :n]
        return graph.logits[:n]

    def run_idle(self, shape: DecodeShape) -> None:
        """A data-parallel rank with no decode requests in a decode step of its group: `shape` on padding rows
        only (they write the scratch page), so its routed experts serve the other ranks' tokens."""
        self.run([], [], [], [], shape=shape)
        self._greedy = None

    def take_greedy(self) -> torch.Tensor | None:
        """The last replay's greedy tokens and log-probs, fp64 [2, n] (engine.execution.sampling.greedy_pick over its
        logits, computed inside the graph), once; None after an eager run or when already taken."""
        out, self._greedy = self._greedy, None
        return out

    def capture_all(self) -> int:
        """Capture every (slots, context) bucket not captured yet (engine.execution.warmup, before serving: a bucket first
        met mid-stream would otherwise stall its step on the capture and on the Triton compiles its shapes
        need). -> how many were captured."""
        if self.mode != "graphs":
            return 0
        todo = [DecodeShape(s, c) for s in self.slots for c in self.contexts if DecodeShape(s, c) not in self.graphs]
        for shape in todo:
            t = time.perf_counter()
            self._capture(shape)
            logger.info("captured decode graph %s: %.2f s", shape, time.perf_counter() - t)
        return len(todo)

    def _capture(self, shape: DecodeShape) -> _Graph:
        # Padding only (every row on the scratch pages), so warm-up and capture write nothing else.
        pad = DecodeInputs.make([], [], [], shape, self.block_tables.pad_row)
        inputs = DecodeInputs(pad.packed.to(self.model.device))
        device = self.model.device
        warm = warm_up(
            lambda: self._forward(derive_decode_batch(self.pool, self.block_tables, inputs, shape), shape), device
        )
        if self._logits is None:  # outside the graphs' pool: one buffer for every bucket's output
            self._logits = torch.empty(self.slots[-1], warm.shape[-1], dtype=warm.dtype, device=device)
        out = self._logits[: shape.slots]
        graph = torch.cuda.CUDAGraph()
        # thread_local: workers capture on their engine thread while other threads (KV transfer, HTTP)
        # may touch CUDA; only this thread's calls must be capture-safe.
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            logits = self._forward(derive_decode_batch(self.pool, self.block_tables, inputs, shape), shape)
            # Copied into the shared buffer: the forward's own logits return to the pool after the capture, so
            # the graphs of all buckets (captured at start-up) hold one [max slots, vocab] output, not one each.
            out.copy_(logits)
            greedy = greedy_pick(out)  # the sampling of greedy requests rides in the graph
        del logits
        self.graphs[shape] = _Graph(inputs, graph, out, greedy)
        return self.graphs[shape]
