"""When the Speculator drafts: a per-step policy that turns speculation off where it does not pay.

Why: a verify step of K+1 tokens a request costs about what a one-token step costs only while the step is
bound by reading weights (small batches); at larger batches it approaches (K+1)x the one-token step and
speculation loses. How much a step costs on a given machine is not known in advance (BENCHMARKS.md bench_spec:
on the H200 the verify path's host work made even batch 1 lose), so three rules decide, in order:
1. a static ceiling: drafts only while the decode batch is at most `max_batch` requests (`DEFAULT_MAX_BATCH`);
2. an acceptance floor (optional): drafting pauses while a running estimate of the acceptance rate is below
   `min_acceptance` (a model or a prompt the MTP layer predicts badly);
3. measured pay (`compare_rates`): per batch-size bucket (powers of two), a moving average of the tokens a second
   that pure decode steps emitted with drafts and without; while the drafting rate is below the plain rate,
   drafting pauses. Whichever mode is paused still runs every `probe_every`-th step, so both estimates stay
   current (a machine under other load, a prompt that starts being predictable).
Not drafting never stops the MTP layer: it still runs over every position the target computes, so its KV
stays complete and drafting resumes exactly (engine.execution.speculative).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BATCH = 8  # BENCHMARKS.md bench_spec: a K+1 step's cost grows with the batch; measured pay decides below
OUTLIER = 4.0  # a step interval this many times its mode's average is not a step's cost (idle loop, GC, compile)


@dataclass(frozen=True)
class SpecPolicy:
    """max_batch: draft only in steps with at most this many decoding requests (0: never draft).
    min_acceptance: draft only while the acceptance estimate (accepted / drafted, moving average with weight
    `decay` on the past) is at least this (0.0: no floor); probe_every: while below it, draft every this
    many steps anyway. compare_rates: also draft only while drafting steps emit more tokens a second than
    plain steps at the same batch bucket (the paused mode probed every `probe_every` steps)."""

    max_batch: int = DEFAULT_MAX_BATCH
    min_acceptance: float = 0.0
    decay: float = 0.9
    probe_every: int = 32
    compare_rates: bool = False

    def __post_init__(self) -> None:
        if self.max_batch < 0:
            raise ValueError(f"speculative max batch must be >= 0, got {self.max_batch}")
        if not 0.0 <= self.min_acceptance <= 1.0 or not 0.0 <= self.decay < 1.0 or self.probe_every < 1:
            raise ValueError(f"bad speculative policy {self}")


def batch_bucket(decoding: int) -> int:
    """The power of two at or above `decoding` (>= 1): batch sizes whose step costs are compared together."""
    return 1 << max(0, decoding - 1).bit_length()


class SpecGate:
    """The policy's state: the acceptance estimate, the steps since the last draft, and (compare_rates) the measured
    tokens a second of pure decode steps with and without drafts per batch bucket."""

    def __init__(self, policy: SpecPolicy):
        self.policy = policy
        self.acceptance = 1.0  # optimistic start: draft until the verify steps say otherwise
        self._skipped = 0
        self.rates: dict[tuple[int, bool], float] = {}  # (batch bucket, drafted) -> tokens/s, moving average
        self._since_probe: dict[int, int] = {}  # batch bucket -> steps since the paused mode last ran

    def should_draft(self, decoding: int) -> bool:
        """Whether this step's continuing requests get drafts; decoding: the requests decoding in it."""
        p = self.policy
        if decoding > p.max_batch:
            return False
        if self.acceptance < p.min_acceptance:
            self._skipped += 1
            if self._skipped < p.probe_every:
                return False
        self._skipped = 0
        return self._pays(batch_bucket(decoding)) if p.compare_rates else True

    def _pays(self, bucket: int) -> bool:
        """Draft unless plain steps measured faster at this bucket; every probe_every-th step runs the other mode
        (the first plain step of a bucket comes after probe_every drafting ones)."""
        drafting, plain = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        prefer = drafting is None or plain is None or drafting >= plain
        n = self._since_probe.get(bucket, 0) + 1
        if n >= self.policy.probe_every:
            self._since_probe[bucket] = 0
            return not prefer
        self._since_probe[bucket] = n
        return prefer

    def observe(self, drafted: int, accepted: int) -> None:
        """One step's verify outcome (its totals over requests)."""
        if drafted:
            d = self.policy.decay
            self.acceptance = d * self.acceptance + (1 - d) * accepted / drafted

    def observe_rate(self, decoding: int, drafted: bool, emitted: int, seconds: float) -> None:
        """A pure decode step of `decoding` requests (`drafted`: it verified drafts) emitted `emitted` tokens in
        `seconds` (from its start to the next step's start: the loop's whole cycle, host work included)."""
        if seconds <= 0 or emitted <= 0:
            return
        key, rate = (batch_bucket(decoding), drafted), emitted / seconds
        old = self.rates.get(key)
        if old is None or rate > old * OUTLIER:  # first, or far faster: the average so far held a stall (a compile)
            self.rates[key] = rate
        elif rate * OUTLIER >= old:  # (far slower than usual is dropped: the loop idled or compiled)
            d = self.policy.decay
            self.rates[key] = d * old + (1 - d) * rate
