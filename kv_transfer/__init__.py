"""Prefill -> decode KV-cache transfer: a pure-Python page plan and two backends ("nixl", "tcp").

See kv_transfer.base for the request flow and page ownership rules. Import each name from its module
(`kv_transfer.registry`: `make_backend`, `TRANSFER_CHOICES`; `kv_transfer.plan`; `kv_transfer.outcomes`: the errors
and `TransferStats`). Nothing is imported here: the backends and the plan need torch, and processes that only read
a pull's outcome (the HTTP ingress replica: `TransferError` through decode_worker.feed_wire) must not import it.
"""
