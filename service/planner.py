"""The pool planner: how many prefill and decode workers each pool should have, from measured signals.

Pure Python (no Ray): `service/pools.py` feeds it one `PoolObservation` per pool every `interval_s` and acts
on the `ScaleDecision` it returns; tests/service/test_planner.py drives it with made-up observations.

Pressure: each pool's signals as fractions of their targets, the largest one wins (it names the reason):
- prefill: queued prompt tokens per worker / `prefill_queue_tokens`, TTFT p90 at the workers / `ttft_target_s`;
- decode: running streams per worker / `decode_streams`, KV use / `kv_target`, inter-token latency p90 /
  `itl_target_s`.
Pressure 1.0 is "at target". Signals are the mean over the pool's ready workers; a latency signal counts only
while its worker has work (an idle worker's window describes a spell that is over) and only from a worker with
`min_samples` samples in its window (a fresh worker's first steps are not the pool's state:
Dynamo's decode over-scaling on cold-start samples, ai-dynamo/dynamo#12430).

Scale up: pressure above 1.0 on `up_after` consecutive ticks and `up_cooldown_s` since the last change; the new
size is ceil(n x pressure) (at least n + 1), so a burst is met in one step rather than one worker per cooldown.
Scale down: one worker at a time, only when the pool would still be under `down_threshold` of target on
n - 1 workers (the N/(N-1) consolidation check: pressure x n / (n - 1); removing on "under target" alone made
Dynamo's planner oscillate 2 <-> 1, ai-dynamo/dynamo#9294), on `down_after` consecutive ticks, and
`down_cooldown_s` since the last change of either direction. The gap between 1.0 and `down_threshold` is the
hysteresis.

Hold: while a change has not landed (a worker still starting or draining: scaling again on the old
signals double-counts; Dynamo waits the same way), and on stale data (no ready worker answered within
`stale_s`: Ray Serve's TTFT policy holds on stale data too). A worker that never becomes ready is the
executor's to give up on (`start_timeout_s` in service/pools.py), so a failed scale-up cannot freeze the
planner (ai-dynamo/dynamo#14251). The bounds win over everything: below `min` or above `max` is corrected at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

POOLS = ("prefill", "decode")
# Why a pool changed size (the `reason` label of dsv4_pool_scale_decisions_total).
UP_REASONS = ("below_min", "queue_tokens", "ttft", "streams", "kv_usage", "itl")
DOWN_REASONS = ("above_max", "idle")
REASONS = UP_REASONS + DOWN_REASONS
# Why a pool kept its size (logged when it differs from plain "steady").
HOLD_REASONS = ("steady", "settling", "stale", "cooldown", "confirming", "at_max", "at_min", "consolidation")


@dataclass(frozen=True)
class PoolBounds:
    """How many workers a pool may have; min == max is a fixed pool (the planner never changes it)."""

    min: int
    max: int

    def __post_init__(self):
        if isinstance(self.min, bool) or isinstance(self.max, bool):
            raise ValueError(f"pool bounds must be ints, got {self.min!r}:{self.max!r}")
        if self.min < 1 or self.max < self.min:
            raise ValueError(f"pool bounds need 1 <= MIN <= MAX, got {self.min}:{self.max}")

    @property
    def elastic(self) -> bool:
        return self.max > self.min

    def __str__(self) -> str:
        return str(self.min) if not self.elastic else f"{self.min}:{self.max}"


def parse_pool_spec(text: str | int, what: str = "workers") -> PoolBounds:
    """ "N" (a fixed pool) or "MIN:MAX" (elastic); ValueError naming `what` and the value otherwise."""
    raw = str(text).strip()
    parts = raw.split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            return PoolBounds(min=n, max=n)
        if len(parts) == 2:
            return PoolBounds(min=int(parts[0]), max=int(parts[1]))
    except ValueError as e:
        if "pool bounds" in str(e):
            raise ValueError(f"{what} {raw!r}: {e}") from None
    raise ValueError(f"{what} must be N or MIN:MAX with 1 <= MIN <= MAX (e.g. 2 or 1:4), got {raw!r}")


@dataclass(frozen=True)
class PlannerConfig:
    interval_s: float = 5.0  # one tick (the executor's loop period)
    # prefill targets
    prefill_queue_tokens: int = 8192  # prompt tokens queued per prefill worker (not yet computed)
    ttft_target_s: float = 2.0  # p90 arrival -> first token at a prefill worker
    # decode targets
    decode_streams: int = 32  # running streams per decode worker
    kv_target: float = 0.8  # KV pages in use (fraction) per decode worker
    itl_target_s: float = 0.1  # p90 time between a decode worker's steps with streams
    # hysteresis and timing
    down_threshold: float = 0.6  # scale down only if n - 1 workers would be under this x target
    up_after: int = 2  # consecutive ticks over target before adding
    down_after: int = 3  # consecutive ticks under the consolidation threshold before removing
    up_cooldown_s: float = 15.0  # since the last change, before adding
    down_cooldown_s: float = 60.0  # since the last change, before removing
    stale_s: float = 15.0  # signals older than this: hold
    min_samples: int = 4  # latency samples a worker needs before its latency counts

    def __post_init__(self):
        positive = ("interval_s", "ttft_target_s", "kv_target", "itl_target_s", "stale_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"planner {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("prefill_queue_tokens", "decode_streams", "up_after", "down_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"planner {name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("up_cooldown_s", "down_cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"planner {name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.down_threshold < 1:
            raise ValueError(f"planner down_threshold must be in (0, 1), got {self.down_threshold!r}")
        if self.min_samples < 0:
            raise ValueError(f"planner min_samples must be >= 0, got {self.min_samples!r}")


@dataclass(frozen=True)
class WorkerSample:
    """One ready worker's signals as the executor read them (engine.handoff.WorkerSignals, flattened)."""

    worker_id: str
    running: int = 0  # streams holding pages
    waiting: int = 0
    kv_usage: float = 0.0
    queue_tokens: int = 0  # prompt tokens not yet computed (queued or mid-prefill)
    ttft_p90_s: float | None = None  # None: too few samples
    itl_p90_s: float | None = None
    samples: int = 0  # latency samples behind the p90
    at: float = 0.0  # when it was read (the executor's clock)


@dataclass(frozen=True)
class PoolObservation:
    pool: str
    bounds: PoolBounds
    ready: tuple[WorkerSample, ...] = ()
    starting: int = 0  # created, not yet serving
    draining: int = 0  # no new placements, streams finishing
    silent: int = 0  # serving, but its signals did not come back this tick (counted in the size, not the means)

    def __post_init__(self):
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")

    @property
    def size(self) -> int:
        """Workers that are or will be serving (a starting one counts: it is capacity on its way)."""
        return len(self.ready) + self.silent + self.starting


@dataclass(frozen=True)
class ScaleDecision:
    pool: str
    current: int
    desired: int
    reason: str  # a REASONS entry when desired != current, else a HOLD_REASONS entry
    pressure: float = 0.0  # the largest signal / its target (1.0 = at target)
    detail: str = ""

    @property
    def changed(self) -> bool:
        return self.desired != self.current


@dataclass
class _PoolState:
    over: int = 0  # consecutive ticks over target
    under: int = 0  # consecutive ticks under the consolidation threshold
    last_change: float = -math.inf


def pressure(obs: PoolObservation, cfg: PlannerConfig) -> tuple[float, str, str]:
    """(largest signal / target, its reason, a line of every signal) of a pool's ready workers."""
    ready = obs.ready
    n = len(ready)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    def latency(attr: str) -> float:
        # An idle worker's window still holds its last busy spell: more workers would not make that faster, so
        # it counts as 0 (a burst that ended must not keep a pool large, nor grow it again).
        vals = [
            getattr(w, attr) if w.running + w.waiting + w.queue_tokens > 0 else 0.0
            for w in ready
            if getattr(w, attr) is not None and w.samples >= cfg.min_samples
        ]
        return mean(vals)

    if obs.pool == "prefill":
        signals = {
            "queue_tokens": mean([w.queue_tokens for w in ready]) / cfg.prefill_queue_tokens,
            "ttft": latency("ttft_p90_s") / cfg.ttft_target_s,
        }
    else:
        signals = {
            "streams": mean([w.running + w.waiting for w in ready]) / cfg.decode_streams,
            "kv_usage": mean([w.kv_usage for w in ready]) / cfg.kv_target,
            "itl": latency("itl_p90_s") / cfg.itl_target_s,
        }
    reason = max(signals, key=lambda k: signals[k])
    detail = f"{n} ready: " + ", ".join(f"{k} {v:.2f}" for k, v in signals.items())
    return signals[reason], reason, detail


@dataclass
class Planner:
    """Keeps, per pool, the consecutive-tick counters and the time of the last change; `decide` is the one
    entry point (one call per pool per tick)."""

    config: PlannerConfig = field(default_factory=PlannerConfig)
    _state: dict[str, _PoolState] = field(default_factory=dict)

    def decide(self, obs: PoolObservation, now: float) -> ScaleDecision:
        st = self._state.setdefault(obs.pool, _PoolState())
        n, b = obs.size, obs.bounds

        def out(desired: int, reason: str, p: float = 0.0, detail: str = "") -> ScaleDecision:
            if desired != n:
                st.last_change, st.over, st.under = now, 0, 0
            return ScaleDecision(obs.pool, n, desired, reason, p, detail)

        if n < b.min:
            return out(b.min, "below_min")
        if n > b.max:
            return out(b.max, "above_max")
        if not b.elastic:
            return out(n, "steady")
        if obs.starting or obs.draining:
            return out(n, "settling", detail=f"{obs.starting} starting, {obs.draining} draining")
        if not obs.ready or now - min(w.at for w in obs.ready) > self.config.stale_s:
            st.over = st.under = 0
            return out(n, "stale")
        p, why, detail = pressure(obs, self.config)
        return self._by_pressure(st, obs, now, p, why, detail, out)

    def _by_pressure(self, st: _PoolState, obs: PoolObservation, now: float, p: float, why: str, detail: str, out):
        cfg, n, b = self.config, obs.size, obs.bounds
        consolidated = p * n / (n - 1) if n > 1 else math.inf
        st.over = st.over + 1 if p > 1.0 else 0
        st.under = st.under + 1 if consolidated < cfg.down_threshold else 0
        if p > 1.0:
            if n >= b.max:
                return out(n, "at_max", p, detail)
            if st.over < cfg.up_after:
                return out(n, "confirming", p, detail)
            if now - st.last_change < cfg.up_cooldown_s:
                return out(n, "cooldown", p, detail)
            return out(min(b.max, max(n + 1, math.ceil(n * p))), why, p, detail)
        if consolidated < cfg.down_threshold:
            if n <= b.min:
                return out(n, "at_min", p, detail)
            if st.under < cfg.down_after:
                return out(n, "confirming", p, detail)
            if now - st.last_change < cfg.down_cooldown_s:
                return out(n, "cooldown", p, detail)
            return out(n - 1, "idle", p, detail + f"; on {n - 1} workers {consolidated:.2f}")
        return out(n, "consolidation" if n > b.min and p < cfg.down_threshold else "steady", p, detail)
