"""`dsv4 doctor`: the environment a user would otherwise dig for, in one report (text, or `--json`).

Python, torch (its CUDA build, the devices and their capability), Triton, the Hopper libraries the fast paths
need (DeepGEMM, FlashMLA, triton_kernels, Marlin: importable, or why not, through dsv4_kernels.gpu's probes),
which fast paths an engine on this machine would take (engine.model.fast_paths), NIXL and its transport
plugins, Ray (version, whether its token authentication is on), gRPC and prometheus_client.

Every probe is guarded: a broken package is reported with its error, never raised, because the command exists
for machines where something is broken. Nothing here prints a secret (Ray's token file: whether it exists).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

MIN_PYTHON = (3, 11)  # asyncio.timeout_at (service/openai_app.py); pyproject's requires-python says the same

# Distribution names of the optional GPU libraries, by the module dsv4_kernels.gpu probes.
LIBRARIES = {
    "deep_gemm": "tokenspeed-deepgemm",
    "flash_mla": "tokenspeed-flashmla",
    "triton_kernels": "tokenspeed-triton-kernels",
    "marlin_moe": "tokenspeed-kernel",
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _guard(probe):
    """probe() or {"error": ...}: one broken package must not hide the rest of the report."""
    try:
        return probe()
    except Exception as e:  # noqa: BLE001 - reporting is the point
        return {"error": f"{type(e).__name__}: {e}"}


def python_info() -> dict:
    return {
        "version": platform.python_version(),
        "executable": sys.executable,
        "supported": sys.version_info[:2] >= MIN_PYTHON,
        "requires": ">=" + ".".join(map(str, MIN_PYTHON)),
    }


def torch_info() -> dict:
    import torch

    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "index": i,
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1),
                }
            )
    return {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "devices": devices,
    }


def triton_info() -> dict:
    from dsv4_kernels.gpu import has_triton, why_not

    ok = has_triton()
    return {
        "importable": ok,
        "version": _version("triton"),
        "why_not": "" if ok else why_not("triton") or "not installed",
    }


def libraries_info() -> dict:
    """Each library: installed (a distribution or module found), usable (dsv4_kernels.gpu's probe), why not."""
    import torch

    from dsv4_kernels import gpu

    probes = {
        "deep_gemm": (gpu.has_deep_gemm, lambda: gpu.why_not("deep_gemm"), "deep_gemm"),
        "flash_mla": (gpu.has_flash_mla, lambda: gpu.why_not("flash_mla"), "flash_mla"),
        "triton_kernels": (
            gpu.has_triton_kernels,
            lambda: gpu.why_not("triton_kernels.matmul") or gpu.why_not("triton_kernels.tensor"),
            "triton_kernels",
        ),
        "marlin_moe": (gpu.has_marlin_moe, gpu.why_not_marlin_moe, "tokenspeed_marlin_moe"),
    }
    out = {}
    for name, (usable, why, module) in probes.items():
        ok = usable()
        installed = _version(LIBRARIES[name]) is not None or importlib.util.find_spec(module) is not None
        reason = (
            ""
            if ok
            else why()
            or (
                "not installed"
                if not installed
                else "no CUDA device (the probe needs one)"
                if not torch.cuda.is_available()
                else "unusable"
            )
        )
        out[name] = {"usable": ok, "installed": installed, "version": _version(LIBRARIES[name]), "why_not": reason}
    return out


def fast_paths_info() -> dict:
    """What a bf16 engine with FP8 projections and packed MXFP4 experts (V4-Flash) would take on this machine."""
    import torch

    from engine.model.fast_paths import fast_path_states

    device = "cuda" if torch.cuda.is_available() else "cpu"
    states = fast_path_states(device, torch.bfloat16, True, True)
    return {"device": device, "paths": {p.name: {"active": p.active, "why_not": p.why} for p in states}}


def nixl_info() -> dict:
    from kv_transfer.nixl_backend import import_nixl

    version = _version("nixl-cu12") or _version("nixl-cu13") or _version("nixl")
    try:
        nixl_agent, nixl_agent_config, _ = import_nixl()
    except ImportError as e:
        return {"importable": False, "version": version, "why_not": str(e)}
    out: dict[str, object] = {"importable": True, "version": version, "ucx_tls": os.environ.get("UCX_TLS", "")}
    out["plugins"] = _guard(
        lambda: sorted(nixl_agent(f"dsv4-doctor-{os.getpid()}", nixl_agent_config(backends=[])).get_plugin_list())
    )
    out["ucx_transports"] = ucx_transports()
    return out


def ucx_transports() -> list[str] | str:
    """UCX's transports from `ucx_info -d` when the tool is on PATH (NIXL's UCX plugin uses the same library)."""
    tool = shutil.which("ucx_info")
    if tool is None:
        return "ucx_info not on PATH"
    try:
        text = subprocess.run([tool, "-d"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"ucx_info failed: {e}"
    return sorted({line.split(":", 1)[1].strip() for line in text.splitlines() if "Transport:" in line})


def ray_info() -> dict:
    """Ray's version and token authentication (Ray >= 2.5x: RAY_AUTH_MODE=token, the token from RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token). `enabled` is Ray's own answer for this process where it has one."""
    import ray

    token_file = str(Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"))
    out = {
        "version": ray.__version__,
        "auth_mode_env": os.environ.get("RAY_AUTH_MODE", ""),
        "token_env": bool(os.environ.get("RAY_AUTH_TOKEN")),
        "token_file": token_file,
    }
    out["token_file_exists"] = Path(token_file).is_file()
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        out["token_auth"] = bool(is_token_auth_enabled())
    except ImportError:  # a Ray without token authentication (before 2.5x)
        out["token_auth"] = out["auth_mode_env"] == "token"
        out["note"] = "this Ray has no token authentication module"
    return out


def packages_info() -> dict:
    return {
        name: _version(dist)
        for name, dist in (
            ("grpcio", "grpcio"),
            ("protobuf", "protobuf"),
            ("prometheus_client", "prometheus-client"),
            ("dsv4", "dsv4"),
        )
    }


SECTIONS = {
    "python": python_info,
    "torch": torch_info,
    "triton": triton_info,
    "libraries": libraries_info,
    "fast_paths": fast_paths_info,
    "nixl": nixl_info,
    "ray": ray_info,
    "packages": packages_info,
}


def collect() -> dict:
    return {name: _guard(probe) for name, probe in SECTIONS.items()}


def render(report: dict) -> str:
    """Indented `key: value` lines, one section a block."""
    lines = []

    def walk(value, indent):
        for k, v in value.items():
            if isinstance(v, dict):
                lines.append(f"{'  ' * indent}{k}:")
                walk(v, indent + 1)
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                lines.append(f"{'  ' * indent}{k}:")
                for item in v:
                    lines.append(f"{'  ' * (indent + 1)}- " + ", ".join(f"{a}={b}" for a, b in item.items()))
            else:
                shown = ", ".join(map(str, v)) if isinstance(v, list) else v
                shown = "-" if shown in (None, "") else shown
                lines.append(f"{'  ' * indent}{k}: {shown}")

    walk(report, 0)
    return "\n".join(lines) + "\n"


def add_doctor_args(p) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")


def doctor_main(args) -> int:
    # Libraries print while probed (NIXL logs its agent's start to stdout): stdout carries only the report.
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        report = collect()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else render(report))
    return 0
