"""What a KV pull reports: its stats and its errors, and the metadata blob two backends exchange to pair up
(kv_transfer.base re-exports every name here: callers import them from there)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field


class TransferError(RuntimeError):
    """A transfer failed: the request must fail (or be recomputed); its pages are freed on both sides."""


class TransferTimeout(TransferError):
    """A transfer did not finish before its deadline."""


class ReadInFlight(TransferError):
    """A failed pull whose READ could not be cancelled: the destination pages may still be written. The caller must
    keep them out of use (never free them) until `TransferBackend.settled()` names the request: the READ is known
    to be over, or its peer is gone."""

    def __init__(self, message: str, request_id: str):
        super().__init__(message)
        self.request_id = request_id

    def __reduce__(self):
        return type(self), (str(self), self.request_id)


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    descriptors: int
    seconds: float  # the whole pull in the calling thread: plan, data movement, scatter, confirmation
    wire_seconds: float = 0.0  # the data movement alone (NIXL: each READ from post to DONE; TCP: the socket reads)
    scatter_seconds: float = 0.0  # a staged pull's scatter into the pool's pages (NIXL staging; on CUDA: queueing it;
    # 0 when the pull left it to the caller: pull_deferred)
    plan_seconds: float = 0.0  # building the page plan (and a staged pull's layout)
    staging_wait_seconds: float = 0.0  # a staged pull getting its destination staging range (reclaiming, or waiting
    # for the queued scatters that hold ranges)
    cpu_seconds: float = 0.0  # the calling thread's CPU time over the pull: far below `seconds` = waits off the CPU
    # (the data movement's sleeps, the GIL)
    scatter_parts: dict = field(default_factory=dict, hash=False)  # StagingBuffer.scatter's timings (staging.py)


class PullCancelled(TransferError):
    """Thrown into a pull's steps when its caller stopped waiting (its task was cancelled): the READ is cancelled
    and whatever the pull held is freed, as for any failed pull."""


def pack_metadata(header: dict, payload: bytes = b"") -> bytes:
    """A JSON header (never pickle: metadata comes from the network) followed by an opaque payload."""
    h = json.dumps(header).encode()
    return struct.pack("<I", len(h)) + h + payload


def unpack_metadata(blob: bytes) -> tuple[dict, bytes]:
    try:
        (n,) = struct.unpack_from("<I", blob)
        return json.loads(blob[4 : 4 + n]), blob[4 + n :]
    except (struct.error, ValueError) as e:
        raise TransferError(f"malformed transfer metadata ({len(blob)} bytes): {e}") from e
