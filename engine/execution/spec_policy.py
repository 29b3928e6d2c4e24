"""When the Speculator drafts: a per-step policy that turns speculation off where it does not pay.

Why: a verify step of K+1 tokens a request costs about what a one-token step costs only while the step is
bound by reading weights (small batches); at larger batches it approaches (K+1)x the one-token step and
speculation loses. BENCHMARKS.md section bench_spec (H200, V4-Flash slice, K=1): it pays at batch 1, is even
at batch 16 at 0.8 acceptance and loses at batch 64; so by default drafts are made only while the decode
batch is at most 8 requests (`DEFAULT_MAX_BATCH`; re-measure with `dsv4 bench spec` when the verify path
changes). Optionally, drafting also pauses while a running estimate of the acceptance rate is below a floor
(a model or a prompt the MTP layer predicts badly); every `probe_every`-th step drafts anyway so the estimate
can recover.

Not drafting never stops the MTP layer: it still runs over every position the target computes, so its KV
stays complete and drafting resumes exactly (engine.execution.speculative).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BATCH = 8  # BENCHMARKS.md bench_spec: pays at 1, even at 16 (0.8 acceptance), loses at 64


@dataclass(frozen=True)
class SpecPolicy:
    """max_batch: draft only in steps with at most this many decoding requests (0: never draft).
    min_acceptance: draft only while the acceptance estimate (accepted / drafted, moving average with weight
    `decay` on the past) is at least this (0.0: no floor); probe_every: while below it, draft every this
    many steps anyway."""

    max_batch: int = DEFAULT_MAX_BATCH
    min_acceptance: float = 0.0
    decay: float = 0.9
    probe_every: int = 32

    def __post_init__(self) -> None:
        if self.max_batch < 0:
            raise ValueError(f"speculative max batch must be >= 0, got {self.max_batch}")
        if not 0.0 <= self.min_acceptance <= 1.0 or not 0.0 <= self.decay < 1.0 or self.probe_every < 1:
            raise ValueError(f"bad speculative policy {self}")


class SpecGate:
    """The policy's state: the acceptance estimate and the steps since the last draft."""

    def __init__(self, policy: SpecPolicy):
        self.policy = policy
        self.acceptance = 1.0  # optimistic start: draft until the verify steps say otherwise
        self._skipped = 0

    def should_draft(self, decoding: int) -> bool:
        """Whether this step's continuing requests get drafts; decoding: the requests decoding in it."""
        p = self.policy
        if decoding > p.max_batch:
            return False
        if self.acceptance >= p.min_acceptance:
            self._skipped = 0
            return True
        self._skipped += 1
        if self._skipped >= p.probe_every:
            self._skipped = 0
            return True
        return False

    def observe(self, drafted: int, accepted: int) -> None:
        """One step's verify outcome (its totals over requests)."""
        if drafted:
            d = self.policy.decay
            self.acceptance = d * self.acceptance + (1 - d) * accepted / drafted
