"""NIXL backend: the decode agent READs the prefill agent's registered pool tensors over UCX.

Registration: every group tensor of the pool ([layers, num_pages * page_rows, width], contiguous) is registered
ONCE, whole, in the constructor; a request then needs no registration, only its plan's (address, length) lists,
so a request costs one transfer request with `plan.num_descriptors` descriptors (runs of consecutive pages per
layer; NIXL merges any that still touch).
Metadata: `metadata()` = JSON header (worker name, layout fingerprint, per-group base address / size / device,
memory type) + the NIXL agent metadata blob; the caller ships it once through Ray (an actor method result) to
the decode worker's `add_peer`, which loads it with `add_remote_agent`. Nothing pickled crosses the wire.
Completion: once the READ is DONE the decode side sends {"op": "done", "rid": ...} with `send_notif` (not as the
READ's own notification, which would keep the READ from completing until the source took it: `_confirm`; a
`pull_async` sends it on its loop right after the caller's step that awaited the pull: `PullDriver._after_pull`),
and the prefill side's `poll()` turns it into a release callback (no extra Ray call).
A failed or timed-out pull sends {"op": "fail"} with `send_notif` (best effort; the lease covers a dead decode).
Authentication: with a cluster token (the one the tcp transfer and the router require) every notification carries
it, and the prefill side ignores one that does not (any process that reaches the UCX endpoint could otherwise
release, i.e. free, another request's pages early); the data itself moves by one-sided READs of registered memory.
Memory: CPU tensors register as DRAM (UCX moves them over shared memory or TCP), CUDA tensors as VRAM.
VRAM pulls are GETs, and UCX turns cuda_ipc GETs off when it finds no NVLink (one GPU, PCIe-only nodes): the READ
then goes through host staging over cma/tcp (0.5 GB/s between two processes on one H200, BENCHMARKS.md
gpu_service). `enable_cuda_ipc_get()` sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y before the agent exists (newer NIXL
builds enable it themselves; an explicit setting in the environment wins).
Staging (default on; `staging_bytes`, env DSV4_NIXL_STAGING_BYTES, 0 = off): a READ pays ~7-8 us per
descriptor (H200, cuda_ipc), and a page plan has one per layer per group per page run (hundreds to thousands for
V4-Flash). Each backend also registers one contiguous staging buffer (kv_transfer.staging) at start-up. At
export the source gathers the request's pages into a range of it (one index_select per group) and the ticket
carries (offset, nbytes); the range is freed with the export (confirmation, failure, lease expiry, abort). The
destination READs that range as ONE descriptor into a range of its own buffer and scatters it into its pages
(one index_copy_ per group; with `pull_deferred` the caller queues that scatter on its engine's thread instead,
kv_transfer.staging says why). Byte layout: kv_transfer.plan.staged_layout. Short of staging space on either
side (or a request larger than the buffer) the pull falls back to the page descriptors, logged once per side and
counted in `staging_counts`. Default size: one request as long as the pool can hold, capped at
DEFAULT_STAGING_CAP (the buffer is outside the KV memory plan: `--max-cached-tokens` / utilisation budgets do
not include it).
Idle cost: NIXL's progress thread polls UCX in a loop with `pthrDelay` microseconds between rounds, which the
python agent hard-codes to 0: an idle worker then burns most of a core. `progress_delay_us` (default 1000,
env DSV4_NIXL_PROGRESS_DELAY_US) is set on the agent config instead: measured on a 2-core CPU host, idle
CPU of one agent 90% at 0 us, 3% at 100-1000 us, 0.6% at 10 ms. A pull still progresses at full speed: the
decode side drives its READ with check_xfer_state, and the prefill side polls its notifications.
"""

from __future__ import annotations

import functools
import hmac
import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsv4_kernels.settings import BY_NAME, NIXL_PROGRESS_DELAY_US, settings
from engine.model.cache import CachePool
from kv_transfer.base import (
    ReadInFlight,
    TransferBackend,
    TransferError,
    TransferTicket,
    TransferTimeout,
    pack_metadata,
)
from kv_transfer.outcomes import PullCancelled
from kv_transfer.plan import STAGING_ALIGN, TransferPlan, group_nbytes, staged_layout, staged_nbytes
from kv_transfer.staging import DeferredScatter, StagingBuffer

