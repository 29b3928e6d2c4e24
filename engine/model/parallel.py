"""Tensor / expert parallelism inside one engine: the rank's place in its group and the few collectives.

One `ParallelContext` per engine process, passed explicitly at construction (no module-global state).
The model reads only three things from it:
- `all_reduce(x)`: sum of the ranks' partial outputs after every row-parallel projection (attention's
  `wo_b`, the MoE block's routed + shared experts) and after the vocab-parallel embedding;
- `gather_vocab(logits)`: the vocab-parallel LM head's shards, concatenated on the last dim;
- `head_range` / `expert_range` / `local(n)`: which slice of a split dimension this rank holds
  (engine.model.sharding cuts the weights with the same numbers).
At tp_size 1 every collective is the identity and no process group exists, so a one-rank engine runs
exactly the code it ran before.

Process groups: gloo on CPU, NCCL on CUDA (`init_distributed`). Rank 0 schedules; the other ranks
receive each step's inputs through `broadcast_object` (engine.execution.tp_executor).

Data-parallel attention (`data_parallel_attention`, engine.execution.dp_attention) is the other layout: `attention` is one
rank's context (nothing split, every rank schedules its own requests), the routed experts are split by id, and
each MoE layer exchanges the ranks' tokens (`gather_counts`, `gather_rows`, `reduce_rows`).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv4_kernels.settings import TP_BACKEND, settings

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# gloo on CUDA: every collective goes through host memory and ranks may share a GPU. Slow and not capturable in
# a CUDA graph (such engines decode without graphs): a check of the GPU tensor-parallel path on one GPU, since
# NCCL refuses two ranks on one device. Not for serving.
TP_BACKEND_ENV = TP_BACKEND


def process_backend(device: str | torch.device) -> str:
    """The torch.distributed backend of a tensor-parallel group on `device`: gloo on CPU, NCCL on CUDA, unless
    $DSV4_TP_BACKEND names one (gloo on CUDA: see TP_BACKEND_ENV)."""
    device = torch.device(device)
    want = settings().tp_backend  # gloo, nccl or None (checked when parsed)
    if want is None:
        return BACKENDS[device.type]
    if want == "nccl" and device.type != "cuda":
        raise ValueError(f"{TP_BACKEND_ENV}={want!r} is not a backend for {device.type} (gloo, or nccl on CUDA)")
    return want


@dataclass(frozen=True)
class ParallelContext:
    """This rank's view of a tensor-parallel group of `tp_size` ranks.

    expert_parallel: routed experts are split by expert id across the ranks (each rank holds
    n_routed_experts / tp_size whole experts) instead of splitting every expert's intermediate dim.
    group: the torch.distributed process group (None = the default group; unused at tp_size 1).
    cpu_group: a gloo group over the same ranks for the per-step object broadcast on CUDA (as vLLM's CPU
    group): a follower waiting for rank 0's next step then blocks a host thread, not a spinning NCCL kernel.
    """

    tp_size: int = 1
    rank: int = 0
    expert_parallel: bool = False
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    host_collectives: bool = False  # gloo over CUDA tensors: collectives run on host copies (TP_BACKEND_ENV)
    # Data-parallel attention (engine.execution.dp_attention): every rank holds the whole attention, embedding, LM head
    # and shared expert and runs its own requests; only the routed experts are split (expert parallelism),
    # and each MoE layer exchanges the ranks' tokens.
    data_parallel_attention: bool = False

    def __post_init__(self):
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.tp_size}")
        if self.data_parallel_attention and not (self.tp_size > 1 and self.expert_parallel):
            raise ValueError(
                "data-parallel attention needs --tensor-parallel-size > 1 and --expert-parallel (the "
                f"ranks split the routed experts), got size {self.tp_size}, expert_parallel "
                f"{self.expert_parallel}"
            )

    @property
    def attention(self) -> ParallelContext:
        """The context of everything but the routed experts: this one, or one rank's under data-parallel
        attention (nothing there is split, and the engine schedules as a lone engine)."""
        return SINGLE if self.data_parallel_attention else self

    @property
    def enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and samples; the others only execute."""
        return self.rank == 0

    # ---- how a split dimension is cut ------------------------------------------------------------
    def local(self, n: int, what: str) -> int:
        """n / tp_size, or a ValueError naming `what` when n does not split evenly."""
        if n % self.tp_size:
            raise ValueError(f"{what} = {n} is not divisible by --tensor-parallel-size {self.tp_size}")
        return n // self.tp_size

    def local_groups(self, n: int, what: str) -> int:
        """Output groups (o_groups) a rank holds: n / tp_size, or 1 when n divides tp_size (each group's heads
        span tp_size / n ranks, a rank holds part of one group); a ValueError naming `what` otherwise."""
        if n % self.tp_size == 0:
            return n // self.tp_size
        if self.tp_size % n == 0:
            return 1
        raise ValueError(f"{what} = {n} is neither divisible by nor a divisor of --tensor-parallel-size {self.tp_size}")

    def shard_range(self, n: int, what: str) -> range:
        """This rank's contiguous slice of an evenly split dimension of size n."""
        k = self.local(n, what)
        return range(self.rank * k, (self.rank + 1) * k)

    def padded_range(self, n: int) -> range:
        """Like shard_range for a dimension that may not split evenly (the vocab): ceil(n / tp) rows a rank,
        the last rank's slice clipped at n (it may be empty)."""
        k = -(-n // self.tp_size)
        return range(min(n, self.rank * k), min(n, (self.rank + 1) * k))

    def expert_range(self, n_experts: int) -> range:
        """The routed experts this rank holds: all of them without expert parallelism."""
        if not (self.enabled and self.expert_parallel):
            return range(n_experts)
        return self.shard_range(n_experts, "n_routed_experts")

    # ---- collectives (identity at tp_size 1) -----------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place where possible; -> the summed tensor (same shape and dtype)."""
        if not self.enabled:
            return x
        x = x.contiguous()
        if self.host_collectives and x.is_cuda:
            return x.copy_(self._on_host(self.all_reduce, x))
        if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
            # gloo's CPU all-reduce has no 16-bit kernels; sum in fp32 and round once, as NCCL would not
            # (it sums in the dtype), which only makes the CPU path slightly more exact.
            y = x.float()
            dist.all_reduce(y, group=self.group)
            return y.to(x.dtype)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """local: [N, ceil(vocab / tp)] logits of this rank's vocab slice -> [N, vocab] on every rank."""
        if not self.enabled:
            return local
        if self.host_collectives and local.is_cuda:
            return self._on_host(lambda y: self.gather_vocab(y, vocab), local)
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab]

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype everywhere), in place."""
        if self.enabled and self.host_collectives and x.is_cuda:
            return x.copy_(self._on_host(self.broadcast_tensor, x))
        if self.enabled:
            dist.broadcast(x, src=0, group=self.group)
        return x

    @staticmethod
    def _on_host(collective, x: torch.Tensor) -> torch.Tensor:
        """Run `collective` on a host copy of a CUDA tensor -> the result back on x's device."""
        return collective(x.cpu()).to(x.device)

    # ---- data-parallel attention: the MoE layers' token exchange --------------------------------
    def token_exchange(self, token_ids: torch.Tensor, counts: Sequence[int] | None = None) -> TokenExchange:
        """One step's exchange plan from this rank's token ids [T]: every rank's count and every rank's ids,
        gathered once a step (each MoE layer then gathers only its activations). counts: every rank's count when
        all ranks know it already (a decode step of a bucket the group agreed on): no host-side gather, so the
        exchange is device collectives only and a CUDA graph can hold it."""
        counts = tuple(self.gather_counts(token_ids.shape[0]) if counts is None else counts)
        if len(counts) != self.tp_size or counts[self.rank] != token_ids.shape[0]:
            raise ValueError(
                f"token exchange: counts {counts} for {self.tp_size} ranks, this rank (rank "
                f"{self.rank}) has {token_ids.shape[0]} tokens"
            )
        ids = self.gather_rows(token_ids, counts) if max(counts) else token_ids
        return TokenExchange(counts, ids)

    def gather_counts(self, n: int) -> list[int]:
        """Every rank's `n` (a host int), in rank order, over the host-side group: no device sync."""
        return [int(v) for v in self.gather_values(int(n))]

    def gather_values(self, value) -> list:
        """Every rank's `value` (a small picklable host object), in rank order, over the host-side group."""
        out = [None] * self.tp_size
        dist.all_gather_object(out, value, group=self.cpu_group if self.cpu_group is not None else self.group)
        return out

    def gather_rows(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """x: this rank's [counts[rank], ...] rows -> [tp_size * max(counts), ...]: rank r's rows at
        r * max(counts), each block zero-padded to max(counts) rows (collectives need equal sizes)."""
        width = max(counts)
        if self.host_collectives and x.is_cuda:
            return self._on_host(lambda y: self.gather_rows(y, counts), x)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        wire = padded.float() if _gloo_16bit(padded) else padded
        parts = [torch.empty_like(wire) for _ in range(self.tp_size)]
        dist.all_gather(parts, wire, group=self.group)
        return torch.cat(parts).to(x.dtype)

    def reduce_rows(self, y: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """y: [tp_size * max(counts), ...] partial sums laid out as gather_rows gave them -> this rank's
        [counts[rank], ...] rows summed over the ranks (NCCL: a reduce-scatter; gloo has none: an all-reduce)."""
        width = max(counts)
        if dist.get_backend(self.group) == "nccl" and not self.host_collectives:
            out = y.new_empty((width, *y.shape[1:]))
            dist.reduce_scatter_tensor(out, y.contiguous(), group=self.group)
            return out[: counts[self.rank]]
        summed = self.all_reduce(y.contiguous())
        return summed[self.rank * width : self.rank * width + counts[self.rank]]

    def broadcast_object(self, obj=None):
        """Rank 0's picklable `obj` on every rank (rank 0 gets its own back)."""
        if not self.enabled:
            return obj
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group if self.cpu_group is not None else self.group)
        return box[0]


SINGLE = ParallelContext()


@dataclass(frozen=True)
class TokenExchange:
    """One step's data-parallel MoE exchange (ParallelContext.token_exchange): counts[r] = rank r's tokens;
    token_ids: [tp_size * max(counts)] every rank's ids as gather_rows lays rows out (empty when no rank has any)."""

    counts: tuple[int, ...]
    token_ids: torch.Tensor


def _gloo_16bit(x: torch.Tensor) -> bool:
    """gloo's CPU collectives have no 16-bit kernels (see all_reduce): such tensors travel as fp32."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu"


def is_collective_failure(e: BaseException) -> bool:
    """Did a collective fail (a peer rank died, its connection reset)? Then the group is out of step for good:
    the ranks that got past the collective cannot be rejoined, so the caller must treat the worker as dead.
    NCCL reports `DistBackendError`; gloo a plain RuntimeError naming its transport."""
    if isinstance(e, getattr(dist, "DistBackendError", ())):
        return True
    return isinstance(e, RuntimeError) and "gloo" in str(e).lower()


def free_loopback_port() -> int:
    """A port the kernel reports free on 127.0.0.1 (the ranks' rendezvous on one host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    rank: int,
    tp_size: int,
    device: str | torch.device,
    master_port: int,
    master_addr: str = "127.0.0.1",
    expert_parallel: bool = False,
    timeout_s: float = 365 * 86400.0,
    data_parallel_attention: bool = False,
) -> ParallelContext:
    """Join the group of `tp_size` ranks (gloo on CPU, NCCL on CUDA) -> this rank's ParallelContext.

    On CUDA the rank's device is cuda:<rank % visible devices>, set before NCCL initialises. The timeout
    bounds every collective, including a follower's wait for rank 0's next step: an idle server waits for
    as long as it is idle, hence the default of a year (a dead peer still fails a collective at once).
    """
    device = torch.device(device)
    if device.type not in BACKENDS:
        raise ValueError(f"tensor parallelism supports cpu and cuda devices, got {device}")
    if tp_size == 1:
        return ParallelContext(1, 0, expert_parallel, data_parallel_attention=data_parallel_attention)
    backend = process_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(rank_device(device, rank))
    if master_addr in ("127.0.0.1", "localhost"):
        # gloo otherwise binds the interface the hostname resolves to, which a sandbox may not have.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=tp_size, timeout=timeout
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return ParallelContext(
        tp_size,
        rank,
        expert_parallel,
        dist.group.WORLD,
        cpu_group,
        host_collectives=backend == "gloo" and device.type == "cuda",
        data_parallel_attention=data_parallel_attention,
    )


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """The device a rank computes on: cuda -> cuda:<rank>; cpu stays cpu."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


def shutdown_distributed(ctx: ParallelContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def vocab_embed(table: torch.Tensor, token_ids: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Embedding lookup on a vocab-parallel table: table [ceil(V/tp), H] rows of this rank -> [T, H] everywhere.

    A rank looks up the ids in its slice and contributes zeros for the rest, so the all-reduce adds exact
    zeros: the result equals an unsplit lookup bit for bit.
    """
    if not ctx.enabled:
        return table[token_ids]
    start = ctx.rank * table.shape[0]
    local = token_ids - start
    mine = (local >= 0) & (local < table.shape[0])
    rows = table[local.clamp(0, table.shape[0] - 1)] * mine.unsqueeze(-1).to(table.dtype)
    return ctx.all_reduce(rows)
