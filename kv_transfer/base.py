"""KV-transfer backend protocol, shared bookkeeping, and the `--transfer` registry.

Flow of one request (decode PULLS, as in vLLM's NIXL connector):
  prefill worker                                   decode worker
  backend.metadata() ---- once, through Ray ---->  backend.add_peer(name, metadata)
  ticket = backend.export(rid, table, n) -- Ray -> table, stats = backend.receive(ticket, timeout_s)
                                                   (or pull(ticket, dst_pages, timeout_s) into its own pages)
  backend.poll()  <---- in-band "done"/"fail" ---- (sent by pull itself, after the last byte landed / on error)
    -> on_release(rid, error) callbacks: the prefill caller frees the request's pages there.
Pool tensors are registered ONCE, in the constructor; per request only a small ticket and a plan travel.

Page ownership: backends never allocate or free pages. The prefill side keeps an exported request's pages until
its release callback fires: on decode's confirmation, on decode's failure report, or when the lease
(`lease_s`, default 120 s) runs out because the decode side vanished. `poll()` runs the callbacks in the CALLER's
thread, since `engine.model.allocator` is not thread-safe. On the decode side a failed `pull` raises
TransferError / TransferTimeout and the caller frees the destination pages (`receive` does it itself), except
after `ReadInFlight`: a READ that could not be cancelled may still write them, so they stay out of use until
`settled()` names the request (a staged pull's READ lands in the staging buffer: that range is held the same way,
inside the backend, and the pages are free to go).
Staging (NIXL): a backend may also pack the request's bytes at export (`_stage`, e.g. into a registered staging
buffer, kv_transfer.staging); whatever it holds is freed (`_unstage`) when the export is released, by the same
events as the pages, and the ticket tells the decode side where the packed bytes are (`TransferTicket.staging`).
The decode side's last step of such a pull, the scatter of the staged bytes into the pages, can be left to the
caller (`pull_deferred`): the decode worker runs it on its engine's thread (kv_transfer.staging says why).
Streaming: while a request is still being prefilled, `export_chunk` offers the pages its finished chunks filled
(kv_transfer.plan), each chunk an export of its own (`chunk_id`) with its lease and staging; the decode side pulls
a chunk ticket like any other (`pull`), and the final `export(..., start_tokens=...)` moves only the rest. On CUDA
a chunk's staging copies are only queued, and its ticket may leave once `chunk_ready` says the device work that
writes its bytes (the step, the copies) has completed. A chunk's
release (its pull's confirmation, its lease, or the request's `release`, which takes the request's chunks with it)
frees what was staged for it and fires no release callback: the pages stay the request's until the final export's
release (or the caller's abort of a request that never got one).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.handoff import TransferTicket
from engine.model.cache import CacheGroupSpec, CachePool
from kv_transfer.outcomes import (
    ReadInFlight,
    TransferError,
    TransferStats,
    TransferTimeout,
    pack_metadata,  # noqa: F401  (re-exported: callers import it from here)
    unpack_metadata,
)
from kv_transfer.plan import TransferPlan, build_plan, layout_fingerprint
from kv_transfer.pull_driver import READ_LEASE_MARGIN_S, PullDriver, PullSteps  # noqa: F401  (PullSteps re-exported)

ABORTED = "aborted"  # release(rid, ABORTED): the request was cancelled (the caller withdrew the export)
LEASE_EXPIRED = "transfer lease expired"  # how every lease-expiry release error begins


def attached_backend(backend: object, owner: str) -> TransferBackend:
    """A worker's `backend` as the TransferBackend it is; a RuntimeError naming `owner` while none is attached (only
    a worker's first engine steps run that early)."""
    if not isinstance(backend, TransferBackend):
        raise RuntimeError(f"{owner}: no transfer backend attached yet")
    return backend


def release_kind(error: str | None) -> str:
    """What ended an export, from its release error: "done", "aborted", "lease_expired" or "failed" (a failure the
    pulling side reported, and counted)."""
    if error is None:
        return "done"
    if error == ABORTED:
        return "aborted"
    return "lease_expired" if error.startswith(LEASE_EXPIRED) else "failed"


ReleaseCallback = Callable[[str, "str | None"], None]  # (request_id, error or None on success)


@dataclass
class _Export:
    table: dict[str, list[int]]
    num_tokens: int
    deadline: float
    staging: object = None  # what the backend's _stage returned (released with the export)
    readers: int = 0  # reads of its pages in progress (tcp server): no expiry, no freeing meanwhile
    pending: tuple | None = None  # (error,) of a release that waits for the reads to end
    chunk_of: str | None = None  # a streamed chunk: the request it belongs to (export_chunk)
    ready: torch.cuda.Event | None = (
        None  # a chunk's CUDA event: its bytes are written once it completed (None: already)
    )


