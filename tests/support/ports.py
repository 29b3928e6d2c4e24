"""Free loopback ports for tests that start Ray / Serve / metrics servers (service.ray_cluster.free_port)."""

from __future__ import annotations

from service.ray_cluster import free_port

__all__ = ["free_port", "free_ports"]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports (free_port draws at random, so two draws can name the same port: a test that passes
    several to one process, e.g. `ray start`'s component ports, must not hand it the same one twice)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports
