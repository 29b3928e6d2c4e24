"""Decode under CUDA graphs: one graph per DecodeShape bucket, captured on first use, replayed after.

A decode step's Python work (per-layer op dispatch, Triton launch setup) costs far more than its GPU
time at decode batch sizes, so decode steps replay a captured graph instead. Shapes come from
`engine.decode_batch` (fixed per bucket, padding rows on the scratch page). Per bucket:
- the step's index tensors live in two flat device buffers (one int64, one bool); the StepBatch the graph
  was captured on holds views into them, so refreshing a step's inputs is two host-to-device copies;
- capture: two warm-up forwards on a side stream (Triton compiles, allocator settles), then the capture;
  every bucket shares one memory pool (replays never overlap and each output is consumed before the
  next replay);
- the output is the graph's static logits tensor [slots, vocab]: valid until the next replay.
Warm-up and capture run on a padding-only batch, so they write the scratch page and nothing else.

`DecodeRunner(mode="eager")` runs the same fixed-shape batches without graphs: the CPU tests use it
to pin that a bucketed step computes what `build_step`'s batch computes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields, is_dataclass

import torch

from engine.batch import StepBatch
from engine.cache import CachePool
from engine.decode_batch import DecodeShape, build_decode_step

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
    out, n = [], MIN_CONTEXT_BUCKET
    while n < max_context:
        out.append(n)
        if n * 3 // 2 < max_context:
            out.append(n * 3 // 2)
        n *= 2
    return out + [max_context]


def _map_tensors(obj, fn):
    """Rebuild a StepBatch tree (dataclasses, dicts) with fn applied to every tensor leaf, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(obj[k], fn) for k in sorted(obj)}
    if is_dataclass(obj):
        return type(obj)(**{f.name: _map_tensors(getattr(obj, f.name), fn) for f in fields(obj)})
    return obj


def _leaves(batch: StepBatch) -> list[torch.Tensor]:
    out = []
    _map_tensors(batch, out.append)
    return out


@dataclass
class _StaticInputs:
    """Flat device buffers per dtype and the StepBatch of views into them."""

    flat: dict  # dtype -> 1-D device tensor
    batch: StepBatch

    @staticmethod
    def allocate(template: StepBatch, device) -> "_StaticInputs":
        sizes: dict = {}
        for leaf in _leaves(template):
            sizes[leaf.dtype] = sizes.get(leaf.dtype, 0) + leaf.numel()
        flat = {dt: torch.zeros(max(n, 1), dtype=dt, device=device) for dt, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)

        def view(leaf: torch.Tensor) -> torch.Tensor:
            off = offsets[leaf.dtype]
            offsets[leaf.dtype] = off + leaf.numel()
            return flat[leaf.dtype][off:off + leaf.numel()].view(leaf.shape)

        static = _StaticInputs(flat, _map_tensors(template, view))
        static.load(template)
        return static

    def load(self, batch: StepBatch) -> None:
        """Copy a CPU batch of the same shape into the buffers: one host-to-device copy per dtype."""
        parts: dict = {}
        for leaf in _leaves(batch):
            parts.setdefault(leaf.dtype, []).append(leaf.reshape(-1))
        for dt, chunks in parts.items():
            host = torch.cat(chunks)
            self.flat[dt][:host.numel()].copy_(host, non_blocking=host.is_pinned())


@dataclass
class _Graph:
    inputs: _StaticInputs
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # static output [slots, vocab]


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
        self._mempool = torch.cuda.graph_pool_handle() if mode == "graphs" else None

    def shape_for(self, num_requests: int, context: int) -> DecodeShape | None:
        """The smallest bucket holding num_requests rows at positions < context; None when none does."""
        i = bisect.bisect_left(self.slots, num_requests)
        j = bisect.bisect_left(self.contexts, context)
        if i == len(self.slots) or j == len(self.contexts):
            return None
        return DecodeShape(self.slots[i], self.contexts[j])

    def run(self, token_ids: list[int], positions: list[int], tables: list[dict]) -> torch.Tensor | None:
        """One decode step of len(token_ids) requests -> fp32 logits [len(token_ids), vocab], or None when
        no bucket fits (the caller runs the step eagerly)."""
        n = len(token_ids)
        shape = self.shape_for(n, max(positions) + 1)
        if shape is None:
            return None
        if self.mode == "eager":
            batch = build_decode_step(self.pool, token_ids, positions, tables, shape, self.model.device)
            return self.model.forward(batch, self.pool)[:n]
        graph = self.graphs.get(shape) or self._capture(shape)
        graph.inputs.load(build_decode_step(self.pool, token_ids, positions, tables, shape, "cpu"))
        graph.graph.replay()
        return graph.logits[:n]

    def _capture(self, shape: DecodeShape) -> _Graph:
        template = build_decode_step(self.pool, [], [], [], shape, "cpu")  # padding only: writes scratch
        inputs = _StaticInputs.allocate(template, self.model.device)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.forward(inputs.batch, self.pool)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = self.model.forward(inputs.batch, self.pool)
        self.graphs[shape] = _Graph(inputs, graph, logits)
        return self.graphs[shape]
