"""Fixed-shape verify steps of speculative decoding, under CUDA graphs (or eager bucketed on the CPU).

A verify step is a decode step with `queries` token rows a request (engine.model.verify_batch): the request's
last token and its drafts, padded to K + 1 rows. It is bucketed by (slots, context) exactly as decode steps
are (engine.execution.cuda_graphs: the same slot and context buckets, the same persistent BlockTables and
graph memory pool, so a request keeps one table row across its decode and verify steps) and by `queries`
(1 for a step without drafts, K + 1 with them: two graph families, so the MTP pass always has the streams).

Unlike a decode graph it returns the residual streams too (the MTP layer drafts from them): both land in
buffers shared by every verify graph (streams [rows, hc, D], fp32 logits [rows, vocab], rows = max slots x
max queries), valid until the next verify replay. Capture runs on padding only (scratch pages), as decode's.
Not here: overlapped decode (the Speculator reads every step back), FlashMLA's s_q > 1 sparse decode for fp8
caches (a q > 1 step takes the fp8 Triton path). The step's index tensors come from one launch of the fused
prologue where Triton runs (engine.model.verify_batch.derive_verify_batch), as a decode step's do.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.execution.cuda_graphs import DecodeRunner, warm_up
from engine.model.batch import copy_nonblocking_
from engine.model.decode_batch import DecodeShape
from engine.model.verify_batch import VerifyInputs, VerifyShape, derive_verify_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyStep:
    """The last fixed-shape verify step: its bucket and its residual streams over every row of it [shape.rows, hc,
    D] (the shared buffer under graphs; rows past a request's tokens are padding) and its inputs on the device, both
    valid until the next verify step. The MTP pass reads the streams in place (engine.execution.mtp_graphs) and
    derives its inputs from these (engine.execution.spec_fixed)."""

    shape: VerifyShape
    streams: torch.Tensor
    packed: torch.Tensor  # its inputs on the device, int64 [3, shape.rows] (VerifyInputs: token, position, table row)


@dataclass
class _VerifyGraph:
    packed: torch.Tensor  # static device inputs [3, rows] the graph reads
    graph: torch.cuda.CUDAGraph
    streams: torch.Tensor  # view of the shared streams buffer [rows, hc, D]
    logits: torch.Tensor  # view of the shared logits buffer [rows, vocab]


class VerifyRunner:
    """Runs fixed-shape verify steps with a DecodeRunner's buckets, tables and mode ("graphs" or "eager")."""

    def __init__(self, decode: DecodeRunner, max_queries: int):
        self.decode, self.max_queries = decode, max_queries
        self.graphs: dict[VerifyShape, _VerifyGraph] = {}
        self.steps = 0  # verify steps run (graphs replayed or eager bucketed)
        self.last: VerifyStep | None = None  # the last step run (None before the first)
        self._streams: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None

    def shape_for(self, num_requests: int, context: int, queries: int) -> VerifyShape | None:
        """The smallest bucket holding num_requests requests of `queries` rows at positions < context."""
        d = self.decode
        i = bisect.bisect_left(d.slots, num_requests)
        j = bisect.bisect_left(d.contexts, context)
        if i == len(d.slots) or j == len(d.contexts) or not 1 <= queries <= self.max_queries:
            return None
        return VerifyShape(DecodeShape(d.slots[i], d.contexts[j]), queries)

    @torch.inference_mode()
    def run(
        self,
        request_ids: list[str],
        token_rows: list[list[int]],
        starts: list[int],
        tables: list[dict],
        queries: int,
        fill: Callable[[torch.Tensor], None] | None = None,
        context: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Request b runs token_rows[b] (1..queries tokens) from position starts[b] with page table tables[b].
        fill: called with the step's inputs on the device (int64 [3, rows], VerifyInputs) before the step runs, to
        write what is already on the device there (drafts a previous step left, or the tokens and positions of a
        step launched before the previous one was read: the host's are placeholders then); context: the bound on
        positions the bucket must hold when the host's starts are placeholders (default max(starts) + queries).

        -> (streams [n * queries, hc, D], fp32 logits [n * queries, vocab]): request b's rows are b * queries ..
        (rows past its tokens are padding: never read them). Views of static buffers under graphs (read them
        before the next verify step); None when no bucket fits (the caller runs the varlen step)."""
        n = len(token_rows)
        shape = self.shape_for(n, context if context is not None else max(starts) + queries, queries)
        if shape is None:
            return None
        d = self.decode
        rows = d.block_tables.rows_for(request_ids, tables)
        self.steps += 1
        host = VerifyInputs.make(token_rows, starts, rows, shape, d.block_tables.pad_row)
        used = n * queries
        if d.mode == "eager":
            packed = host.packed.to(d.model.device)
            if fill is not None:
                fill(packed)
            streams, logits = self._forward(packed, shape)
            self.last = VerifyStep(shape, streams, packed)
            return streams[:used], logits[:used]
        graph = self.graphs.get(shape) or self._capture(shape)
        copy_nonblocking_(graph.packed, host.packed)  # pinned, non-blocking: no wait for queued steps
        if fill is not None:
            fill(graph.packed)
        graph.graph.replay()
        self.last = VerifyStep(shape, graph.streams, graph.packed)
        return graph.streams[:used], graph.logits[:used]

    def streams_buffer(self, shape: VerifyShape) -> torch.Tensor:
        """Under graphs: the rows of the shared streams buffer that `shape`'s verify graph writes [rows, hc, D] (the
        MTP pass graphs read them in place); allocated by the first verify capture."""
        if self._streams is None:
            raise RuntimeError("no verify graph captured yet: its streams buffer does not exist")
        return self._streams[: shape.rows]

    def _forward(self, packed: torch.Tensor, shape: VerifyShape) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.decode
        batch = derive_verify_batch(d.pool, d.block_tables, packed, shape)
        streams = d.model.forward_streams(batch, d.pool)
        return streams, d.model.logits(streams)

    @torch.inference_mode()
    def capture_all(self, queries: list[int]) -> int:
        """Capture every (slots, context) bucket for each of `queries` (engine.execution.warmup) -> how many.
        Under inference mode, as every verify step is (engine.execution.spec_fixed): a bucket first met by a step
        is captured there, and its shared output buffers are then inference tensors, which a capture outside
        inference mode may not write (a GPU warm-up after a speculative step failed so)."""
        if self.decode.mode != "graphs":
            return 0
        d = self.decode
        todo = [VerifyShape(DecodeShape(s, c), q) for q in queries for s in d.slots for c in d.contexts]
        todo = [shape for shape in todo if shape not in self.graphs]
        for shape in todo:
            t = time.perf_counter()
            self._capture(shape)
            logger.info("captured verify graph %s: %.2f s", shape, time.perf_counter() - t)
        return len(todo)

    def _capture(self, shape: VerifyShape) -> _VerifyGraph:
        d = self.decode
        device = d.model.device
        packed = VerifyInputs.make([], [], [], shape, d.block_tables.pad_row).packed.to(device)  # padding only
        streams, logits = warm_up(lambda: self._forward(packed, shape), device)
        if self._logits is None:  # outside the graphs' pool: one buffer pair for every verify bucket
            most = d.slots[-1] * self.max_queries
            self._streams = torch.empty(most, *streams.shape[1:], dtype=streams.dtype, device=device)
            self._logits = torch.empty(most, logits.shape[-1], dtype=logits.dtype, device=device)
        assert self._streams is not None
        out_s, out_l = self._streams[: shape.rows], self._logits[: shape.rows]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=d._mempool, capture_error_mode="thread_local"):
            streams, logits = self._forward(packed, shape)
            out_s.copy_(streams)  # into the shared buffers: the forward's own outputs return to the pool
            out_l.copy_(logits)
        del streams, logits
        self.graphs[shape] = _VerifyGraph(packed, graph, out_s, out_l)
        return self.graphs[shape]
