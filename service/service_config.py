"""`ServiceConfig`: what `dsv4 serve` (service.launcher) deploys, with each role's parallel layout."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runtime.health import DEFAULT_STALL_TIMEOUT_S
from service.http_limits import HttpLimits
from service.ingress_guard import DEFAULT_MAX_BODY_BYTES
from service.planner import PlannerConfig, PoolBounds

ENGINE_OPTION_KEYS = (
    "device",
    "dtype",
    "max_batch_tokens",
    "max_num_seqs",
    "max_cached_tokens",
    "kv_cache_dtype",
    "index_cache_dtype",
    "decode_mode",
    "keep_mxfp4_experts",
    "prefix_cache",
    "gpu_memory_utilization",
    "max_model_len",
    "speculative_tokens",
    "prefill_expert_format",
)
PREFILL_POOL_KEYS = ("prefill_expert_format",)  # given to the prefill pool only (the decode pool keeps MXFP4 experts)


def role_engine_options(opts: dict, role: str) -> dict:
    """One pool's engine options: the prefill-only keys stay with the prefill pool ("fp8" on an engine that decodes
    would hold both expert formats)."""
    return opts if role == "prefill" else {k: v for k, v in opts.items() if k not in PREFILL_POOL_KEYS}


@dataclass(frozen=True)
class ServiceConfig:
    model_dir: str
    model_name: str = "dsv4"
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int = 8080
    router_port: int = 0  # 0: any free port (a fixed one can collide with another router on the machine)
    prefill_workers: int = 1  # at start; the least an elastic pool keeps
    decode_workers: int = 1
    # Elastic pools (service/pools.py): the most workers the planner may grow a pool to; None: fixed at *_workers.
    prefill_max_workers: int | None = None
    decode_max_workers: int | None = None
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # targets, hysteresis, cooldowns
    drain_timeout_s: float = 300.0  # a worker leaving its pool: its streams' time to finish before they migrate
    transfer: str = "auto"
    router_policy: str = "cache_aware"
    engine_options: tuple = ()  # (key, value) pairs for load_engine
    # A Ray CPU reservation is a scheduling token, not a limit: 0.25 a worker lets 2P2D plus two ingress
    # replicas (0.1 each) fit a 2-core machine.
    worker_num_cpus: float = 0.25
    ready_timeout_s: float = 300.0  # per startup stage: workers pinged, router bound, HTTP ingress answering
    ingress_replicas: int = 2
    # gRPC router replicas (placement only: tokens stream from the decode workers to the ingress replicas); any can
    # place any request, so one killed or restarting loses nothing. Each reserves no CPU (it mostly waits).
    routers: int = 2
    api_key: str | None = None  # required on every OpenAI route when set
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allow_request_chat_template: bool = False
    api_docs: bool = False
    metrics_host: str | None = None  # None: loopback on one node, the node's address on a cluster
    drain_s: float = 10.0  # on shutdown, how long in-flight requests may take to finish
    router_max_queued: int = 1024  # requests waiting at the router for a decode slot (429 beyond)
    router_queue_timeout_s: float = 60.0  # how long one may wait there (503 after)
    tensor_parallel_size: int = 1  # ranks (actors, GPUs on CUDA) per worker: service.rank_placement
    expert_parallel: bool = False  # routed experts split by id across a worker's ranks (roles of > 1 rank)
    # every rank of a worker a worker of its own (attention data-parallel, experts split): service.rank_placement
    data_parallel_attention: bool = False
    # one role's ranks per worker when it differs from tensor_parallel_size (e.g. prefill at 1, decode at 2: the
    # hand-off moves rank 0's pages, which hold the whole request under either layout)
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    # GPUs each rank reserves on CUDA (None: 1). A fraction shares a GPU between workers (e.g. 0.5: one prefill and
    # one decode worker on one GPU); each worker's default --gpu-memory-utilization then shrinks to its share.
    worker_num_gpus: float | None = None
    # a worker whose engine thread stays this long in one step or call is unhealthy, then restarted
    # (engine.runtime.health); well above the slowest legitimate step
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    worker_test_hooks: bool = False  # workers expose inject_fault (tests only; no CLI flag)
    # request head size and head / body time at the HTTP ingress (service.http_limits)
    http_limits: HttpLimits = field(default_factory=HttpLimits.from_env)

    def __post_init__(self):
        if isinstance(self.routers, bool) or not isinstance(self.routers, int) or self.routers < 1:
            raise ValueError(f"routers must be an int >= 1, got {self.routers!r}")
        for name in ("tensor_parallel_size", "prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for role in ("prefill", "decode"):
            bounds = self.pool_bounds(role)  # validates MIN <= MAX
            if bounds.elastic and self.parallel(role)[0] > 1:
                raise ValueError(
                    f"an elastic {role} pool ({bounds}) needs single-rank workers, got tensor parallel size "
                    f"{self.parallel(role)[0]} (a multi-rank worker's group restart is not elastic yet)"
                )
        sizes = [self.parallel(role)[0] for role in ("prefill", "decode")]
        if self.data_parallel_attention and not (max(sizes) > 1 and self.expert_parallel):
            raise ValueError(
                "data_parallel_attention needs a tensor parallel size > 1 and expert_parallel (its ranks "
                f"share the routed experts), got tensor parallel sizes {sizes} (prefill, decode), "
                f"expert_parallel {self.expert_parallel}"
            )

    def pool_bounds(self, role: str) -> PoolBounds:
        """MIN:MAX of a pool (MIN = MAX: fixed)."""
        n, most = getattr(self, f"{role}_workers"), getattr(self, f"{role}_max_workers")
        try:
            return PoolBounds(min=n, max=n if most is None else most)
        except ValueError as e:
            raise ValueError(f"{role} workers: {e}") from None

    @property
    def elastic(self) -> bool:
        return any(self.pool_bounds(role).elastic for role in ("prefill", "decode"))

    def parallel(self, role: str) -> tuple[int, bool, bool]:
        """One role's worker layout: (ranks, expert parallel, data-parallel attention); the flags apply to the
        roles of more than one rank."""
        size = getattr(self, f"{role}_tensor_parallel_size") or self.tensor_parallel_size
        return size, self.expert_parallel and size > 1, self.data_parallel_attention and size > 1
