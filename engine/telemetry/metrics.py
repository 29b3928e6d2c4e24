"""Prometheus metrics of every stage, shared by all worker roles, scrapeable from one URL per node.

Every process of a node (router, prefill and decode actors, HTTP replicas) writes its samples to the
shared directory named by PROMETHEUS_MULTIPROC_DIR (prometheus-client multiprocess mode); one HTTP
server per node aggregates that directory (`start_metrics_server`). The service sets the variable for
every actor before any of them imports prometheus_client. Without it, metrics live in the process
registry (tests, `dsv4 generate`).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BYTES_BUCKETS = tuple(float(4**k) for k in range(5, 18))  # 1 KiB .. 16 GiB

WORKER = ("role", "worker")

REQUEST_QUEUE_TIME = Histogram(
    "dsv4_request_queue_time_seconds", "Time a request waited before its first step", WORKER, buckets=LATENCY_BUCKETS
)
PREFILL_TIME = Histogram(
    "dsv4_prefill_time_seconds", "Prefill time from first step to first token", WORKER, buckets=LATENCY_BUCKETS
)
KV_TRANSFER_TIME = Histogram(
    "dsv4_kv_transfer_time_seconds", "Time to pull one request's caches", ("worker", "backend"), buckets=LATENCY_BUCKETS
)
KV_TRANSFER_BYTES = Histogram(
    "dsv4_kv_transfer_bytes", "Bytes moved per request hand-off", ("worker", "backend"), buckets=BYTES_BUCKETS
)
TTFT = Histogram(
    "dsv4_time_to_first_token_seconds",
    "Arrival to first token, including the KV transfer",
    ("model_name",),
    buckets=LATENCY_BUCKETS,
)
ITL = Histogram(
    "dsv4_inter_token_latency_seconds",
    "Time between consecutive streamed tokens",
    ("model_name",),
    buckets=LATENCY_BUCKETS,
)
GC_PAUSE = Histogram(
    "dsv4_gc_pause_seconds",
    "Python cycle-collector passes (a pause of the whole process) by component and generation",
    ("component", "generation"),
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
GC_FROZEN = Gauge(
    "dsv4_gc_frozen_objects",
    "Objects frozen out of the cycle collector's walks once the process was warm (0: never frozen)",
    ("component",),
    multiprocess_mode="max",
)
E2E = Histogram("dsv4_e2e_request_latency_seconds", "Arrival to last token", ("model_name",), buckets=LATENCY_BUCKETS)
DECODE_TIME = Histogram(
    "dsv4_decode_time_seconds", "Decode phase: caches arrived to last token", WORKER, buckets=LATENCY_BUCKETS
)

RUNNING = Gauge("dsv4_running_requests", "Requests holding cache pages", WORKER, multiprocess_mode="mostrecent")
WAITING = Gauge("dsv4_waiting_requests", "Requests waiting for admission", WORKER, multiprocess_mode="mostrecent")
KV_USAGE = Gauge(
    "dsv4_kv_cache_usage_ratio",
    "Fraction of the tightest cache group's pages in use",
    WORKER,
    multiprocess_mode="mostrecent",
)
# 1 where the engine takes a GPU fast path, 0 where it fell back (set once at start; the reason is in the
# start-up WARNING and the worker's stats).
FAST_PATH_ACTIVE = Gauge(
    "dsv4_fast_path_active",
    "1 if the engine takes this GPU fast path, 0 if it fell back",
    (*WORKER, "path"),
    multiprocess_mode="mostrecent",
)

PROMPT_TOKENS = Counter("dsv4_prompt_tokens_total", "Prompt tokens prefilled", WORKER)
GENERATION_TOKENS = Counter("dsv4_generation_tokens_total", "Tokens generated", WORKER)
REQUESTS = Counter("dsv4_requests_total", "Finished requests by status", ("model_name", "status"))
# Kernel variants compiled while serving (engine.telemetry.compile_watch: looked for after a slow step): a warm-up that
# covers serving leaves this at 0; each one stalled its step for seconds.
KERNEL_COMPILES = Counter(
    "dsv4_kernel_compiles_total", "Kernel variants compiled during serving steps (after warm-up)", WORKER
)
# One count per failed transfer: the pulling (decode) worker counts its failed pulls (kind timeout / error); the
# prefill worker counts only leases that expired unconfirmed (kind lease_expired: the decode side vanished and
# could not count). A cancelled request (client gone) is not a failure: KV_TRANSFER_ABORTS counts those apart.
KV_TRANSFER_FAILURES = Counter(
    "dsv4_kv_transfer_failures_total",
    "KV transfers that failed or timed out (counted once, by the pulling side)",
    ("worker", "backend", "kind"),
)
KV_TRANSFER_ABORTS = Counter(
    "dsv4_kv_transfer_aborts_total",
    "KV transfers abandoned because their request was cancelled (not failures)",
    ("worker", "backend", "side"),
)
# Streamed hand-offs (a long prompt's KV pulled chunk by chunk while its later chunks are prefilled): the chunk
# tickets pulled (by the decode worker), and the hand-off time the prefill did not hide (by the dispatcher: from
# the prefill's result to the caches landing on the decode worker, streamed or not: compare the two).
KV_STREAM_CHUNKS = Counter(
    "dsv4_kv_stream_chunks_total",
    "Chunk tickets of streamed prefills pulled while the prefill ran",
    ("worker", "backend"),
)
KV_HANDOFF_EXPOSED = Histogram(
    "dsv4_kv_handoff_exposed_seconds",
    "Prefill result to the caches landing on the decode worker: hand-off time not overlapped with the prefill",
    ("streamed",),
    buckets=LATENCY_BUCKETS,
)
# The engines' real prefix cache (engine.execution.prefix_cache): prompt tokens looked up at admission, and those
# served from cache (not computed). Hit ratio = hit / query; dashboards and alerts read these.
PREFIX_QUERY_TOKENS = Counter(
    "dsv4_prefix_cache_query_tokens_total", "Prompt tokens looked up in the engine's prefix cache at admission", WORKER
)
PREFIX_HIT_TOKENS = Counter(
    "dsv4_prefix_cache_hit_tokens_total", "Prompt tokens served from the engine's prefix cache (not computed)", WORKER
)
# Speculative decoding (engine.execution.speculative), per decode engine: draft tokens verified, those accepted, and
# verify steps (one a request per step it verified drafts in). Acceptance rate = accepted / drafted; accepted tokens
# per verify step = accepted / verify steps (tokens a step emits: that + 1). Undrafted steps: steps whose decoding
# requests got no drafts because SpecGate paused drafting (batch above its ceiling, low acceptance, or plain steps
# measured faster): a speculative engine that never drafts shows here, not as a low acceptance rate.
SPEC_DRAFT_TOKENS = Counter("dsv4_spec_draft_tokens_total", "Speculative draft tokens verified", WORKER)
SPEC_ACCEPTED_TOKENS = Counter("dsv4_spec_accepted_tokens_total", "Speculative draft tokens accepted", WORKER)
SPEC_VERIFY_STEPS = Counter(
    "dsv4_spec_verify_steps_total", "Request verify steps (one a request a step with drafts)", WORKER
)
SPEC_UNDRAFTED_STEPS = Counter(
    "dsv4_spec_undrafted_steps_total", "Decode steps run without drafts because SpecGate paused drafting", WORKER
)
# The router's ESTIMATE: prompt tokens it believed cached on the worker it chose (router.metrics.estimate_tokens).
ROUTER_PREFIX_ESTIMATE_QUERIES = Counter(
    "dsv4_router_prefix_estimate_query_tokens_total", "Prompt tokens the router scored for prefix-cache hits", ()
)
ROUTER_PREFIX_ESTIMATE_HITS = Counter(
    "dsv4_router_prefix_estimate_hit_tokens_total",
    "Prompt tokens the router estimated cached on the chosen prefill worker",
    (),
)

# Elastic pools (service/pools.py runs service/planner.py): per pool ("prefill" / "decode").
POOL_WORKERS = Gauge(
    "dsv4_pool_workers",
    "Workers of a pool by state: ready (placed on), starting, draining",
    ("pool", "state"),
    multiprocess_mode="mostrecent",
)
POOL_DESIRED_WORKERS = Gauge(
    "dsv4_pool_desired_workers", "Workers the planner wants in a pool", ("pool",), multiprocess_mode="mostrecent"
)
POOL_PRESSURE = Gauge(
    "dsv4_pool_pressure",
    "A pool's largest signal as a fraction of its target (1 = at target)",
    ("pool",),
    multiprocess_mode="mostrecent",
)
POOL_SCALE_DECISIONS = Counter(
    "dsv4_pool_scale_decisions_total",
    "Pool size changes the planner made, by direction and reason",
    ("pool", "direction", "reason"),
)
POOL_START_FAILURES = Counter(
    "dsv4_pool_start_failures_total", "Workers added to a pool that never became ready (given up)", ("pool",)
)


def observe_engine_load(role: str, worker: str, load) -> None:
    """Publish the load gauges of one engine from its `EngineLoad` (the worker calls it on every change)."""
    RUNNING.labels(role, worker).set(load.running)
    WAITING.labels(role, worker).set(load.waiting)
    KV_USAGE.labels(role, worker).set(load.kv_usage)


def observe_fast_paths(role: str, worker: str, states) -> None:
    """Publish an engine's `FastPath` states (engine.model.fast_paths) as dsv4_fast_path_active."""
    for p in states:
        FAST_PATH_ACTIVE.labels(role, worker, p.name).set(1 if p.active else 0)


