"""Fixed-shape prefill steps: a StepBatch whose every tensor shape depends only on a `PrefillShape` bucket.

A step with prefill chunks (one request's chunk, several, and decode tokens beside them) is sized by its contents in
`engine.model.batch.build_step`: its token count, how many compressor windows close, how many ring rows it writes,
the widest page table and the longest visible-entry list. A CUDA graph needs all of them fixed, so this module pads
the step to a bucket (tokens T, request rows S, context C) and builds it with build_step's own host formulas:
- request rows: the step's n requests first, then S - n padding rows: every padding token (T - N of them, N the
  step's tokens) in the last row, at positions 0.., the rows between with none. A padding row's page table is all
  scratch pages (engine.model.cache: never a request's), so everything it writes (SWA ring, compressor states,
  closed entries, indexer keys) lands there; starting at position 0, it reads no ring row, only its own chunk rows
  and its own (scratch) entries. Where the step fills its bucket (N == T) there may be no padding row (S == n);
- compressor plans: T // r + S entries for ratio r (a row of c tokens closes at most c // r + 1 windows); entries
  past the step's real ones pool chunk row T - 1 into the scratch entry row (the fast compressor kernel skips that
  row; the reference writes it);
- ring writes (SWA ring, compressor states): min(T, S x ring rows) + S x ring rows pairs (a row writes at most its
  last ring-rows positions, and as many again into a staging page where it keeps an in-step prefix-cache snapshot),
  the extra ones copying chunk row T - 1 into the group's scratch row;
- page tables `table_widths(C)` wide (a request's longer reservation is cut: entries of positions >= C cannot be
  touched yet) and visible-entry lists C // r long (their counts stay each token's own);
- logits: one row a request row, its last token (rows of requests whose chunk does not end the prompt are unused).
So real rows see exactly what build_step's batch gives them: the same token rows, sources, windows and cache rows;
only masked list lengths differ (more -1 / invisible columns in the indexer's and the attention's lists). What the
real rows compute may still round differently where a kernel's work depends on T rather than on the row
(engine.execution.prefill_graphs lists them); the CPU tests pin tokens, log-probs and cache values to fp32's last
bits, and the padding's writes to scratch pages exactly.

All arrays of one shape have the same sizes in the same order, so the step's host bytes fit one static device
buffer (`PrefillInputs`): refreshing a graph's inputs is one host-to-device copy, and `device_step` (the SWA
sources, the visible-entry rows: device ops on that buffer, no host sync) is captured with the forward
(engine.execution.prefill_graphs). Steps with prompt log-probs are not padded (their logit rows are per token).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.model.batch import (
    CompressPlan,
    HostStep,
    RingWrite,
    SourceRows,
    StepBatch,
    Upload,
    device_step,
    host_arrays,
    host_step,
)
from engine.model.cache import CachePool
from engine.model.decode_batch import doublings_and_halves, entry_groups, table_widths


@dataclass(frozen=True)
class PrefillShape:
    """A fixed-shape prefill step's bucket: token rows T, request rows S (requests + padding), context C (every
    position of the step is below it)."""

    tokens: int
    slots: int
    context: int

    def __post_init__(self) -> None:
        # T > S: a step of one token a request row is a decode step to the attention (attention._one_token_each)
        if self.slots < 1 or self.tokens <= self.slots or self.context < self.tokens:
            raise ValueError(f"PrefillShape needs 1 <= slots < tokens <= context, got {self}")

    def holds(self, counts: list[int], ends: list[int]) -> bool:
        """Do requests of these token counts and chunk ends fit (a padding row when they leave tokens over)?"""
        total = sum(counts)
        rows = len(counts) + (total < self.tokens)
        return total <= self.tokens and rows <= self.slots and max(ends, default=0) <= self.context


def token_buckets(min_tokens: int, max_tokens: int) -> list[int]:
    """Powers of two from min_tokens (rounded up to one) below max_tokens, then max_tokens."""
    out, n = [], 1 << max(0, min_tokens - 1).bit_length()
    while n < max_tokens:
        out.append(n)
        n *= 2
    return out + [max_tokens]


def context_buckets(tokens: int, max_context: int) -> list[int]:
    """Contexts of a T-token bucket: T, 1.5T, 2T, 3T, 4T, 6T, ... below max_context, then max_context (at least T).
    As the decode buckets (engine.execution.cuda_graphs.context_buckets): a later chunk's visible-entry lists, which
    the indexer scores and top-k scans in full, are at most 1.5x what it needs, at two graphs a doubling."""
    return doublings_and_halves(tokens, max_context) + [max(max_context, tokens)]


@dataclass(frozen=True)
class PrefillInputs:
    """A padded step's host arrays (HostStep): two steps of one shape have the same `signature`, so one static
    buffer takes either (the upload checks the byte count; tests/engine/test_prefill_buckets.py the layout)."""

    pool: CachePool
    host: HostStep

    def upload(self, device, into: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
        """-> (host.arrays' fields as device views, the uint8 buffer holding them): `device_step(pool, host, views)`
        makes the StepBatch. into: a static buffer of this signature's size (a captured graph's), refreshed in one
        copy that does not wait for the device."""
        up = Upload(self.host.arrays, device, into)
        return {k: up(v) for k, v in self.host.arrays.items()}, up.buffer

    def batch(self, device) -> StepBatch:
        """The padded StepBatch on `device`, eagerly (no static buffer)."""
        return device_step(self.pool, self.host, self.upload(device)[0])


def pad_step(
    pool: CachePool,
    shape: PrefillShape,
    token_ids: list[list[int]],
    starts: list[int],
    tables: list[dict],
    snapshots: list | None = None,
) -> PrefillInputs:
    """The step's requests (build_step's arguments, no logit rows: one a request row) padded to `shape` (module
    docstring). Raises ValueError when they do not fit it."""
    counts = [len(t) for t in token_ids]
    if not shape.holds(counts, [s + c for s, c in zip(starts, counts)]):
        raise ValueError(f"requests of {counts} tokens ending at {max(starts, default=0)}.. do not fit {shape}")
    spare, pads = shape.tokens - sum(counts), shape.slots - len(counts)
    pad_tokens: list[list[int]] = [[] for _ in range(pads)]
    if pads:
        pad_tokens[-1] = [0] * spare
    cu = np.cumsum([0] + counts + [len(t) for t in pad_tokens])
    host = host_step(
        pool,
        list(token_ids) + pad_tokens,
        list(starts) + [0] * pads,
        list(tables) + [{}] * pads,
        (cu[1:] - 1).clip(min=0).tolist(),
        list(snapshots) + [None] * pads if snapshots else None,
        widths=table_widths(pool, shape.context),
        context=shape.context,
    )
    arrays = dict(host.arrays)
    arrays["compress"] = {name: _pad_plan(pool, shape, name, plan) for name, plan in arrays["compress"].items()}
    arrays["swa_write"] = _pad_write(arrays["swa_write"], _bound(shape, pool.cfg.sliding_window), pool, "swa", shape)
    return PrefillInputs(pool, HostStep(_fresh(arrays), host.visible_at))


def signature(arrays) -> tuple:
    """(dtype, shape) of every distinct array in upload order (engine.model.batch.Upload's walk)."""
    seen: dict[int, np.ndarray] = {id(a): a for a in host_arrays(arrays)}
    return tuple((a.dtype.str, a.shape) for a in seen.values())


def _bound(shape: PrefillShape, ring_rows: int) -> int:
    """Ring writes of a step: a request row writes at most its last ring_rows positions, plus as many into a staging
    page where it keeps an in-step prefix-cache snapshot (engine.model.batch._staging_writes); every step of the
    shape is sized for the snapshots, whether it has them or not."""
    return min(shape.tokens, shape.slots * ring_rows) + shape.slots * ring_rows


def _scratch_row(pool: CachePool, group: str) -> int:
    return pool.scratch_pages[group] * pool.groups[group].spec.page_rows


def _pad_write(write: RingWrite, size: int, pool: CachePool, group: str, shape: PrefillShape) -> RingWrite:
    """`write` (host arrays) grown to `size` pairs, the extra ones chunk row T - 1 -> the group's scratch row."""
    extra = size - len(write.ring_row)
    if extra < 0:
        raise AssertionError(f"{group}: {len(write.ring_row)} ring writes exceed the bound {size}")
    return RingWrite(
        _cat(write.chunk_row, np.full(extra, shape.tokens - 1)),
        _cat(write.ring_row, np.full(extra, _scratch_row(pool, group))),
    )


def _pad_plan(pool: CachePool, shape: PrefillShape, name: str, plan: CompressPlan) -> CompressPlan:
    """`plan` grown to T // r + S entries (module docstring); its state writes to their bound."""
    (state, ratio) = next((s, r) for e, s, r, _ in entry_groups(pool.cfg) if e == name)
    size = shape.tokens // ratio + shape.slots
    extra = size - plan.num_entries
    if extra < 0:
        raise AssertionError(f"{name}: {plan.num_entries} entries exceed the bound {size}")
    state_spec = pool.groups[state].spec
    scratch_state = _scratch_row(pool, state)
    total = state_spec.num_pages * state_spec.page_rows

    def sources(src: SourceRows) -> SourceRows:
        fill = {
            "from_chunk": True,
            "chunk_row": shape.tokens - 1,
            "ring_row": scratch_state,
            "valid": True,
            "row": total + shape.tokens - 1,
        }
        return SourceRows(
            **{
                f: _cat(getattr(src, f), np.full((extra, ratio), v, dtype=np.asarray(getattr(src, f)).dtype))
                for f, v in fill.items()
            }
        )

    return replace(
        plan,
        num_entries=size,
        cur=sources(plan.cur),
        prev=None if plan.prev is None else sources(plan.prev),
        entry_row=_cat(plan.entry_row, np.full(extra, _scratch_row(pool, name))),
        entry_pos=_cat(plan.entry_pos, np.zeros(extra, dtype=np.int64)),
        state_write=_pad_write(plan.state_write, _bound(shape, state_spec.page_rows), pool, state, shape),
    )


def _cat(a, b) -> torch.Tensor:
    """Host arrays joined (typed as what they become on the device, as engine.model.batch._host_rows)."""
    a = np.asarray(a)
    return np.concatenate([a, np.asarray(b, dtype=a.dtype)])  # type: ignore[return-value]


def _fresh(obj):
    """obj with every numpy array copied: no two fields share one array object, so the upload's walk (which sends a
    shared array once) lays out every step of a shape alike."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _fresh(v) for k, v in obj.items()}
    if isinstance(obj, (SourceRows, RingWrite, CompressPlan)):
        return replace(obj, **{k: _fresh(v) for k, v in vars(obj).items()})
    return obj
