"""Prefill -> decode KV-cache transfer: a pure-Python page plan and two backends ("nixl", "tcp").

See kv_transfer.base for the request flow and page ownership rules.
"""

from engine.handoff import TransferTicket
from kv_transfer.base import TransferBackend, TransferError, TransferStats, TransferTimeout
from kv_transfer.plan import ByteRange, GroupPlan, TransferPlan, build_plan, layout_fingerprint
from kv_transfer.registry import BACKENDS, TRANSFER_CHOICES, make_backend, resolve_name

__all__ = [
    "BACKENDS",
    "ByteRange",
    "GroupPlan",
    "TRANSFER_CHOICES",
    "TransferBackend",
    "TransferError",
    "TransferPlan",
    "TransferStats",
    "TransferTicket",
    "TransferTimeout",
    "build_plan",
    "layout_fingerprint",
    "make_backend",
    "resolve_name",
]
