"""`node_address`: this host's address on the cluster network, where a listener binds for the "node" host.

Every internal listener of a multi-node service binds there (the tcp backend, the router's gRPC server, the metrics
server, an ingress replica's token feed listener). Apart from kv_transfer.registry, whose backends import torch,
because the HTTP ingress replica binds its listener with it and must not import torch.
"""

from __future__ import annotations

import socket


def node_address() -> str:
    """This host's address on the cluster network: the source address of the default route (a UDP connect
    sends nothing), as Ray finds its node IP; the hostname's address if there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
