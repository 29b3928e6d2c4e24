"""Prefill steps under CUDA graphs: one graph per PrefillShape bucket (tokens, request rows, context), captured at
start-up for the first chunk of one request (engine.execution.warmup) or on a bucket's first use, replayed after.

An 8K-token prefill step of the V4-Flash slice launches ~900 kernels; the host issues them barely faster than the
GPU runs them, and at 1K tokens the step is host-bound (BENCHMARKS.md prefill_formats: no host sync in the forward,
~10 ms of gaps at 8K). Replaying a captured step removes the launches' host time. Per bucket
(engine.model.prefill_batch pads the step to it; padding rows write only scratch pages):
- the graph holds the device half of the batch build (`engine.model.batch.device_step`: SWA sources, visible-entry
  rows) and the whole forward to the logits of each request row's last token; its static input is the one uint8
  buffer the host arrays are uploaded into, so a step is one host-to-device copy and one replay;
- outside it, as for decode graphs: the schedule, the host half of the batch build (numpy), sampling and the
  finish checks (engine.execution.runner);
- capture: two warm-up forwards on a side stream (Triton compiles, DeepGEMM's JIT, the allocator settles), then the
  capture, all on a padding-only batch (every row on scratch pages); every bucket shares one memory pool of its own
  (not the decode graphs': a decode step's outputs may still be unread when a prefill step runs), which holds about
  one step's activations of the largest bucket captured (engine.loading.memory_plan counts it);
- the output is the first request rows of one fp32 logits buffer all prefill graphs share, valid until the next
  replay.
Capturable because nothing in the prefill forward waits on the device (each path's sizes come from shapes): the
FP8 routed experts size their grouped layout by the sync-free bound while capturing (dsv4_kernels.fp8_experts), the
fp8-cache attention stores are sized by shapes (engine.model.attention_fp8), the indexer's prefill kernel plans its
query blocks on the device (dsv4_kernels.triton_indexer_prefill). DeepGEMM's one-sequence indexer runs where the
bucket has one request row (a step that fills its bucket: N == T); a padded step has two rows and takes the Triton
prefill indexer.

Where a padded step may compute the real tokens differently from the content-sized eager step (T is the bucket's
token count, N the step's): the routed experts see the padding tokens too, so each expert's group has other row
counts (grouped GEMM tiles, the FP8 layout's bound; on the CPU the reference's per-expert GEMMs round a row by
its group's size: the only difference the CPU tests see, fp32 last bits); the format and kernel choices made by
step length follow T: FP8 routed experts from 1024 tokens on a prefill engine (`MoEBlock.takes_fp8`: a 600-token
chunk in the 1024 bucket takes FP8 experts where the eager step keeps MXFP4), the mHC pre's split vs long path
(DSV4_HC_SPLIT_MAX_TOKENS), the indexer's query blocks and candidate split; and the indexer's and the attention's
lists are longer (more -1 / invisible columns: top-k picks the same set, the attention kernels' K splits may
merge in another order). Apart from those roundings a real request's cache rows are byte for byte the unpadded
step's: each is written from its own tokens by the same per-row kernels.

`PrefillRunner(mode="eager")` runs the same padded batches without graphs: the CPU tests pin that a padded step
computes what `build_step`'s batch computes for the real requests.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from engine.execution.cuda_graphs import slot_buckets, warm_up
from engine.model.batch import device_step
from engine.model.cache import CachePool
from engine.model.prefill_batch import PrefillInputs, PrefillShape, context_buckets, pad_step, token_buckets

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    inputs: torch.Tensor  # static uint8 buffer: the padded step's host arrays (PrefillInputs.upload)
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # static output [slots, vocab], a view of the shared buffer


class PrefillRunner:
    """Runs prefill-carrying steps padded to a bucket; mode "graphs" (CUDA) replays captured graphs, "eager" just
    forwards the padded batch."""

    def __init__(
        self, model, pool: CachePool, mode: str, max_batch_tokens: int, max_requests: int, min_tokens: int = 512
    ):
        if mode not in ("graphs", "eager"):
            raise ValueError(f"PrefillRunner mode must be 'graphs' or 'eager', got {mode!r}")
        if mode == "graphs" and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.pool, self.mode = model, pool, mode
        self.max_context = model.cfg.max_position_embeddings
        # at most the model's positions: a padding row's positions 0.. stay inside its RoPE tables
        self.tokens = token_buckets(min_tokens, min(max_batch_tokens, self.max_context))
        self.slots = slot_buckets(max_requests + 1)  # + a padding row
        self.graphs: dict[PrefillShape, _Graph] = {}
        self.steps = 0  # steps this runner ran (replayed or eager padded)
        self._mempool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        self._logits: torch.Tensor | None = None  # [max slots, vocab]: every graph's output rows

    def shape_for(self, counts: list[int], ends: list[int]) -> PrefillShape | None:
        """The smallest bucket holding requests of these token counts and chunk ends; None when none does."""
        total, n = sum(counts), len(counts)
        for t in self.tokens[bisect.bisect_left(self.tokens, total) :]:
            i = bisect.bisect_left(self.slots, n + (total < t))
            if i == len(self.slots):
                return None
            if t <= self.slots[i]:  # T > S (PrefillShape): a larger token bucket
                continue
            contexts = context_buckets(t, self.max_context)
            j = bisect.bisect_left(contexts, max(ends, default=0))
            return PrefillShape(t, self.slots[i], contexts[j]) if j < len(contexts) else None
        return None

    def run(
        self, token_ids: list[list[int]], starts: list[int], tables: list[dict], snapshots: list | None = None
    ) -> torch.Tensor | None:
        """One step: request b runs token_ids[b] from position starts[b] with page table tables[b]; snapshots[b]: its
        in-step prefix-cache snapshot as engine.model.batch.build_step takes it, or None.

        -> fp32 logits [len(token_ids), vocab] of each request's last token this step (a view of a static buffer under
        graphs: read it before the next step), or None when no bucket fits (the caller runs the step eagerly)."""
        n = len(token_ids)
        shape = self.shape_for([len(t) for t in token_ids], [s + len(t) for s, t in zip(starts, token_ids)])
        if shape is None:
            return None
        inputs = pad_step(self.pool, shape, token_ids, starts, tables, snapshots)
        self.steps += 1
        if self.mode == "eager":
            return self.model.forward(inputs.batch(self.model.device), self.pool)[:n]
        graph = self.graphs.get(shape) or self._capture(shape)
        inputs.upload(self.model.device, into=graph.inputs)  # (pad_step lays out every step of a shape alike)
        graph.graph.replay()
        return graph.logits[:n]

    def capture_all(self) -> int:
        """Capture the buckets of one request's first chunk (engine.execution.warmup): every token bucket, with one
        request row (a chunk of exactly its bucket's tokens) and with a padding row, at context = tokens. Other
        buckets (more requests, later chunks of a long prompt) are captured on first use. -> how many were captured."""
        if self.mode != "graphs":
            return 0
        todo = [PrefillShape(t, s, t) for t in self.tokens for s in self.slots[:2] if t > s]
        todo = [shape for shape in todo if shape not in self.graphs]
        for shape in todo:
            self._capture(shape)
        return len(todo)

    def _capture(self, shape: PrefillShape) -> _Graph:
        t0 = time.perf_counter()
        pad = pad_step(self.pool, shape, [], [], [])  # padding only: warm-up and capture write scratch pages alone
        device = self.model.device
        views, buffer = pad.upload(device)
        warm = warm_up(lambda: self.model.forward(device_step(self.pool, pad.host, views), self.pool), device)
        if self._logits is None:  # outside the graphs' pool: one buffer for every bucket's output
            self._logits = torch.empty(self.slots[-1], warm.shape[-1], dtype=warm.dtype, device=device)
        out = self._logits[: shape.slots]
        graph = torch.cuda.CUDAGraph()
        # thread_local: workers capture on their engine thread while other threads (KV transfer, HTTP) may touch CUDA
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            logits = self.model.forward(device_step(self.pool, pad.host, views), self.pool)
            out.copy_(logits)  # the forward's own buffer returns to the pool after the capture
        del logits, warm
        self.graphs[shape] = _Graph(buffer, graph, out)
        logger.info("captured prefill graph %s: %.2f s", shape, time.perf_counter() - t0)
        return self.graphs[shape]


def padded_inputs(runner: PrefillRunner, token_ids, starts, tables) -> PrefillInputs | None:
    """The padded inputs `runner.run` would use for this step (tests, tools); None when no bucket fits."""
    shape = runner.shape_for([len(t) for t in token_ids], [s + len(t) for s, t in zip(starts, token_ids)])
    return None if shape is None else pad_step(runner.pool, shape, token_ids, starts, tables)
