"""Timing helpers and the two roofs measured in the same run (device copy bandwidth, bf16 matmul rate)."""

from __future__ import annotations

import time

import torch


class Clock:
    def __init__(self, budget_s: float):
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def measure_roofs(device, smoke: bool) -> tuple[float, float]:
    """-> (device copy GB/s counting read + write, bf16 matmul TFLOP/s), measured now on `device`."""
    nbytes = (1 << 24) if smoke else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    reps = 3 if smoke else 20
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    copy_gbs = 2 * nbytes * reps / (time.perf_counter() - t) / 1e9
    del src, dst
    n = 256 if smoke else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    reps = 3 if smoke else 10
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    tflops = 2 * n**3 * reps / (time.perf_counter() - t) / 1e12
    return copy_gbs, tflops

