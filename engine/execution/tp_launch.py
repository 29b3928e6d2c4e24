"""Start a tensor-parallel engine on one host: this process is rank 0, `tp_size - 1` spawned processes follow.

`RankGroup.start(tp_size, device, expert_parallel, build, engine_kwargs)` spawns the followers (torch
multiprocessing, "spawn" start method), each of which joins the process group (gloo on a free loopback
port on CPU, NCCL on CUDA: rank r on cuda:r), builds the same engine with `build(**engine_kwargs,
parallel=its ParallelContext)` (engine.loading.load.load_engine, which cuts the weights; a module-level function,
so it pickles by name) and runs `engine.execution.tp_executor.follow`. The caller
joins as rank 0 with `group.context` and drives the engine; `close()` releases the followers and joins them.

Used by `engine.llm.LLM(tensor_parallel_size=N)`, hence by `dsv4 generate --tensor-parallel-size N`. Ray
workers that span several GPUs start their ranks as actors instead (one per GPU) and use the same
`init_distributed` / `follow` pieces.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from dataclasses import dataclass, field

import torch

from engine.model.parallel import (
    ParallelContext,
    free_loopback_port,
    init_distributed,
    process_backend,
    rank_device,
    shutdown_distributed,
)

JOIN_TIMEOUT_S = 30.0


def _follower_main(
    rank: int,
    tp_size: int,
    port: int,
    expert_parallel: bool,
    build,
    engine_kwargs: dict,
    ready,
    data_parallel_attention: bool = False,
) -> None:
    from engine.execution.dp_attention import dp_follow
    from engine.execution.tp_executor import follow

    device = rank_device(engine_kwargs.get("device", "cpu"), rank)
    if device.type == "cpu":  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    ready.put(rank)  # alive and about to join: rank 0 stops watching for an early death
    ctx = init_distributed(
        rank, tp_size, device, port, expert_parallel=expert_parallel, data_parallel_attention=data_parallel_attention
    )
    try:
        engine = build(**{**engine_kwargs, "device": str(device)}, parallel=ctx)
        (dp_follow if data_parallel_attention else follow)(engine)
    finally:
        shutdown_distributed(ctx)


@dataclass
class RankGroup:
    """Rank 0's handle on a one-host tensor-parallel group (see the module docstring)."""

    context: ParallelContext
    processes: list = field(default_factory=list)

    @classmethod
    def start(
        cls,
        tp_size: int,
        device: str,
        expert_parallel: bool,
        build,
        engine_kwargs: dict,
        data_parallel_attention: bool = False,
    ) -> RankGroup:
        if tp_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp_size}")
        if expert_parallel and tp_size == 1:
            raise ValueError("--expert-parallel needs --tensor-parallel-size > 1 (experts split across the ranks)")
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.device_count() < tp_size and process_backend(dev) == "nccl":
            raise ValueError(
                f"--tensor-parallel-size {tp_size} needs {tp_size} GPUs, "
                f"{torch.cuda.device_count()} visible (DSV4_TP_BACKEND=gloo lets ranks share one GPU, "
                "slowly, to check the GPU path)"
            )
        if data_parallel_attention:  # (the same ValueError a rank would raise, before anything spawns)
            ParallelContext(tp_size, 0, expert_parallel, data_parallel_attention=True)
        if tp_size == 1:
            return cls(ParallelContext(1, 0, expert_parallel))
        port = free_loopback_port()
        spawn = mp.get_context("spawn")
        ready = spawn.Queue()
        procs = [
            spawn.Process(
                target=_follower_main,
                name=f"dsv4-tp-rank{r}",
                daemon=True,
                args=(r, tp_size, port, expert_parallel, build, engine_kwargs, ready, data_parallel_attention),
            )
            for r in range(1, tp_size)
        ]
        for p in procs:
            p.start()
        try:
            _wait_ready(procs, ready)
            ctx = init_distributed(
                0,
                tp_size,
                rank_device(device, 0),
                port,
                expert_parallel=expert_parallel,
                data_parallel_attention=data_parallel_attention,
            )
        except BaseException:
            _stop(procs)
            raise
        return cls(ctx, procs)

    def close(self, engine=None) -> None:
        """Release the followers (engine: rank 0's EngineCore, None if it was never built) and join them."""
        from engine.execution.dp_attention import release
        from engine.execution.tp_executor import release_followers

        try:
            if engine is not None:
                (release if engine.data_parallel is not None else release_followers)(engine)
        finally:
            if engine is not None:  # the followers tear the group down too: side by side, before joining
                shutdown_distributed(self.context)
            _stop(self.processes, JOIN_TIMEOUT_S if engine is not None else 0.0)
            self.processes = []
            if engine is None:  # followers terminated: only this rank's handle is left
                shutdown_distributed(self.context)


def _wait_ready(procs: list, ready) -> None:
    """Block until every follower reported in; RuntimeError as soon as one died instead (the rendezvous
    itself would wait for it until the group timeout)."""
    waiting = set(range(1, len(procs) + 1))
    while waiting:
        try:
            waiting.discard(ready.get(timeout=0.2))
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs, start=1) if r in waiting and not p.is_alive()]
            if dead:
                raise RuntimeError(
                    f"tensor-parallel rank {dead[0][0]} exited (code {dead[0][1]}) before joining "
                    "the group; its traceback is on stderr"
                ) from None


def _stop(procs: list, timeout: float = JOIN_TIMEOUT_S) -> None:
    for p in procs:
        p.join(timeout)
        if p.is_alive():  # stuck in a collective after rank 0 failed mid-step
            p.terminate()
            p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join(JOIN_TIMEOUT_S)