log = logging.getLogger(__name__)


def import_nixl():
    """(nixl_agent, nixl_agent_config, module) from whichever NIXL wheel is installed; ImportError if none."""
    errors = []
    for mod in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            m = __import__(mod, fromlist=["nixl_agent"])
            return m.nixl_agent, m.nixl_agent_config, m
        except ImportError as e:  # keep looking: `pip install nixl` ships one wheel per CUDA major
            errors.append(f"{mod}: {e}")
    raise ImportError(
        "no NIXL python package (pip install nixl-cu12 on CPU / CUDA 12 hosts, or start the workers "
        "with --transfer tcp): " + "; ".join(errors)
    )


_CONFIG_LOCK = threading.Lock()
DEFAULT_PROGRESS_DELAY_US = BY_NAME[NIXL_PROGRESS_DELAY_US].default  # 1000
DEFAULT_STAGING_CAP = 512 << 20
# A READ is polled without a pause for its first READ_SPIN_S (a pull's step yields 0: on an event loop one round of
# its other work between polls), then every READ_POLL_S (an event loop's timers round it up to 1 ms): the loop
# does not burn a core on a long READ, and a READ of up to a few MB (the common pull) ends without a timer's delay.
READ_SPIN_S = 5e-3
READ_POLL_S = 2e-4


def default_staging_bytes(pool: CachePool) -> int:
    """Room for one request as long as the pool can hold (its tightest growing group), capped."""
    growing = [g for g in pool.groups.values() if not g.spec.fixed]
    tokens = min((g.usable_pages * g.spec.page_rows * g.spec.tokens_per_row for g in growing), default=0)
    return min(staged_nbytes([g.spec for g in pool.groups.values()], tokens), DEFAULT_STAGING_CAP)


def _staging_option(pool: CachePool, staging_bytes) -> int:
    if staging_bytes is None:
        env = settings().nixl_staging_bytes
        staging_bytes = default_staging_bytes(pool) if env is None else env
    try:
        n = int(staging_bytes)
        if n < 0 or isinstance(staging_bytes, bool) or (isinstance(staging_bytes, float) and n != staging_bytes):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(
            f"staging_bytes must be a non-negative int of bytes (0 = no staging), got {staging_bytes!r}"
        ) from None
    if 0 < n < STAGING_ALIGN:  # the arena would hold nothing, and NIXL cannot register an empty buffer
        raise ValueError(f"staging_bytes must be 0 (no staging) or at least {STAGING_ALIGN}, got {staging_bytes!r}")
    return n


def _agent_with_delay(nixl_agent, mod, name: str, conf, delay_us: int):
    """nixl_agent(name, conf) whose progress thread sleeps delay_us between rounds. The python agent builds
    its C++ config itself and writes pthrDelay = 0; a config subclass raises that write to delay_us."""
    try:
        api = importlib.import_module(mod.__name__.split(".")[0] + "._api")
        base = api.nixlBind.nixlAgentConfig
    except (ImportError, AttributeError):  # another layout: keep NIXL's default
        return nixl_agent(name, conf)

    delayed = property(
        lambda self: base.pthrDelay.__get__(self), lambda self, v: base.pthrDelay.__set__(self, max(int(v), delay_us))
    )
    DelayedConfig = type("DelayedConfig", (base,), {"pthrDelay": delayed})  # base is found at run time
    with _CONFIG_LOCK:  # the module attribute is swapped only while this agent is built
        api.nixlBind.nixlAgentConfig = DelayedConfig
        try:
            return nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgentConfig = base


def _mem(tensor) -> tuple[str, int]:
    """(NIXL memory type, device id) of a tensor: host memory is DRAM with device id 0."""
    return ("DRAM", 0) if tensor.device.type == "cpu" else ("VRAM", tensor.device.index or 0)


def enable_cuda_ipc_get() -> None:
    """Let UCX carry GETs over cuda_ipc without NVLink (read by UCX when the agent's context is created)."""
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")


