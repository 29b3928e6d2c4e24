"""The `--transfer` choices and the backend factory: the one list every CLI and builder reads."""

from __future__ import annotations

import importlib

from engine.model.cache import CachePool
from kv_transfer.base import TransferBackend
from kv_transfer.node_address import node_address

# "tcp" is the dependency-free fallback: stdlib sockets work between any two hosts (unlike shared memory) and
# need nothing beyond Python, which is also why it is the reference the NIXL results are compared against.
BACKENDS = {"nixl": "kv_transfer.nixl_backend:NixlBackend", "tcp": "kv_transfer.tcp_backend:TcpBackend"}
TRANSFER_CHOICES = ("auto", *sorted(BACKENDS))  # what `--transfer` accepts everywhere
TRANSFER_HELP = "KV-cache transfer backend between prefill and decode workers (auto: nixl when installed, else tcp)"


def nixl_available() -> bool:
    from kv_transfer.nixl_backend import import_nixl

    try:
        import_nixl()
        return True
    except ImportError:
        return False


def resolve_name(name: str) -> str:
    """'auto' -> 'nixl' when a nixl package imports, else 'tcp'."""
    if name == "auto":
        return "nixl" if nixl_available() else "tcp"
    if name not in BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {list(TRANSFER_CHOICES)}")
    return name


def network_options(name: str, host: str | None = None, token: str | None = None) -> dict:
    """The listener address and cluster token for backends that run their own listener (tcp); NIXL gets the
    token only (its notifications carry it). NIXL's UCX endpoints are set through UCX's environment
    (UCX_NET_DEVICES, UCX_TLS) instead."""
    if resolve_name(name) != "tcp":
        return {"token": token} if token else {}
    if host == "node":
        host = node_address()
    return {k: v for k, v in (("host", host), ("token", token)) if v}


def make_backend(name: str, pool: CachePool, **kwargs) -> TransferBackend:
    """make_backend('nixl' | 'tcp' | 'auto', pool, worker_name=..., lease_s=..., on_release=..., <backend opts>)."""
    module, cls = BACKENDS[resolve_name(name)].split(":")
    return getattr(importlib.import_module(module), cls)(pool, **kwargs)
