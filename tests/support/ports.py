"""Free loopback ports for tests that start Ray / Serve / metrics servers (service.ray_cluster.free_port)."""

from __future__ import annotations

from service.ray_cluster import free_port

__all__ = ["free_port"]
