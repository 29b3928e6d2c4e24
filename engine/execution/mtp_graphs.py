"""Fixed-shape MTP drafting (speculative decoding): the MTP pass and the chained MTP steps as verify-shaped steps,
under CUDA graphs (or eager bucketed on the CPU), after each fixed-shape verify step (engine.execution.verify_graphs).

Why: at batch 1 the eager drafting (host batch building, then a layer's launches, K times a step) costs about as
much as the verify step itself; replayed, it is one graph launch a pass or chain step.

- The pass runs the MTP layer on the verify step's own bucket (slots, context, queries; engine.model.verify_batch
  with swa_only: the MTP layers attend over the SWA ring only): request b's rows b*q .. b*q + n_b - 1 are the
  positions it computed on the accepted path this step (n_b = its accepted drafts + 1), each with the token after
  it; the other rows are padding (scratch pages). Its inputs are given on the device (engine.execution.spec_fixed
  derives them there from the acceptance). Its hidden input is the
  verify step's streams as they stand (the rows are already aligned: no gather) and row b*q + n_b - 1 of its
  output (`select`, a graph input) drafts token 1 of request b.
- Chain step j (j = 1..K-1) runs one row a request (queries 1, the decode buckets) at the request's newest
  position P + j - 1 on the previous step's output streams and draft: both stay on the device, in the shared
  buffers below, so a chain runs without a host read between its steps.
Every step leaves, in buffers shared by all MTP graphs (outside the graph pool, valid until the next MTP step):
the selected output streams [slots, hc, D], their logits fp32 [slots, vocab] and their greedy picks int64 [slots]
(engine.execution.sampling.greedy_pick, inside the graph), which the next chain step reads as its tokens; a
sampled request's rows are overwritten with its draws (spec_sampling.draw_drafts on the logits) between replays.
Graphs: one per verify bucket for the pass (queries 1 and K + 1) and one per (slots, context) bucket and MTP
layer for the chain steps, in the decode runner's memory pool; captured with the verify graphs at warm-up
(capture_all) or on first use, on padding rows only (they write the scratch pages). Mode "eager" (decode_mode
"bucketed") runs the same bodies without graphs, so the CPU tests run this code.
Outside the graphs: the ring-row save and restore around the chain (engine.execution.spec_rollback: rows computed
on the device, no host read) and the sampled requests' draws. engine.execution.spec_fixed drives it; the Speculator
(engine.execution.speculative) keeps the varlen path for the other steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.execution.cuda_graphs import warm_up
from engine.execution.sampling import greedy_pick
from engine.execution.verify_graphs import VerifyRunner, VerifyStep
from engine.model.batch import copy_nonblocking_, to_device_nonblocking
from engine.model.decode_batch import DecodeShape
from engine.model.mtp import MtpLayer
from engine.model.verify_batch import VerifyInputs, VerifyShape, derive_verify_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MtpKey:
    """One MTP graph: its bucket, which MTP layer it runs, and whether it is a chain step (hidden and tokens from the
    shared buffers) or the pass (hidden from the verify step's streams, tokens from its inputs)."""

    shape: VerifyShape
    layer: int
    chained: bool


@dataclass
class _MtpGraph:
    packed: torch.Tensor  # static inputs int64 [3, rows]: token, position, BlockTables row (VerifyInputs)
    select: torch.Tensor  # static input int64 [slots]: each slot's output row
    graph: torch.cuda.CUDAGraph


class MtpRunner:
    """Runs the fixed-shape MTP steps with a VerifyRunner's buckets, tables, memory pool and mode."""

    def __init__(self, verify: VerifyRunner, layers: list[MtpLayer]):
        self.verify, self.layers = verify, layers
        self.decode = verify.decode
        self.graphs: dict[MtpKey, _MtpGraph] = {}
        self.steps = 0  # MTP passes and chain steps run on fixed shapes (graphs replayed or eager bucketed)
        self.replays = 0  # of them, graph replays
        self._hidden: torch.Tensor | None = None  # [max slots, hc, D] (module docstring: the shared buffers)
        self._logits: torch.Tensor | None = None  # fp32 [max slots, vocab]
        self._tokens: torch.Tensor | None = None  # int64 [max slots]

    # ---- what the Speculator calls ------------------------------------------------------------------
    @torch.inference_mode()
    def run_pass(self, step: VerifyStep, packed: torch.Tensor, select: torch.Tensor) -> None:
        """The MTP pass after verify step `step`, on its bucket and streams: packed int64 [3, step.shape.rows] on the
        device (VerifyInputs' layout: slot b's rows are its positions computed on the accepted path, each with the
        token after it, the rest padding; engine.execution.spec_fixed derives them there from the verify step's
        inputs and its acceptance, which the host has not read), select int64 [slots] each slot's output row.
        Its outputs land in the shared buffers (`logits`, `tokens`)."""
        self._run(MtpKey(step.shape, 0, False), packed, select, step.streams)

    @torch.inference_mode()
    def run_chain_step(self, shape: VerifyShape, j: int, packed: torch.Tensor) -> None:
        """Chain step j (1..K-1) on `shape` (chain_shape): packed int64 [3, slots] on the device (position and table
        row of each slot, padding slots on the padding row; the token row is ignored: the drafts come from the shared
        buffer), on the previous step's outputs in the shared buffers, which it replaces."""
        key = MtpKey(shape, j % len(self.layers), True)
        self._run(key, packed, torch.arange(shape.decode.slots), None)

    def chain_shape(self, num_requests: int, context: int) -> VerifyShape | None:
        """The chain steps' bucket (queries 1) for positions < context; None when none fits."""
        return self.verify.shape_for(num_requests, context, 1)

    def logits(self, n: int) -> torch.Tensor:
        """The last step's draft logits fp32 [n, vocab] (a view of the shared buffer)."""
        assert self._logits is not None
        return self._logits[:n]

    def tokens(self, n: int) -> torch.Tensor:
        """The drafts of the last step, int64 [n] (a copy): the greedy picks, or what `set_tokens` put there."""
        assert self._tokens is not None
        return self._tokens[:n].clone()

    @torch.inference_mode()
    def set_tokens(self, slots: list[int], tokens: torch.Tensor) -> None:
        """Replace the drafts of `slots` (sampled requests' draws, int64 [len(slots)] on the device): the next chain
        step reads them."""
        assert self._tokens is not None
        self._tokens[to_device_nonblocking(torch.tensor(slots), self._tokens.device)] = tokens

    def capture_all(self, queries: list[int], chain_steps: int) -> int:
        """Capture every pass graph of each verify bucket with `queries` rows a request, and, when chain_steps > 0,
        every chain graph (queries 1) of the MTP layers steps 1..chain_steps use (engine.execution.warmup, after the
        verify graphs, whose streams buffer the pass graphs read) -> how many were captured."""
        if self.decode.mode != "graphs":
            return 0
        d = self.decode
        shapes = [VerifyShape(DecodeShape(s, c), q) for q in queries for s in d.slots for c in d.contexts]
        keys = [MtpKey(shape, 0, False) for shape in shapes]
        chain_layers = sorted({j % len(self.layers) for j in range(1, chain_steps + 1)})
        ones = [VerifyShape(DecodeShape(s, c), 1) for s in d.slots for c in d.contexts]
        keys += [MtpKey(shape, i, True) for i in chain_layers for shape in ones]
        todo = [key for key in keys if key not in self.graphs]
        for key in todo:
            t = time.perf_counter()
            self._capture(key)
            logger.info("captured MTP graph %s: %.2f s", key, time.perf_counter() - t)
        return len(todo)

    # ---- one step -------------------------------------------------------------------------------------
    def _run(self, key: MtpKey, host: torch.Tensor, select: torch.Tensor, streams: torch.Tensor | None) -> None:
        """One MTP step: `host` VerifyInputs.packed, `select` int64 [slots] output rows (on the host or the device),
        `streams` the verify step's (the pass) or None (a chain step)."""
        self.steps += 1
        device = self.decode.model.device
        self._allocate(device)
        if self.decode.mode == "eager":
            self._body(key, host.to(device), select.to(device), streams)
            return
        graph = self.graphs.get(key) or self._capture(key)
        if streams is not None and streams.data_ptr() != self.verify.streams_buffer(key.shape).data_ptr():
            raise RuntimeError("the MTP pass graph reads the verify graphs' streams buffer: run it after one")
        _copy_in(graph.packed, host)
        if not key.chained:  # (a chain step reads its output rows in order)
            _copy_in(graph.select, select)
        graph.graph.replay()
        self.replays += 1

    def _body(self, key: MtpKey, packed: torch.Tensor, select: torch.Tensor, streams: torch.Tensor | None) -> None:
        """Everything a graph holds: the batch derived on the device, the layer, the selected rows' streams, logits
        and greedy picks into the shared buffers."""
        assert self._hidden is not None and self._logits is not None and self._tokens is not None
        d, s, layer = self.decode, key.shape.decode.slots, self.layers[key.layer]
        if key.chained:
            packed[0].copy_(self._tokens[:s])  # the previous step's drafts
            streams = self._hidden[:s]
        assert streams is not None
        batch = derive_verify_batch(d.pool, d.block_tables, packed, key.shape, swa_only=True)
        out = layer.forward(batch, d.pool, streams)
        if not key.chained:
            out = out.index_select(0, select)
        logits = layer.logits(out)
        self._hidden[:s].copy_(out)  # (a chain step read its input above: stream order)
        self._logits[:s].copy_(logits)
        self._tokens[:s].copy_(greedy_pick(self._logits[:s])[0])

    def _allocate(self, device: torch.device) -> None:
        """The shared output buffers, once, outside the graph pool (zeros: padding rows read finite values)."""
        if self._hidden is not None:
            return
        m, cfg = self.decode.model, self.decode.model.cfg
        most = self.decode.slots[-1]
        self._hidden = torch.zeros(most, cfg.hc_mult, cfg.hidden_size, dtype=m.residual_dtype, device=device)
        self._logits = torch.zeros(most, cfg.vocab_size, dtype=torch.float32, device=device)
        self._tokens = torch.zeros(most, dtype=torch.int64, device=device)

    @torch.inference_mode()
    def _capture(self, key: MtpKey) -> _MtpGraph:
        d, shape = self.decode, key.shape
        device = d.model.device
        self._allocate(device)
        packed = VerifyInputs.make([], [], [], shape, d.block_tables.pad_row).packed.to(device)  # padding only
        select = torch.arange(shape.decode.slots, device=device) * shape.queries
        streams = None if key.chained else self.verify.streams_buffer(shape)
        warm_up(lambda: self._body(key, packed, select, streams), device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=d._mempool, capture_error_mode="thread_local"):
            self._body(key, packed, select, streams)
        self.graphs[key] = _MtpGraph(packed, select, graph)
        return self.graphs[key]


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A graph's static input from a host tensor (pinned, non-blocking) or a device one (queued on the stream)."""
    if src.device == dst.device:
        dst.copy_(src)
    else:
        copy_nonblocking_(dst, src)
