"""How a KV pull runs on the decode side (kv_transfer.base's TransferBackend inherits it): the pull as steps (plan,
then the backend's reads), driven to the end on one thread (`pull`, `pull_deferred`) or between an event loop's
other work (`pull_async`), with each pull's own bookkeeping (`PullState`: the parts' seconds for TransferStats, the
scatter a staged pull leaves to its caller) kept per thread while one of its steps runs.

A backend supplies `_read` (one blocking step) or `_read_steps` (a generator that yields the seconds to wait between
polls: `steps_on_loop`), and reports its parts through the `_on_*` hooks; `plan_for` and `_notify` are the
backend's (kv_transfer.base).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field

from engine.handoff import TransferTicket
from kv_transfer.outcomes import PullCancelled, ReadInFlight, TransferError, TransferStats, TransferTimeout
from kv_transfer.plan import TransferPlan

# A pull's deadline ends this long before the source's lease (ticket.lease_expires_at, wall clock: covers clock skew
# between nodes and the time a cancelled READ takes to stop); the tcp server refuses to start reading pages whose
# lease ends sooner.
READ_LEASE_MARGIN_S = 5.0

# A pull as steps (TransferBackend._pull_steps): each yield is the seconds to wait before the next step (0: go on
# at once), the return value its result. Driven on one thread (`pull`) or between an event loop's other work
# (`pull_async`).
PullSteps = Generator[float, None, "tuple[TransferStats, object]"]


@dataclass
class PullState:
    """One pull's own bookkeeping: the parts' seconds (TransferStats) and the scatter it leaves to the caller."""

    defer: bool = False  # pull_deferred: a staged pull leaves its scatter to the caller
    deferred: object = None  # that scatter (kv_transfer.staging.DeferredScatter), once the bytes are here
    wire: float = 0.0
    scatter: float = 0.0
    plan: float = 0.0
    staging_wait: float = 0.0
    scatter_parts: dict = field(default_factory=dict)
    cpu: float = 0.0  # this pull's thread CPU seconds over the steps that ended
    step_cpu0: float = 0.0  # thread_time() when the current step began
    loop: asyncio.AbstractEventLoop | None = None  # pull_async's: work left for after the pull runs there


class PullClaim:
    """Runs `pull_deferred` on a worker thread and hands its deferred scatter to the caller, or cancels it (freeing
    its staging range) when the caller stopped waiting for the pull (its task was cancelled)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gone = False
        self._deferred = None

    def pull(self, backend: PullDriver, ticket: TransferTicket, pages, timeout_s: float):
        stats, deferred = backend.pull_deferred(ticket, pages, timeout_s)
        with self._lock:
            gone, self._deferred = self._gone, deferred
        if gone and deferred is not None:
            deferred.cancel()
        return stats, deferred

    def abandon(self) -> None:
        with self._lock:
            self._gone, deferred = True, self._deferred
        if deferred is not None:
            deferred.cancel()