class PrefixCounters:
    """Mirrors an engine's cumulative `PrefixStats` into the Prometheus counters (increments by the delta
    since the last call; the worker calls it with its load gauges)."""

    def __init__(self, role: str, worker: str):
        self.labels = (role, worker)
        self.query = self.hit = 0
        PREFIX_QUERY_TOKENS.labels(*self.labels)  # exported at 0 from the start (dashboards divide by it)
        PREFIX_HIT_TOKENS.labels(*self.labels)

    def observe(self, stats) -> None:
        if stats is None:
            return
        if stats.query_tokens > self.query:
            PREFIX_QUERY_TOKENS.labels(*self.labels).inc(stats.query_tokens - self.query)
        if stats.hit_tokens > self.hit:
            PREFIX_HIT_TOKENS.labels(*self.labels).inc(stats.hit_tokens - self.hit)
        self.query, self.hit = stats.query_tokens, stats.hit_tokens


class SpecCounters:
    """Mirrors a Speculator's cumulative `stats` (drafted, accepted, verify_chunks, undrafted_steps) into the
    speculative-decoding counters by the delta since the last call (the worker calls it with its load gauges)."""

    KEYS = (
        ("drafted", SPEC_DRAFT_TOKENS),
        ("accepted", SPEC_ACCEPTED_TOKENS),
        ("verify_chunks", SPEC_VERIFY_STEPS),
        ("undrafted_steps", SPEC_UNDRAFTED_STEPS),
    )

    def __init__(self, role: str, worker: str):
        self.labels = (role, worker)
        self.seen = {key: 0 for key, _ in self.KEYS}
        for _, counter in self.KEYS:
            counter.labels(*self.labels)  # exported at 0 from the start (dashboards divide by them)

    def observe(self, stats: dict) -> None:
        for key, counter in self.KEYS:
            if stats[key] > self.seen[key]:
                counter.labels(*self.labels).inc(stats[key] - self.seen[key])
                self.seen[key] = stats[key]


def metrics_registry() -> CollectorRegistry | None:
    """The registry to serve: the aggregated multiprocess one when the shared directory is set."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return None
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path)
    return registry


def start_metrics_server(port: int, host: str = "0.0.0.0"):
    """Serve /metrics for every process of this node; -> (server, thread)."""
    registry = metrics_registry()
    if registry is None:
        return start_http_server(port, addr=host)
    return start_http_server(port, addr=host, registry=registry)
