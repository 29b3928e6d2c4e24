"""Prefill -> decode KV-cache transfer: a pure-Python page plan and two backends ("nixl", "tcp").

See kv_transfer.base for the request flow and page ownership rules.
"""

from kv_transfer.base import (BACKENDS, TransferBackend, TransferError, TransferStats, TransferTicket,
                              TransferTimeout, add_cli_args, make_backend, resolve_name)
from kv_transfer.plan import ByteRange, GroupPlan, TransferPlan, build_plan, layout_fingerprint

__all__ = ["BACKENDS", "ByteRange", "GroupPlan", "TransferBackend", "TransferError", "TransferPlan",
           "TransferStats", "TransferTicket", "TransferTimeout", "add_cli_args", "build_plan", "layout_fingerprint",
           "make_backend", "resolve_name"]
