"""The BENCHMARKS.md sections built from GPU runs' outputs (the runs themselves need a GPU): the decode A/B table
(benchmarks/slice/ab.py) and the cold-start table (benchmarks/cold_start.py --report), on synthetic run
files written here, including runs that ended early."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _slice_md(rows: list[tuple[int, str, float, float]]) -> str:
    head = [
        "## GPU decode and prefill (V4-Flash slice)",
        "",
        "- date: 2026-12-02 02:15 UTC; total run time 81 s",
        "- GPU: NVIDIA H200",
        "- roofs measured in this run: device copy 4202 GB/s",
        "",
        "| batch | context | experts | step ms | tok/s | touched/layer | prod GB | prod roof ms | x prod roof | "
        "engine GB | engine roof ms | x engine roof |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    body = [
        f"| {b} | {c} | mxfp4, triton_kernels matmul | {ms} | 500 | 6 | 2.00 | 0.48 | {x} | 2.01 | 0.48 | {x} |"
        for b, c, ms, x in rows
    ]
    return "\n".join(head + body) + "\n"


def _run(module: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_decode_ab_table(tmp_path):
    (tmp_path / "ab_o1_auto.md").write_text(_slice_md([(1, "4K", 1.8, 3.7), (64, "32K", 5.7, 2.1)]))
    (tmp_path / "ab_o0_auto.md").write_text(_slice_md([(1, "4K", 1.9, 4.0), (64, "32K", 6.5, 2.4)]))
    text = _run("benchmarks.slice.ab", "--dir", str(tmp_path))
    assert "| 1 | 4K | 1.8 (3.7x) | 1.9 (4.0x) | 1.06x |" in text
    assert "| 64 | 32K | 5.7 (2.1x) | 6.5 (2.4x) | 1.14x |" in text
    assert "2026-12-02 02:15 UTC" in text and "NVIDIA H200" in text


def test_cold_start_table(tmp_path):
    (tmp_path / "warm0.log").write_text(
        "machine: NVIDIA H200, torch 2.11; 2026-12-02 02:30 UTC\nload_engine (warm-up 0): 0.9 s\n"
        "request 0: prompt 267, first step 46011.6 ms, slowest decode step 28980.5 ms\n"
        "request 1: prompt 697, first step 12644.4 ms, slowest decode step 9169.7 ms\n"
    )
    (tmp_path / "warm1.log").write_text("machine: NVIDIA H200, torch 2.11\n")  # ended inside the warm-up
    (tmp_path / "warm1_nvrtc.log").write_text(
        "machine: NVIDIA H200, torch 2.11\nTraceback (most recent call last):\n"
        "RuntimeError: CUDA driver error (handle.hpp:141): 200 (CUDA_ERROR_INVALID_IMAGE)\n"
    )
    (tmp_path / "warm1_hot.log").write_text(
        "engine.execution.warmup: warm-up: 13 prompts (1,2,4096 tokens) 12.5 s, 85 decode graphs captured 3.1 s, 9 FP8 GEMM "
        "shapes x 156 M values 40.2 s\nload_engine (warm-up 1): 60.2 s\n"
        "request 0: prompt 300, first step 20.0 ms, slowest later step 3.0 ms\n"
        "request 1: prompt 697, first step 4257.7 ms, slowest later step 81.2 ms\n"
        "  compiled during request 1: 8 files: _sort_pairs_kernel x1\n"
        "compile caches: 120 DeepGEMM files, 300 Triton files (nvrtc 0)\n"
    )
    text = _run("benchmarks.cold_start", "--report", str(tmp_path), "--timeout-s", "190")
    assert (
        "| off, empty caches | 2026-12-02 02:30 UTC | 0.9 s | - | 2 | not recorded | 29328 / 46012 | 19075 / 28980 | - |"
        in text
    )
    assert "| on, empty caches (DeepGEMM via nvcc) | - | not within 190 s | - | 0 | - | - | - | - |" in text
    assert "| on, empty caches (DeepGEMM via NVRTC) | - | not within 190 s |" in text
    assert "- on, empty caches (DeepGEMM via NVRTC): the process ended with `RuntimeError: CUDA driver error" in text
    assert (
        "| on, caches of an earlier run | - | 60.2 s | 12.5 s / 85 in 3.1 s / 9 shapes in 40.2 s | 2 | "
        "1 (sort_pairs) | 2139 / 4258 | 42 / 81 | 120 / 300 |" in text
    )
    assert "- machine: NVIDIA H200, torch 2.11" in text


def test_prefill_profile_host_side():
    """The prefill profile's host side (benchmarks/slice): the GPU's idle gaps between kernels and the CUDA API
    calls by host time, from a profile's events; nothing for a run without kernels (the CPU)."""
    from types import SimpleNamespace

    import torch

    from benchmarks.slice.engine_bench import _host_table
    from benchmarks.slice.report import _host_text

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, device, start, end):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end), cpu_time_total=end - start
        )

    kernels = [
        ev("k1", cuda, 0, 1000),
        ev("k2", cuda, 500, 2000),
        ev("k3", cuda, 5000, 6000),
        ev("k4", cuda, 6500, 7000),
    ]
    api = [
        ev("cudaLaunchKernel", cpu, 0, 20),
        ev("cudaLaunchKernel", cpu, 30, 50),
        ev("cudaStreamSynchronize", cpu, 100, 3100),
        ev("aten::mm", cpu, 0, 999),
    ]
    table = _host_table(SimpleNamespace(events=lambda: kernels + api))
    assert table["span_ms"] == 7.0 and table["idle_ms"] == 3.5 and table["gaps_ms"] == [3.0, 0.5]
    assert table["api"] == [(3.0, "cudaStreamSynchronize", 1), (0.04, "cudaLaunchKernel", 2)]
    text = _host_text(table)
    assert "idle between its first and last kernel: 3.5 ms of 7.0 ms (longest gaps 3.0, 0.5 ms)" in text
    assert "cudaStreamSynchronize 3.0 ms (1x); cudaLaunchKernel 0.0 ms (2x)" in text
    assert _host_text(_host_table(SimpleNamespace(events=lambda: api[3:]))) == ""
