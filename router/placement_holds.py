"""A router's own count of the requests it placed but cannot yet see in the workers' reports (the `Place` path).

Why: on the service's path the router places a request and never sees its stream (service.direct_path), so its
admission counts what the decode workers report holding (PolicyConfig.reported_load). A request only shows in a
decode worker's report once it reached that worker (prefill done, pages reserved for the pull), which can take
seconds. Until then the router holds the placement itself (slot, KV reservation, pending prefill); the stream's
owner says when the request has reached its decode worker, or failed before it (`Settle`), and the first health
probe that *started* after that releases the hold: its report counts the request from then on. A hold whose
settle never comes (the owner died) is released after `max_hold_s` (the transfer lease's length: by then the
prefill worker has dropped the export too). Between a settle and that probe the request is counted twice
(conservative); the decode worker's own DecodeOverloaded check is the backstop where several routers placed at
once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_HOLD_S = 120.0


@dataclass
class _Hold:
    placed_at: float
    release: Callable[[], None]
    settled_at: float | None = None


class PlacementHolds:
    """Holds by request id (each placement's own id: a retry or migration is a new placement)."""

    def __init__(self, max_hold_s: float = DEFAULT_MAX_HOLD_S):
        if max_hold_s <= 0:
            raise ValueError(f"max_hold_s must be > 0, got {max_hold_s}")
        self.max_hold_s = max_hold_s
        self._holds: dict[str, _Hold] = {}

    def __len__(self) -> int:
        return len(self._holds)

    def add(self, request_id: str, release: Callable[[], None], now: float) -> None:
        """Hold a placement; `release` undoes its admission counts (called exactly once)."""
        old = self._holds.pop(request_id, None)
        if old is not None:  # the same id placed again: the earlier placement is over
            old.release()
        self._holds[request_id] = _Hold(now, release)

    def settle(self, request_id: str, now: float) -> bool:
        """The request reached its decode worker (or failed before it); -> whether it was held here."""
        hold = self._holds.get(request_id)
        if hold is None:
            return False
        if hold.settled_at is None:
            hold.settled_at = now
        return True

    def release_covered(self, probe_started: float, now: float) -> int:
        """A health probe that started at probe_started answered: release the holds its reports cover, and those
        older than max_hold_s; -> how many were released."""
        done = [
            rid
            for rid, h in self._holds.items()
            if (h.settled_at is not None and h.settled_at <= probe_started) or now - h.placed_at > self.max_hold_s
        ]
        for rid in done:
            self._holds.pop(rid).release()
        return len(done)
