"""A prefill or decode worker spanning several devices: rank 0 is the worker, the other ranks follow it.

With data-parallel attention (`TensorParallelSpec.data_parallel_attention`) there are no followers: every rank
is a worker of its own (its requests, scheduler, KV pool, transfer endpoint and router identity), and the ranks'
engine loops step in lockstep (engine.runtime.engine_loop, engine.execution.dp_attention) because their MoE layers exchange tokens.

The service places one Ray actor per device, all of a worker's actors in one placement group (STRICT_PACK,
so one host and loopback rendezvous). The worker actor (engine.runtime.worker_base.WorkerBase) finds a
`TensorParallelSpec` under `engine_options["tensor_parallel"]`, joins the group as rank 0 and schedules;
each other actor is a `RankFollower`: it joins as rank r, builds the same engine with its cut of the
weights and runs `engine.execution.tp_executor.follow` on a thread until rank 0 releases it or the group fails.
Nothing here imports Ray: service.launcher wraps the classes with ray.remote.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine.execution.tp_executor import follow
from engine.loading.load import load_engine
from engine.model.parallel import ParallelContext, init_distributed, shutdown_distributed

DP_COLLECTIVE_TIMEOUT_S = 600.0  # longer than any one step of a peer, its first-use kernel compiles included


@dataclass(frozen=True)
class TensorParallelSpec:
    """How one worker's ranks find each other: group size, expert parallelism, rendezvous address, and whether
    attention is data-parallel (every rank a worker, engine.execution.dp_attention) rather than tensor-parallel."""

    size: int
    expert_parallel: bool = False
    master_port: int = 0
    master_addr: str = "127.0.0.1"
    data_parallel_attention: bool = False

    def __post_init__(self):
        if self.size < 2:
            raise ValueError(f"a multi-rank worker needs size >= 2, got {self.size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if self.data_parallel_attention and not self.expert_parallel:
            raise ValueError("data-parallel attention needs expert parallelism (the ranks share the routed experts)")

    def join(self, rank: int, device: str) -> ParallelContext:
        """Blocks until every rank joined. A data-parallel attention group's collectives time out after
        DP_COLLECTIVE_TIMEOUT_S: its ranks meet every tick even when idle, so no legitimate wait is long, and a
        rank stuck in an NCCL exchange whose peer died then fails instead of hanging (gloo fails at once)."""
        timeout = {"timeout_s": DP_COLLECTIVE_TIMEOUT_S} if self.data_parallel_attention else {}
        return init_distributed(
            rank,
            self.size,
            actor_device(device),
            self.master_port,
            self.master_addr,
            self.expert_parallel,
            data_parallel_attention=self.data_parallel_attention,
            **timeout,
        )


def actor_device(device: str) -> str:
    """Ray gives each rank's actor one GPU (CUDA_VISIBLE_DEVICES), so "cuda" is cuda:0 in every rank."""
    return "cuda:0" if str(device).startswith("cuda") else str(device)


def split_engine_options(engine_options: dict | None) -> tuple[dict, TensorParallelSpec | None, int]:
    """-> (load_engine options, the tensor-parallel spec or None, this actor's rank: "rank", default 0)."""
    opts = dict(engine_options or {})
    return opts, opts.pop("tensor_parallel", None), opts.pop("rank", 0)


class RankFollower:
    """Rank r > 0 of a multi-rank worker (see the module docstring). ping() raises what ended it."""

    def __init__(self, rank: int, model_dir: str | None, engine_options: dict):
        opts, spec, _ = split_engine_options(engine_options)
        if spec is None or spec.data_parallel_attention or not 0 < rank < spec.size:
            raise ValueError(
                f"RankFollower needs a tensor_parallel spec (attention not data-parallel) and "
                f"0 < rank < size, got rank {rank}"
            )
        self.error: BaseException | None = None
        self.rank, self.state, self.steps = rank, "joining", 0
        self._thread = threading.Thread(
            target=self._run, args=(spec, model_dir, opts), daemon=True, name=f"tp-rank{rank}"
        )
        self._thread.start()

    def _run(self, spec: TensorParallelSpec, model_dir, opts: dict) -> None:
        ctx = None
        try:
            ctx = spec.join(self.rank, opts.get("device", "cpu"))
            self.state = "loading"
            engine = load_engine(model_dir, **{**opts, "device": actor_device(opts.get("device", "cpu"))}, parallel=ctx)
            self.state = "following"
            self.steps = follow(engine)
            self.state = "released"
        except BaseException as e:  # noqa: BLE001 - reported by ping()
            self.error, self.state = e, "failed"
        finally:
            if ctx is not None:
                shutdown_distributed(ctx)

    def ping(self) -> str:
        if self.error is not None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} failed: {self.error!r}") from self.error
        return self.state
