"""Overlapped decode: step N+1 is launched from step N's tokens on the device, before they reach the host.

Why: under CUDA graphs a decode step's GPU work is a few milliseconds, and the host's share of a step (read the
tokens back, check finishes, schedule, build the next inputs) would otherwise run while the GPU idles: a third of
a batch-1 step on an H200 (BENCHMARKS.md, the slice profile). vLLM's async scheduling and SGLang's overlap
scheduler hide it the same way: the next step's token column is the previous step's greedy pick, copied on the
device, so the host reads step N back while step N+1 runs. Sampled requests overlap too: their tokens are drawn on
the device by the same `engine.execution.sampling.sample` the synchronous path runs (counter-based noise keyed by the
request's seed and the token's index, so drawing one step early draws the same token).

EngineCore (engine.execution.runner) takes this path only where it computes exactly what the synchronous path computes
(same kernels, same inputs, same order); any other step runs synchronously, as before:
- a step made only of decode tokens, greedy or sampled, none prefill-only, one rank (tensor parallel ranks
  follow rank 0's broadcast inputs, which hold host token ids);
- step N+1 is launched early only when it is certain to be the next step up to finishes: the same requests in
  the same order (nothing waiting for admission, no prefill running, no import joined), each with room for
  two more tokens (max_new_tokens), none standing on a prefix-cache block boundary after step N (completing
  N may snapshot its state, and that copy must not see step N+1's writes), and a decode bucket that fits;
- a request that finishes on step N (EOS, a stop id) or is aborted meanwhile has already run step N+1: that token
  is dropped, never reported;
- pages freed while a launched step is in flight return to the pool only after it completes
  (CachePool.defer_frees), so no new owner -- a KV import written by NIXL outside the stream above all -- can
  receive rows that a launched step still writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.execution.scheduler import ScheduledChunk


@dataclass(frozen=True)
class LaunchedDecode:
    """A decode step whose tokens are computed (or queued) on the device and not yet read by the host.

    chunks: one ScheduledChunk per batch row; picked: device fp64 [2, n] (token id, its log-prob), the source of
    the next step's token column; host: its host copy (pinned on CUDA, written by a queued copy), readable once
    `ready` (a CUDA event, None on the CPU) has completed."""

    chunks: tuple[ScheduledChunk, ...]
    picked: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @staticmethod
    def of(chunks, picked: torch.Tensor) -> LaunchedDecode:
        """Queue the host copy of `picked` right behind the step (before anything launched later)."""
        if picked.device.type != "cuda":
            return LaunchedDecode(tuple(chunks), picked, picked.clone(), None)
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedDecode(tuple(chunks), picked, host, ready)

    def wait(self) -> None:
        """Block until this step (and its host copy) has completed on the device."""
        if self.ready is not None:
            self.ready.synchronize()

    def read(self) -> tuple[list[int], list[float]]:
        """-> (token ids, log-probs) per row; waits for this step only (not for steps launched after it)."""
        self.wait()
        both = self.host.tolist()
        return [int(t) for t in both[0]], both[1]

    def next_chunks(self) -> tuple[ScheduledChunk, ...]:
        """The same requests one position further."""
        return tuple(ScheduledChunk(c.request, c.start + 1, 1) for c in self.chunks)


def overlappable_decode_step(chunks) -> bool:
    """Every chunk is one decode token (greedy or sampled) of a request that is not prefill-only."""
    return all(
        c.num_tokens == 1
        and c.start + 1 == c.request.num_tokens
        and not c.request.prefill_only
        and not c.request.finished
        for c in chunks
    )


def next_step_is_known(step: LaunchedDecode, running: list, waiting, snapshot_block: int | None) -> bool:
    """Whether the step after `step` is certainly its requests one position further (module docstring).

    running / waiting: the scheduler's lists; snapshot_block: the prefix cache's block size (None without one)."""
    if waiting or len(running) != len(step.chunks):
        return False
    for c, req in zip(step.chunks, running):
        if c.request is not req or req.finished or c.start + 1 != req.num_tokens:
            return False
        if len(req.output) + 2 > req.params.max_new_tokens:  # step's token + one more must be allowed
            return False
        if snapshot_block is not None and (c.start + 1) % snapshot_block == 0:
            return False
    return True
