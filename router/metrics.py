"""Router counters: decisions by (stage, reason), requests, retries, worker deaths, errors by code.

Plain in-process counters read by the Stats RPC, mirrored into Prometheus: the router's own counters are
defined here (same multiprocess registry as engine.telemetry.metrics, which the node's /metrics server aggregates).
Single event loop, so no locking.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prometheus_client import Counter as PromCounter

from engine.telemetry import metrics as prom
from router.policy import Decision, Placement

ROUTER_DECISIONS = PromCounter(
    "dsv4_router_decisions_total", "Placement decisions by stage and reason", ("stage", "reason")
)


@dataclass(frozen=True)
class MetricsSnapshot:
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (stage, reason) -> count
    requests_total: int = 0
    retries_total: int = 0
    worker_deaths_total: int = 0
    errors_total: dict[str, int] = field(default_factory=dict)  # error code name -> count


def estimate_tokens(prefill: Decision, block_size: int) -> tuple[int, int]:
    """(prompt tokens the router scored, those it believed cached on the chosen prefill worker). Policies that
    match hashed blocks count whole blocks; the cache-aware policy scores the workers' digests in tokens
    (cached_tokens + soon_cached_tokens + uncached_tokens is the prompt) and leaves the block counts at 0."""
    if prefill.prompt_blocks:
        return prefill.prompt_blocks * block_size, prefill.matched_blocks * block_size
    believed = prefill.cached_tokens + prefill.soon_cached_tokens
    return believed + prefill.uncached_tokens, believed


class RouterMetrics:
    def __init__(self, block_size: int = 16):
        self.block_size = block_size  # tokens per hashed prompt block (the policy's)
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[str] = Counter()
        self.requests = 0
        self.retries = 0
        self.worker_deaths = 0

    def record_placement(self, placement: Placement) -> None:
        for d in (placement.prefill, placement.decode):
            self.decisions[(d.stage, d.reason)] += 1
            ROUTER_DECISIONS.labels(d.stage, d.reason).inc()
        # The router's estimate (what it believed cached where it sent the request); the engines count real hits
        # (engine.telemetry.metrics.PREFIX_HIT_TOKENS).
        queried, hit = estimate_tokens(placement.prefill, self.block_size)
        prom.ROUTER_PREFIX_ESTIMATE_QUERIES.inc(queried)
        prom.ROUTER_PREFIX_ESTIMATE_HITS.inc(hit)

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(dict(self.decisions), self.requests, self.retries, self.worker_deaths, dict(self.errors))