class PullDriver:
    """The pulling half of a transfer backend (mixed into kv_transfer.base.TransferBackend)."""

    # True: the pull's waits are steps that yield (`_read_steps`), so `pull_async` runs it on the caller's event loop
    # thread; False: `_read` blocks, and `pull_async` hands the pull to a worker thread.
    steps_on_loop = False
    _wire: threading.local  # .state: the PullState of the pull whose step runs in this thread (set by the backend)

    def plan_for(self, ticket: TransferTicket, dst_pages: Mapping[str, Sequence[int]]) -> TransferPlan:
        raise NotImplementedError  # the backend's (kv_transfer.base.TransferBackend.plan_for)

    def _notify(self, ticket: TransferTicket, error: str) -> None:
        raise NotImplementedError  # the backend's: tell the source the pull failed

    def pull(
        self, ticket: TransferTicket, dst_pages: Mapping[str, Sequence[int]], timeout_s: float = 30.0
    ) -> TransferStats:
        """Copy the ticket's pages into `dst_pages` of this pool. Raises TransferError / TransferTimeout
        (destination pages then hold garbage: free them). Confirms to the source on success and on failure."""
        return self._drive(PullState(), ticket, dst_pages, timeout_s)[0]

    def pull_deferred(self, ticket: TransferTicket, dst_pages: Mapping[str, Sequence[int]], timeout_s: float = 30.0):
        """`pull`, except that a staged pull does not scatter: -> (stats, a kv_transfer.staging.DeferredScatter or
        None). The caller must `run()` it on the thread whose current stream the destination engine's steps use,
        before the first step that reads `dst_pages`, or `cancel()` it (its staging range stays held until then).
        None: the pages already hold the bytes (or their copy is queued), as after `pull`."""
        return self._drive(PullState(defer=True), ticket, dst_pages, timeout_s)

    async def pull_async(
        self, ticket: TransferTicket, dst_pages: Mapping[str, Sequence[int]], timeout_s: float = 30.0
    ) -> tuple[TransferStats, object]:
        """`pull_deferred` for a caller on an asyncio event loop. A backend whose waits are steps (`steps_on_loop`,
        NIXL) runs the pull on the loop's thread: plan and post there, then poll the READ between the loop's other
        work (no hand-off to a worker thread and back: ~0.15-0.35 ms a pull on a loaded host, BENCHMARKS.md
        kv_pull; the plan held the GIL on the worker thread anyway). Any other backend pulls on a worker thread.
        Cancelled meanwhile: the READ is cancelled, the source told, and whatever the pull held freed; the
        CancelledError propagates, unless the READ could not be cancelled and may still write the pages: then its
        ReadInFlight does (the caller keeps the pages out of use, as after a failed pull)."""
        if not self.steps_on_loop:
            claim = PullClaim()
            try:
                return await asyncio.to_thread(claim.pull, self, ticket, dst_pages, timeout_s)
            except BaseException:
                claim.abandon()  # cancelled while the thread pulls: a scatter it leaves behind frees its range
                raise
        state = PullState(defer=True, loop=asyncio.get_running_loop())
        steps = self._pull_steps(ticket, dst_pages, timeout_s, state)
        try:
            while True:
                wait = self._step(steps, state)
                await asyncio.sleep(wait)
        except StopIteration as done:
            return done.value
        except asyncio.CancelledError as cancelled:
            in_flight = self._cancel_steps(steps, state, ticket)
            if in_flight is not None:
                raise in_flight from cancelled
            raise

    def _drive(self, state: PullState, ticket: TransferTicket, dst_pages, timeout_s: float):
        """Run a pull's steps to the end on this thread, sleeping the waits they ask for -> (stats, deferred)."""
        steps = self._pull_steps(ticket, dst_pages, timeout_s, state)
        try:
            while True:
                wait = self._step(steps, state)
                if wait:
                    time.sleep(wait)
        except StopIteration as done:
            return done.value

    def _step(self, steps: PullSteps, state: PullState) -> float:
        """Run the pull's next step on this thread (its bookkeeping made this thread's) -> seconds to wait;
        StopIteration with the result at the end."""
        self._wire.state = state
        state.step_cpu0 = time.thread_time()
        try:
            return next(steps)
        finally:
            state.cpu += time.thread_time() - state.step_cpu0
            self._wire.state = None

    def _cancel_steps(self, steps: PullSteps, state: PullState, ticket: TransferTicket) -> ReadInFlight | None:
        """End a pull whose caller stopped waiting: its steps see PullCancelled where they wait (and fail as a
        failed pull does: READ cancelled, range freed, source told); a scatter already left behind is dropped.
        -> the ReadInFlight of a READ that could not be cancelled (the pages may still be written)."""
        self._wire.state = state
        try:
            steps.throw(PullCancelled(f"request {ticket.request_id!r}: the pull was cancelled"))
            steps.close()  # it waited again instead of failing: GeneratorExit ends it
        except ReadInFlight as e:
            return e
        except (StopIteration, TransferError):
            pass
        finally:
            self._wire.state = None
            if state.deferred is not None:
                state.deferred.cancel()  # type: ignore[attr-defined]
        return None

    def _pull_steps(
        self, ticket: TransferTicket, dst_pages: Mapping[str, Sequence[int]], timeout_s: float, state: PullState
    ) -> PullSteps:
        """The pull as steps (PullSteps): plan, then the backend's `_read_steps` -> (stats, deferred scatter)."""
        t0 = time.monotonic()
        # The pull ends before the source's lease on its pages may: never read pages that can be freed under it.
        lease_left = ticket.lease_expires_at - time.time() - READ_LEASE_MARGIN_S if ticket.lease_expires_at else None
        deadline = t0 + timeout_s if lease_left is None else t0 + min(timeout_s, lease_left)
        try:
            if lease_left is not None and lease_left <= 0:
                raise TransferTimeout(
                    f"request {ticket.request_id!r}: the source's lease on its pages ends within "
                    f"{READ_LEASE_MARGIN_S:g} s: too late to pull"
                )
            plan = self.plan_for(ticket, dst_pages)
            state.plan += time.monotonic() - t0
            descriptors = yield from self._read_steps(ticket, plan, deadline)
        except TransferError as e:
            self._drop_deferred(state)
            self._notify(ticket, str(e))
            raise
        except Exception as e:  # a backend's own exception (dead peer, socket error): one clear type for callers
            self._drop_deferred(state)
            err = TransferError(f"request {ticket.request_id!r} from {ticket.source!r}: {type(e).__name__}: {e}")
            self._notify(ticket, str(err))
            raise err from e
        except BaseException:
            self._drop_deferred(state)
            raise
        stats = TransferStats(
            plan.total_bytes,
            plan.num_descriptors if descriptors is None else descriptors,
            time.monotonic() - t0,
            state.wire,
            state.scatter,
            state.plan,
            state.staging_wait,
            state.cpu + time.thread_time() - state.step_cpu0,
            dict(state.scatter_parts),
        )
        return stats, state.deferred

    @staticmethod
    def _drop_deferred(state: PullState) -> None:
        if state.deferred is not None:
            state.deferred.cancel()  # type: ignore[attr-defined]
            state.deferred = None

    def _state(self) -> PullState:
        """The bookkeeping of the pull whose step runs in this thread."""
        state = getattr(self._wire, "state", None)
        if state is None:  # a hook called outside a pull's step (a backend's own use): counted nowhere
            state = PullState()
        return state

    def _defers_scatter(self) -> bool:
        """Whether the pull running in this thread leaves its scatter to the caller (pull_deferred)."""
        return self._state().defer

    def _after_pull(self, work: Callable[[], None]) -> None:
        """Run `work` (what the source needs but the pulled pages do not: its confirmation) once the pull has
        handed back: a `pull_async` on the loop, right after the caller's step that awaited it (its join and
        scatter go first); any other pull now, on its thread."""
        loop = self._state().loop
        if loop is None:
            work()
        else:
            loop.call_soon(work)

    def _on_deferred(self, deferred) -> None:
        """A staged pull hands over the scatter it left to the caller (see pull_deferred)."""
        self._state().deferred = deferred

    def _on_wire(self, seconds: float) -> None:
        """A backend's `_read` reports the time its data spent moving (TransferStats.wire_seconds)."""
        self._state().wire += seconds

    def _on_scatter(self, seconds: float, parts: Mapping[str, float] | None = None) -> None:
        """A staged pull reports its scatter's time (TransferStats.scatter_seconds) and its parts."""
        state = self._state()
        state.scatter += seconds
        for key, value in (parts or {}).items():
            state.scatter_parts[key] = state.scatter_parts.get(key, 0.0) + value

    def _on_plan(self, seconds: float) -> None:
        """A backend's `_read` reports time spent planning (a staged layout) (TransferStats.plan_seconds)."""
        self._state().plan += seconds

    def _on_staging_wait(self, seconds: float) -> None:
        """A staged pull reports the time it took to get a staging range (TransferStats.staging_wait_seconds)."""
        self._state().staging_wait += seconds

    def _read_steps(
        self, ticket: TransferTicket, plan: TransferPlan, deadline: float
    ) -> Generator[float, None, int | None]:
        """`_read` as steps: a backend that waits by polling yields the seconds to wait between polls (PullSteps;
        `steps_on_loop`) and must fail with the PullCancelled thrown in at a yield as with any error. By default
        one blocking step: `_read`."""
        return self._read(ticket, plan, deadline)
        yield 0.0  # unreachable: makes this a generator

    def _read(self, ticket: TransferTicket, plan: TransferPlan, deadline: float) -> int | None:
        """Execute `plan` from ticket.source into this pool before `deadline` (time.monotonic); on success the
        source must learn the request is done (in-band), on failure raise. Returns the descriptors it used
        (None: the plan's page ranges). A backend implements this or `_read_steps`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither _read nor _read_steps")
