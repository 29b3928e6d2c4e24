"""`dsv4 doctor` run as a user runs it (the installed console script's module, a fresh process): every section
is there with its fields, and its answers agree with what this process sees."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import ray
import torch

from dsv4_kernels.gpu import has_triton
from kv_transfer.registry import nixl_available


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "doctor", *args], capture_output=True, text=True, timeout=300, check=True
    )


def test_doctor_json_reports_the_environment():
    report = json.loads(_doctor("--json").stdout)
    assert set(report) == {"python", "torch", "triton", "libraries", "fast_paths", "nixl", "ray", "packages"}
    assert report["python"]["version"] == platform.python_version() and report["python"]["supported"]
    t = report["torch"]
    assert t["version"] == torch.__version__ and t["cuda_build"] == torch.version.cuda
    assert t["cuda_available"] == torch.cuda.is_available() and len(t["devices"]) == torch.cuda.device_count()
    assert all(set(d) == {"index", "name", "capability", "memory_gib"} for d in t["devices"])
    assert report["triton"]["importable"] == has_triton()
    assert set(report["libraries"]) == {"deep_gemm", "flash_mla", "triton_kernels", "marlin_moe"}
    for lib in report["libraries"].values():
        assert set(lib) == {"usable", "installed", "version", "why_not"}
        assert lib["usable"] or lib["why_not"], "an unusable library says why"
    paths = report["fast_paths"]["paths"]
    assert {"triton", "fp8_gemm", "flash_mla", "mxfp4_moe"} <= set(paths)
    assert all(p["active"] or p["why_not"] for p in paths.values())
    assert report["nixl"]["importable"] == nixl_available()
    if report["nixl"]["importable"]:
        assert "UCX" in report["nixl"]["plugins"]  # the transfer backend creates a UCX backend
    else:
        assert report["nixl"]["why_not"]
    r = report["ray"]
    assert r["version"] == ray.__version__ and isinstance(r["token_auth"], bool)
    assert "auth_token" not in json.dumps(r).replace(r["token_file"], "")  # the path only, never a token
    assert set(report["packages"]) == {"grpcio", "protobuf", "prometheus_client", "dsv4"}
    assert report["packages"]["grpcio"] and report["packages"]["prometheus_client"]


def test_doctor_text_names_each_section():
    text = _doctor().stdout
    for section in (
        "python:",
        "torch:",
        "triton:",
        "libraries:",
        "deep_gemm:",
        "flash_mla:",
        "triton_kernels:",
        "fast_paths:",
        "nixl:",
        "ray:",
        "token_auth:",
        "packages:",
    ):
        assert f"\n{section}" in "\n" + text or f"  {section}" in text, section