class TransferBackend(PullDriver, ABC):
    """Common half of every backend: exports, leases, release callbacks, plan building; the pull's steps and error
    mapping are kv_transfer.pull_driver's."""

    name = "?"

    def __init__(
        self,
        pool: CachePool,
        worker_name: str | None = None,
        lease_s: float = 120.0,
        on_release: ReleaseCallback | None = None,
    ):
        self.pool = pool
        self.worker_name = worker_name or f"kvx-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # this process's backend (a restarted worker keeps its name but not this): tickets and metadata carry it
        self.instance = uuid.uuid4().hex[:16]
        self._peer_instances: dict[str, str] = {}  # peer name -> the instance its metadata described
        self.specs: list[CacheGroupSpec] = [g.spec for g in pool.groups.values()]
        self.fingerprint = layout_fingerprint(self.specs)
        self.lease_s = lease_s
        self._callbacks: list[ReleaseCallback] = [on_release] if on_release else []
        self._receive_quarantine: dict[str, dict[str, list[int]]] = {}  # receive()'s pages behind a ReadInFlight
        self._exports: dict[str, _Export] = {}
        self._lock = threading.Lock()  # _exports is read by server threads (tcp)
        self._peer_specs: dict[str, list[CacheGroupSpec]] = {}
        self._wire = threading.local()  # .state: the PullState of the pull whose step runs in this thread
        for g in pool.groups.values():
            if not g.tensor.is_contiguous():
                raise ValueError(f"cache group {g.spec.name!r} tensor is not contiguous")

    # ---- handshake -------------------------------------------------------------------------------------
    @abstractmethod
    def metadata(self) -> bytes:
        """Everything a peer needs to pull from this worker (send it once, e.g. as a Ray actor method result)."""

    def add_peer(self, name: str, metadata: bytes) -> None:
        header, payload = unpack_metadata(metadata)
        if header.get("backend") != self.name:
            raise TransferError(
                f"peer {name!r} speaks transfer backend {header.get('backend')!r}, "
                f"this worker {self.name!r}: start both sides with the same --transfer"
            )
        if header.get("worker") != name:
            raise TransferError(f"metadata is for worker {header.get('worker')!r}, not {name!r}")
        if header.get("fingerprint") != self.fingerprint:
            raise TransferError(
                f"peer {name!r} cache layout {header.get('fingerprint')} != ours {self.fingerprint}: "
                "model config, cache dtype and page sizes must match on both sides"
            )
        sizes = header["num_pages"]
        # Same layout (fingerprint) but the peer's pool may hold a different number of pages.
        self._peer_specs[name] = [_with_pages(s, sizes[s.name]) for s in self.specs]
        self._peer_instances[name] = str(header.get("instance", ""))
        self._add_peer(name, header, payload)

    def knows(self, ticket: TransferTicket) -> bool:
        """Can this worker pull `ticket` with the metadata it holds? Its source was introduced, and (when the ticket
        names it) by the instance that exported it: after the source restarted, metadata learnt before describes
        the dead process (a TCP pull would connect to a closed port), so the pair must be introduced again."""
        if ticket.source not in self._peer_specs:
            return False
        return not ticket.source_instance or ticket.source_instance == self._peer_instances.get(ticket.source)

    @abstractmethod
    def _add_peer(self, name: str, header: dict, payload: bytes) -> None: ...

    def _header(self, **extra) -> dict:
        return {
            "backend": self.name,
            "worker": self.worker_name,
            "fingerprint": self.fingerprint,
            "instance": self.instance,
            "num_pages": {s.name: s.num_pages for s in self.specs},
            **extra,
        }

    # ---- prefill side ----------------------------------------------------------------------------------
    def export(
        self, request_id: str, pages: Mapping[str, Sequence[int]], num_tokens: int, start_tokens: int = 0
    ) -> TransferTicket:
        """Offer a finished prefill's pages for pulling. The caller keeps them until the release callback.
        start_tokens: the request streamed chunks (`export_chunk`) up to there; the ticket moves only the rest."""
        plan = build_plan(self.specs, pages, pages, num_tokens, start_tokens=start_tokens)  # validates the table
        return self._export(request_id, plan, None)

    def export_chunk(
        self, request_id: str, pages: Mapping[str, Sequence[int]], num_tokens: int, start_tokens: int
    ) -> TransferTicket | None:
        """Streaming: offer the pages positions [start_tokens, num_tokens) of a request still being prefilled have
        filled completely (kv_transfer.plan). None when they fill no new page. The chunk is an export of its own
        (id `chunk_id(request_id, start_tokens)`: the ticket's request_id), with its lease and staging, released by
        the decode side's confirmation of its pull, by its lease, or with the request (`release(request_id)`); its
        release frees what the backend staged for it and never fires the release callbacks: the pages stay the
        request's (the final `export(..., start_tokens=...)` hands them over)."""
        plan = build_plan(self.specs, pages, pages, num_tokens, start_tokens=start_tokens, final=False)
        if plan.total_bytes == 0:
            return None
        ticket = self._export(chunk_id(request_id, start_tokens), plan, request_id)
        ready = _stream_event(self.pool)  # after the step that wrote the pages and the staging copies
        with self._lock:
            export = self._exports.get(ticket.request_id)
            if export is not None:
                export.ready = ready
        return ticket

    def chunk_ready(self, ticket: TransferTicket, wait: bool = False) -> bool:
        """Whether a chunk ticket may leave: the device work that writes its bytes (the prefill step, and the
        staging copies, which `export_chunk` only queues on CUDA so the engine thread does not wait for the device
        each step) has completed; wait=True blocks until it has. Always True on the CPU, and for a chunk already
        released (its pull would fail: not exported)."""
        with self._lock:
            export = self._exports.get(ticket.request_id)
            ready = None if export is None else export.ready
        if ready is None:
            return True
        if wait:
            ready.synchronize()
            return True
        return bool(ready.query())

    def _export(self, key: str, plan: TransferPlan, chunk_of: str | None) -> TransferTicket:
        moved = {g.name: list(g.src_ids) for g in plan.groups}
        export = _Export(moved, plan.num_tokens, time.monotonic() + self.lease_s, chunk_of=chunk_of)
        with self._lock:
            if key in self._exports:
                raise ValueError(f"request {key!r} is already exported by {self.worker_name}")
            self._exports[key] = export
        try:  # held under the export's lease: released (freed) with it, whatever ends the export
            staging = self._stage(key, plan)
        except BaseException:
            with self._lock:
                self._exports.pop(key, None)
            raise
        with self._lock:
            alive = self._exports.get(key) is export
            if alive:
                export.staging = staging
        if not alive and staging is not None:  # released by another thread while staging: free it here
            self._unstage(key, staging)
        src = tuple((g.name, g.src_ids) for g in plan.groups)  # the moved pages only
        return TransferTicket(
            source=self.worker_name,
            request_id=key,
            src_pages=src,
            num_tokens=plan.num_tokens,
            fingerprint=self.fingerprint,
            staging=self._ticket_staging(export.staging),
            lease_expires_at=time.time() + self.lease_s,
            start_tokens=plan.start_tokens,
            final=plan.final,
            source_instance=self.instance,
        )

    def _stage(self, request_id: str, plan: TransferPlan):
        """Backend hook at export: pack the request's bytes somewhere cheaper to pull; None = pull the pages."""
        return None

    def _ticket_staging(self, staging) -> tuple[int, int] | None:
        """What the ticket says of `_stage`'s result (the decode side reads it)."""
        return None

    def _unstage(self, request_id: str, staging) -> None:
        """Backend hook when an export ends (confirmed, failed, expired, aborted): free what _stage held."""
        return None  # an optional hook (not abstract): by default there is nothing to free

    def add_release_callback(self, cb: ReleaseCallback) -> None:
        self._callbacks.append(cb)

    def release(self, request_id: str, error: str | None = None) -> bool:
        """Mark an export done (error None) or failed; fires the callbacks, which free the pages. Frees nothing.
        A request's streamed chunks still exported are released with it (their callbacks are not fired).
        -> whether it was released now: False when unknown (already released) or while a read of its pages is in
        progress (then it is released by the first `poll` after the read ends; `exported()` still lists it)."""
        with self._lock:
            chunks = [k for k, e in self._exports.items() if e.chunk_of == request_id]
        for key in chunks:
            self._release_one(key, error)
        return self._release_one(request_id, error)

    def _release_one(self, request_id: str, error: str | None) -> bool:
        with self._lock:
            export = self._exports.get(request_id)
            if export is not None and export.readers:
                export.pending = (error,)
                return False
            self._exports.pop(request_id, None)
        if export is None:
            return False  # already released (duplicate confirmation, lease expiry race)
        if export.staging is not None:
            self._unstage(request_id, export.staging)
        if export.chunk_of is None:  # a chunk's pages stay the request's
            for cb in self._callbacks:
                cb(request_id, error)
        return True

    def poll(self) -> list[tuple[str, str | None]]:
        """Apply the decode side's confirmations and expired leases; returns the released (request_id, error)."""
        events = list(self._confirmations())
        now = time.monotonic()
        with self._lock:  # a release that waited for a read first; a lease never ends under a read
            events += [(rid, e.pending[0]) for rid, e in self._exports.items() if e.pending and not e.readers]
            expired = [rid for rid, e in self._exports.items() if e.deadline <= now and not e.readers and not e.pending]
        events += [
            (rid, f"{LEASE_EXPIRED} after {self.lease_s:g} s without confirmation from the decode side")
            for rid in expired
        ]
        return [(rid, err) for rid, err in events if self.release(rid, err)]

    def _begin_read(self, request_id: str) -> _Export | None:
        """Pin an export for a read of its pages by this side (the tcp server): None when it is unknown, released,
        or its lease ends within READ_LEASE_MARGIN_S. A pinned export neither expires nor is freed until
        `_end_read` (a release meanwhile waits), so the pages cannot be reused under the read."""
        with self._lock:
            e = self._exports.get(request_id)
            if e is None or e.pending is not None or e.deadline - time.monotonic() < READ_LEASE_MARGIN_S:
                return None
            e.readers += 1
            return e

    def _end_read(self, request_id: str) -> None:
        with self._lock:
            e = self._exports.get(request_id)
            if e is not None:
                e.readers -= 1

    def exported(self) -> list[str]:
        with self._lock:
            return list(self._exports)

    @abstractmethod
    def _confirmations(self) -> list[tuple[str, str | None]]:
        """New (request_id, error) reports from decode sides since the last call."""

    # ---- decode side -----------------------------------------------------------------------------------
    def plan_for(self, ticket: TransferTicket, dst_pages: Mapping[str, Sequence[int]]) -> TransferPlan:
        if ticket.source not in self._peer_specs:
            raise TransferError(
                f"request {ticket.request_id!r}: source worker {ticket.source!r} is unknown to "
                f"{self.worker_name} (add_peer was never called, or the peer was removed)"
            )
        if ticket.fingerprint != self.fingerprint:
            raise TransferError(
                f"request {ticket.request_id!r}: source layout {ticket.fingerprint} != destination "
                f"layout {self.fingerprint}"
            )
        try:
            return build_plan(
                self._peer_specs[ticket.source],
                dict(ticket.src_pages),  # tuples: checked without a copy (page_table() lists them)
                dst_pages,
                ticket.num_tokens,
                dst_specs=self.specs,
                start_tokens=ticket.start_tokens,
                final=ticket.final,
                src_moved=True,
            )
        except ValueError as e:
            raise TransferError(f"request {ticket.request_id!r}: {e}") from e

    def receive(self, ticket: TransferTicket, timeout_s: float = 30.0) -> tuple[dict[str, list[int]], TransferStats]:
        """Allocate destination pages for the ticket, pull into them, free them again if the pull fails."""
        table: dict[str, list[int]] = {}
        self.pool.grow(table, ticket.num_tokens)  # raises OutOfPages: nothing was allocated
        try:
            return table, self.pull(ticket, table, timeout_s)
        except ReadInFlight:
            self._receive_quarantine[ticket.request_id] = table  # freed by settled() once the READ is over
            raise
        except BaseException:
            self.pool.free(table)
            raise

    def settled(self) -> list[str]:
        """Requests whose uncancelled READ (ReadInFlight) is now over or whose peer is gone: their destination
        pages may be reused (those `receive` allocated are freed here). Call it regularly (cheap when idle)."""
        over = self._settled_reads()
        for rid in over:
            table = self._receive_quarantine.pop(rid, None)
            if table is not None:
                self.pool.free(table)
        return over

    def _settled_reads(self) -> list[str]:
        """Backend hook: request ids of quarantined READs that are over (a backend without READs has none)."""
        return []

    @abstractmethod
    def _notify(self, ticket: TransferTicket, error: str) -> None:
        """Best effort: tell the source the pull failed, so it frees its pages before the lease runs out."""

    def remove_peer(self, name: str) -> None:
        """Forget a peer (e.g. its worker died); later pulls from it fail at once."""
        self._peer_specs.pop(name, None)
        self._peer_instances.pop(name, None)

    def close(self) -> None:
        """Release network resources and forget peers; pool tensors stay valid."""
        for name in list(self._peer_specs):
            self.remove_peer(name)


def _stream_event(pool: CachePool) -> torch.cuda.Event | None:
    """A CUDA event recorded now on the current stream of the pool's device; None for a CPU pool (done)."""
    tensor = next(iter(pool.groups.values())).tensor
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def chunk_id(request_id: str, start_tokens: int) -> str:
    """The export id of a request's streamed chunk that starts at position start_tokens."""
    return f"{request_id}#chunk@{start_tokens}"


def _with_pages(spec: CacheGroupSpec, num_pages: int) -> CacheGroupSpec:
    return CacheGroupSpec(
        spec.name, spec.layers, spec.page_rows, spec.width, spec.dtype, spec.tokens_per_row, int(num_pages)
    )


def check_deadline(deadline: float, what: str) -> float:
    """Seconds left before `deadline`; raises TransferTimeout naming `what` when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"{what}: timed out")
    return left
