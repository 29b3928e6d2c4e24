"""Overlapped speculative decoding: fixed step N + 1 is launched from step N's device outputs before the host reads N.

Why: a speculative step's host work (reading the acceptance, appending tokens, finishing requests, building the next
step's inputs) otherwise runs while the device has nothing queued once the drafting ends. As for one-token steps
(engine.execution.decode_overlap), the next step can be queued before the host knows this one's tokens, because
everything it needs is on the device (engine.execution.spec_fixed): each request's next start is its start plus
its emitted count, its first token is its last emitted token, its drafts are this step's drafts; the host only
bounds the positions (for the bucket) and names the same requests, slots and tables.

The Speculator (engine.execution.speculative) launches N + 1 this way only where it computes exactly what the
synchronous step would (`next_spec_is_known`), and otherwise runs steps one at a time:
- the same requests in the same order (nothing waiting for admission, no prefill, no import joined); sampled ones
  too: their draws are keyed by output indices that step N's unread count shifts, so the host sends a seed for each
  possible count and the device picks (FixedSpecStep._keyed): the same draws as the synchronous step;
- each with room for step N's tokens and K more drafts after them (max_new_tokens): step N + 1 then runs exactly
  K drafts a request (or none when step N did not draft) and cannot pass a request's budget;
- none whose computed count could land on a prefix-cache block boundary in step N (completing N snapshots the
  request's rings, which N + 1 already writes);
- a request that finishes in step N (EOS, a stop id) or is aborted has already run step N + 1: its tokens are
  dropped, never reported, and pages freed meanwhile go back only when no launched step can write them
  (CachePool.defer_frees, as for overlapped one-token steps).
"""

from __future__ import annotations

from engine.execution.spec_fixed import LaunchedSpec


def next_spec_is_known(step: LaunchedSpec, running: list, waiting, k: int, snapshot_block: int | None) -> bool:
    """Whether the step after `step` (launched, unread) is certainly its requests one step further (module docstring).

    running / waiting: the scheduler's lists; k: drafts a step; snapshot_block: the prefix cache's block size (None
    without one). The host's request state is the one before `step`'s tokens."""
    if waiting or len(running) != len(step.plans):
        return False
    for p, req in zip(step.plans, running):
        c = p.chunk
        if c.request is not req or req.finished or c.start + 1 != req.num_tokens or req.prefill_only:
            return False
        # step emits up to `queries` tokens; the next one runs K drafts and emits up to K + 1 after them
        if len(req.output) + step.queries + k + 1 > req.params.max_new_tokens:
            return False
        if snapshot_block is not None and any((c.start + x) % snapshot_block == 0 for x in range(1, step.queries + 1)):
            return False
    return True