@dataclass(eq=False)
class _StuckRead:
    """A READ NIXL could not cancel: its destination (the request's pages, or a staging range) stays out of use
    until the READ is known to be over (its state left PROC and its handle released) or its peer is gone."""

    handle: Any  # NIXL's transfer handle (the library ships no types)
    source: str
    request_id: str
    staging_offset: int | None  # a staged READ's destination range; None: the pages themselves
    peer_gone: bool = False  # remove_peer tore the source's connection down: nothing lands any more


class NixlBackend(TransferBackend):
    name = "nixl"
    steps_on_loop = True  # a pull polls its READ (_xfer_steps): pull_async runs it on the caller's loop

    def __init__(
        self,
        pool: CachePool,
        worker_name: str | None = None,
        lease_s: float = 120.0,
        on_release=None,
        ucx_params: dict[str, str] | None = None,
        progress_delay_us: int | None = None,
        staging_bytes: int | None = None,
        token: str | None = None,
    ):
        super().__init__(pool, worker_name, lease_s, on_release)
        self._token = token  # the per-service token notifications carry (None: not checked)
        staging_bytes = _staging_option(pool, staging_bytes)  # bad values fail before any NIXL state exists
        if any(g.tensor.is_cuda for g in pool.groups.values()):
            enable_cuda_ipc_get()
        nixl_agent, nixl_agent_config, mod = import_nixl()
        try:  # the caller may poll() and pull() from different threads: let the agent serialise itself
            conf = nixl_agent_config(backends=[], sync_mode=mod.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        except (TypeError, AttributeError):
            conf = nixl_agent_config(backends=[])
        if progress_delay_us is None:
            progress_delay_us = settings().nixl_progress_delay_us
        self.agent = _agent_with_delay(nixl_agent, mod, self.worker_name, conf, progress_delay_us)
        # "peer" error handling: a dead peer surfaces as an error instead of a hang.
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "peer", **(ucx_params or {})})
        self._regs = []
        self._local: dict[str, tuple[int, int]] = {}  # group -> (base address, device id)
        mem_types = set()
        for name, group in pool.groups.items():
            self._regs.append(self.agent.register_memory(group.tensor))  # whole group tensor, once
            mem, dev = _mem(group.tensor)
            mem_types.add(mem)
            self._local[name] = (group.tensor.data_ptr(), dev)
        if len(mem_types) != 1:
            raise ValueError(f"pool mixes memory types {mem_types}; one transfer request needs one type")
        self.mem_type = mem_types.pop()
        self.staging = StagingBuffer(pool, staging_bytes) if staging_bytes else None
        if self.staging is not None:
            self._regs.append(self.agent.register_memory(self.staging.tensor))
        self.staging_counts = {"staged": 0, "fallback_source": 0, "fallback_destination": 0}
        self._count_lock = threading.Lock()
        self._peers: dict[str, dict] = {}  # worker -> {"mem": str, "groups": {group: (addr, nbytes, dev)}}
        self._stuck: list[_StuckRead] = []  # READs NIXL could not cancel (handles kept alive: freeing could crash)
        self._stuck_lock = threading.Lock()

    def metadata(self) -> bytes:
        groups = {n: [addr, group_nbytes(self.pool.groups[n].spec), dev] for n, (addr, dev) in self._local.items()}
        st = self.staging
        staging = None if st is None else [st.tensor.data_ptr(), st.tensor.numel(), _mem(st.tensor)[1]]
        return pack_metadata(
            self._header(mem=self.mem_type, groups=groups, staging=staging), self.agent.get_agent_metadata()
        )

    def _add_peer(self, name: str, header: dict, payload: bytes) -> None:
        loaded = self.agent.add_remote_agent(payload)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            raise TransferError(f"NIXL metadata names agent {loaded!r}, expected {name!r}")
        staging = header.get("staging")
        self._peers[name] = {
            "mem": header["mem"],
            "groups": {g: tuple(v) for g, v in header["groups"].items()},
            "staging": tuple(int(v) for v in staging) if staging else None,
        }
        try:  # optional: connect now so the first request does not pay for it
            self.agent.make_connection(name)
        except Exception as e:
            log.warning("NIXL make_connection(%s) failed (will retry on first transfer): %s", name, e)

    def _descs(self, ticket: TransferTicket, plan: TransferPlan) -> tuple[np.ndarray, np.ndarray]:
        """Nx3 (address, length, device) arrays: local (destination) and remote (source), in plan order."""
        remote_groups = self._peers[ticket.source]["groups"]
        local, remote = [], []
        for g in plan.groups:
            src_off, dst_off, length = g.range_arrays
            if not len(length):
                continue
            dst_base, dst_dev = self._local[g.name]
            src_base, src_nbytes, src_dev = remote_groups[g.name]
            beyond = np.flatnonzero(src_off + length > src_nbytes)  # would read outside the peer's registered tensor
            if len(beyond):
                r = g.ranges[int(beyond[0])]
                raise TransferError(f"group {g.name!r}: range {r} beyond source tensor ({src_nbytes} bytes)")
            local.append(np.stack([dst_base + dst_off, length, np.full_like(length, dst_dev)], axis=1))
            remote.append(np.stack([src_base + src_off, length, np.full_like(length, src_dev)], axis=1))
        if not local:
            return np.zeros((0, 3), dtype=np.uint64), np.zeros((0, 3), dtype=np.uint64)
        return np.concatenate(local).astype(np.uint64), np.concatenate(remote).astype(np.uint64)

    # ---- staging -------------------------------------------------------------------------------------
    def _count(self, key: str, detail: str = "") -> None:
        with self._count_lock:
            self.staging_counts[key] += 1
            first = self.staging_counts[key] == 1
        if detail and first:  # once per side: a full buffer under load would otherwise flood the log
            log.warning(
                "%s: %s; pulling by page descriptors (correct, slower). Counted in staging_counts; "
                "raise staging_bytes / DSV4_NIXL_STAGING_BYTES",
                self.worker_name,
                detail,
            )

    def _stage(self, request_id: str, plan: TransferPlan):
        if self.staging is None:
            return None
        layout = staged_layout(plan)
        if layout.nbytes == 0:
            return None
        offset = self.staging.alloc(layout.nbytes)
        if offset is None:
            self._count(
                "fallback_source",
                f"no {layout.nbytes}-byte staging range free for exporting "
                f"{request_id!r} ({self.staging.arena.largest_free} of {self.staging.arena.capacity} "
                "bytes contiguous free)",
            )
            return None
        try:  # a chunk's copies are only queued: its ticket waits for the export's ready event (chunk_ready)
            self.staging.gather(offset, layout, wait=plan.final)
        except BaseException:
            self.staging.arena.free(offset)
            raise
        return offset, layout.nbytes

    def _ticket_staging(self, staging) -> tuple[int, int] | None:
        return staging

    def _unstage(self, request_id: str, staging) -> None:
        self._staged().release(staging[0])

    def _staged(self) -> StagingBuffer:
        """The staging buffer, where a staged range exists (a ticket or a quarantined READ holds one)."""
        assert self.staging is not None  # ranges come from it: it exists wherever one does
        return self.staging

    # ---- decode side -------------------------------------------------------------------------------------
    def _read_steps(self, ticket: TransferTicket, plan: TransferPlan, deadline: float) -> Generator[float, None, int]:
        what = f"NIXL READ of request {ticket.request_id!r} from {ticket.source!r}"
        done = self._done_notif(ticket.request_id)
        if plan.total_bytes == 0:
            self.agent.send_notif(ticket.source, done)
            return 0
        if self.mem_type == "VRAM":  # UCX's CUDA transports copy on the posting thread: make the pool's GPU current
            import torch

            torch.cuda.set_device(next(iter(self._local.values()))[1])
        descriptors = yield from self._read_staged(ticket, plan, deadline, what)
        if descriptors is None:
            local, remote = self._descs(ticket, plan)
            yield from self._xfer_steps(ticket, local, remote, deadline, what, plan.total_bytes)
            descriptors = len(local)
        # the pages hold the bytes (or their staging range does): the source's confirmation is not on the pull's
        # path (send_notif right after a READ of megabytes took 0.05-0.08 ms on a 2-core host, its caches cold)
        self._after_pull(functools.partial(self._confirm, ticket.source, done))
        return descriptors

    def _confirm(self, source: str, done: bytes) -> None:
        """Tell the source its pages may go, once the READ is DONE (every byte landed here). Sent apart from the
        READ, not as its notification: a READ that carries one is DONE only once the source has taken the message
        (between two processes of a busy 2-core host, a 1 MB host-memory READ was DONE 0.2-6 ms after its post
        with a notification, ~0.1 ms without; send_notif returns in ~0.02 ms), and the pull need not wait. Best
        effort: the bytes are here; a source that misses it frees the pages when the lease ends."""
        try:
            self.agent.send_notif(source, done)
        except Exception as e:
            log.warning(
                "%s: could not confirm a pull to %s (its lease frees the pages): %s", self.worker_name, source, e
            )

    def _read_staged(
        self, ticket: TransferTicket, plan: TransferPlan, deadline: float, what: str
    ) -> Generator[float, None, int | None]:
        """One READ of the source's staging range into ours, then the scatter; None: use the page plan."""
        src = self._peers[ticket.source]["staging"]
        if ticket.staging is None or src is None or self.staging is None:
            return None
        t0 = time.monotonic()
        layout = staged_layout(plan)
        self._on_plan(time.monotonic() - t0)
        src_off, nbytes = ticket.staging
        if nbytes != layout.nbytes or src_off < 0 or src_off + nbytes > src[1]:
            raise TransferError(
                f"{what}: staged range {ticket.staging} does not match the plan "
                f"({layout.nbytes} bytes) or the source's staging buffer ({src[1]} bytes)"
            )
        t0 = time.monotonic()
        offset = self.staging.alloc(nbytes)
        self._on_staging_wait(time.monotonic() - t0)
        if offset is None:
            self._count(
                "fallback_destination",
                f"no {nbytes}-byte staging range free for pulling "
                f"{ticket.request_id!r} ({self.staging.arena.largest_free} of "
                f"{self.staging.arena.capacity} bytes contiguous free)",
            )
            return None
        keep, scattered = False, None
        try:
            base, dev = self.staging.tensor.data_ptr(), _mem(self.staging.tensor)[1]
            local, remote = [(base + offset, nbytes, dev)], [(src[0] + src_off, nbytes, src[2])]
            yield from self._xfer_steps(ticket, local, remote, deadline, what, nbytes, staging_offset=offset)
            if self._defers_scatter():  # pull_deferred: the caller queues it on its engine's thread (the range
                keep = True  # stays held until then)
                self._on_deferred(DeferredScatter(self.staging, offset, layout, ticket.request_id))
            else:
                t0 = time.monotonic()
                parts: dict[str, float] = {}
                # queued on this thread's current stream, the engine's (kv_transfer.staging): not waited for here
                scattered = self.staging.scatter(offset, layout, parts)
                self._on_scatter(time.monotonic() - t0, parts)
        except ReadInFlight as e:  # the READ may still land in the range: quarantined (settled() frees it)
            keep = True
            raise TransferError(str(e)) from None  # ... but not in the pages: the caller may free those
        finally:
            if not keep:
                self.staging.release(offset, scattered)  # held until the queued scatter has read it
        self._count("staged")
        return 1

    def _xfer_steps(
        self,
        ticket: TransferTicket,
        local: np.ndarray | list[tuple[int, int, int]],
        remote: np.ndarray | list[tuple[int, int, int]],
        deadline: float,
        what: str,
        nbytes: int,
        staging_offset: int | None = None,
    ) -> Generator[float, None, None]:
        """Post one READ (local <- remote: Nx3 descriptor arrays, or (address, length, device) lists) and drive it to the end, yielding the seconds to
        wait between polls (READ_SPIN_S). A READ that cannot be cancelled is quarantined with its destination
        (ReadInFlight); PullCancelled thrown in at a yield fails it as a timeout would."""
        t0 = time.monotonic()
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, self.mem_type),
            self.agent.get_xfer_descs(remote, self._peers[ticket.source]["mem"]),
            ticket.source,
        )
        error: TransferError | None = None
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                now = time.monotonic()
                if now >= deadline:
                    error = TransferTimeout(
                        f"{what}: timed out ({nbytes} bytes, {len(local)} descriptors still in flight)"
                    )
                    break
                try:
                    yield 0.0 if now - t0 < READ_SPIN_S else READ_POLL_S
                except PullCancelled as e:
                    error = e
                    break
                except GeneratorExit:  # the steps dropped unfinished: never leave the READ writing a freed range
                    error = PullCancelled(f"{what}: abandoned")
                    break
                state = self.agent.check_xfer_state(handle)
            if error is None and state != "DONE":
                error = TransferError(f"{what}: NIXL reported {state}")
            self._on_wire(time.monotonic() - t0)
        except TransferError:
            raise
        except Exception as e:  # nixlRemoteDisconnectError & co: the source worker is gone
            error = TransferError(f"{what}: {type(e).__name__}: {e}")
        try:
            handle.release()  # cancels the READ if it is still in flight
        except Exception as e:
            with self._stuck_lock:
                self._stuck.append(_StuckRead(handle, ticket.source, ticket.request_id, staging_offset))
            msg = (
                f"{what}: could not cancel the READ ({e}); its destination stays out of use until the READ is "
                f"over or {ticket.source!r} is gone"
            )
            error = ReadInFlight(f"{error}; {msg}" if error else msg, ticket.request_id)
        if error is not None:
            raise error

    def _notify(self, ticket: TransferTicket, error: str) -> None:
        if ticket.source not in self._peers:
            return
        try:
            self.agent.send_notif(ticket.source, self._notif("fail", ticket.request_id, error=error))
        except Exception as e:  # a dead source cannot be told; its pages die with it
            log.info("could not report failed pull of %s to %s: %s", ticket.request_id, ticket.source, e)

    def _done_notif(self, request_id: str) -> bytes:
        """`_notif("done", request_id)`, the same bytes, without a dict and a whole json.dumps a pull."""
        tail = f', "token": {json.dumps(self._token)}}}' if self._token else "}"
        return f'{{"op": "done", "rid": {json.dumps(request_id)}{tail}'.encode()

    def _notif(self, op: str, request_id: str, **extra) -> bytes:
        token = {"token": self._token} if self._token else {}
        return json.dumps({"op": op, "rid": request_id, **extra, **token}).encode()

    def _confirmations(self) -> list[tuple[str, str | None]]:
        out = []
        for peer, msgs in self.agent.get_new_notifs().items():
            for m in msgs:
                try:
                    d = json.loads(m)
                    if self._token and not hmac.compare_digest(str(d.get("token", "")).encode(), self._token.encode()):
                        log.warning(
                            "%s: ignored a NIXL notification from %s without the cluster token", self.worker_name, peer
                        )
                        continue
                    out.append(
                        (
                            str(d["rid"]),
                            None
                            if d["op"] == "done"
                            else f"decode worker {peer!r} failed the transfer: {d.get('error', '?')}",
                        )
                    )
                except (ValueError, KeyError, TypeError, AttributeError):
                    log.warning("ignoring malformed NIXL notification from %s: %r", peer, m[:100])
        return out

    def _settled_reads(self) -> list[str]:
        """Quarantined READs now over (or from a peer that is gone): staging ranges freed here; -> the request ids
        of those that wrote pages (the caller frees them)."""
        with self._stuck_lock:
            over = [s for s in self._stuck if self._read_over(s)]
            self._stuck = [s for s in self._stuck if s not in over]
        for s in over:
            if s.staging_offset is not None:
                self._staged().release(s.staging_offset)
        return [s.request_id for s in over if s.staging_offset is None]

    def _read_over(self, s: _StuckRead) -> bool:
        if s.peer_gone:
            return True
        try:
            if self.agent.check_xfer_state(s.handle) == "PROC":
                return False
            s.handle.release()
            return True
        except Exception:  # still not releasable: keep it quarantined, look again later
            return False

    def remove_peer(self, name: str) -> None:
        super().remove_peer(name)
        if self._peers.pop(name, None) is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception as e:
                log.info("NIXL remove_remote_agent(%s): %s", name, e)
            with self._stuck_lock:
                for s in self._stuck:
                    s.peer_gone = s.peer_gone or s.source == name

    def close(self) -> None:
        super().close()
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs.clear()
