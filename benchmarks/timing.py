"""The one timing module of the benchmarks: medians, CUDA-event / CUDA-graph device time, and the ceilings
measured in the same run (device copy bandwidth, bf16 matmul rate) that results are read against.

Every figure is a median (a noisy neighbour or a clock change moves a mean; it moves a median less).
On CUDA `bench` is triton's do_bench (L2 flushed before each call, so operands come from HBM; the wrapper's
Python launch overhead included, as eager use pays it); `bench_graph` subtracts the flush inside a CUDA graph
(device time without launch overhead, what a graph-captured decode pays). On the CPU (smoke runs) both fall back
to wall-clock medians.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

COPY_BYTES = 1 << 30  # the copy roof: read + write of 1 GiB
MATMUL_N = 8192  # the matmul roof: bf16 8192^3
FLUSH_BYTES = 256 << 20  # larger than any Hopper L2


class Clock:
    """Wall time against a budget (a benchmark run that must end before its machine is taken back)."""

    def __init__(self, budget_s: float):
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


def median(xs):
    """Median of a sequence (the mean of the middle two for an even count)."""
    return statistics.median(xs)


def bench(fn: Callable[[], object], device="cuda", warmup: int = 10, rep: int = 50) -> float:
    """Median microseconds of fn; on CUDA with a flushed L2 (triton's do_bench, `rep` ms of calls)."""
    if is_cuda(device):
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times) * 1e6


def bench_cudagraph(fn: Callable[[], object], rep: int = 20) -> float:
    """Median microseconds of fn replayed in CUDA graphs (triton's do_bench_cudagraph; L2 not flushed)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def _event_median_ms(graph, runs: int = 9) -> float:
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def bench_graph(fn: Callable[[], object], reps: int = 10) -> float:
    """Median microseconds of one fn call replayed in a CUDA graph, each call after an L2 flush.

    Captures `reps` x (flush, fn) and `reps` x flush alone, and reports the difference per call: the
    kernels' device time with cold L2 and no Python launch overhead (what a graph-captured decode pays).
    """
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles, allocator) outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        graphs.append(g)
    for g in graphs:
        _event_median_ms(g)
    full, base = (_event_median_ms(g) for g in graphs)
    del graphs, flush
    return max(0.0, (full - base) / reps * 1e3)


def try_bench_graph(fn: Callable[[], object], reps: int = 10) -> float | None:
    """bench_graph, or None (with the reason on stderr) when fn cannot be captured (a host sync inside)."""
    try:
        return bench_graph(fn, reps)
    except RuntimeError as exc:
        print(f"  (graph capture failed: {str(exc).splitlines()[0][:120]})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def copy_gbps(device="cuda", nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth, (read + write) bytes / median time."""
    n = nbytes or (COPY_BYTES if is_cuda(device) else 1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src), device)
    return 2 * n / us / 1e3


def matmul_tflops(device="cuda", n: int | None = None) -> float:
    """bf16 n x n x n matmul rate, TFLOP/s."""
    n = n or (MATMUL_N if is_cuda(device) else 256)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    us = bench(lambda: a @ b, device)
    return 2 * n**3 / us / 1e6


def measure_roofs(device="cuda", smoke: bool = False) -> tuple[float, float]:
    """-> (device copy GB/s counting read + write, bf16 matmul TFLOP/s), measured now on `device`."""
    if smoke:
        return copy_gbps(device, 1 << 24), matmul_tflops(device, 256)
    return copy_gbps(device), matmul_tflops(device)
