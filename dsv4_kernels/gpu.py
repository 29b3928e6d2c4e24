"""The one import point of optional GPU libraries (triton, deep_gemm, flash_mla, triton_kernels, the Marlin MoE
candidate): probes, errors.

Nothing here imports a GPU library at module import time; the probes import on first call and cache the
answer, so `import dsv4_kernels.gpu` is cheap on a CPU-only machine. Modules that need triton get it through
`import_triton()`, which raises one actionable error instead of a bare ModuleNotFoundError.

The library wheels (`pip install '.[gpu]'`, Python 3.12 + torch 2.11 builds; docs hopper-kernels notes):
deep_gemm (tokenspeed-deepgemm, FP8 GEMMs, JIT-compiled per shape with the machine's nvcc), flash_mla
(tokenspeed-flashmla) and triton_kernels (tokenspeed-triton-kernels, OpenAI's MXFP4 MoE matmul; it targets a
newer triton, so `import_triton_kernels` first adds the two names triton 3.6 lacks). Each probe is False when
the import fails for any reason, and `why_not(name)` says why, for the engine's fast-path log line.

Triton's interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors. The flag is read when a kernel is
*decorated*, i.e. when a `dsv4_kernels.triton_*` module is first imported, so it must be set before that.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

_TRITON_HINT = "triton is required for the dsv4_kernels.triton_* ops: pip install '.[gpu]' (triton>=3.0)"


@functools.cache
def has_triton() -> bool:
    """True when `import triton` succeeds (a broken install counts as missing)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


_IMPORT_ERRORS: dict[str, str] = {}


def _probe(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        _IMPORT_ERRORS[module] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return False
    return True


def why_not(module: str) -> str:
    """Why `module` did not import ('' when it did, or was never probed)."""
    return _IMPORT_ERRORS.get(module, "")


@functools.cache
def has_deep_gemm() -> bool:
    """True when `import deep_gemm` succeeds (a CUDA build for this torch: False on CPU hosts)."""
    return torch.cuda.is_available() and _probe("deep_gemm")


@functools.cache
def has_flash_mla() -> bool:
    """True when `import flash_mla` succeeds (sm90 sparse MLA decode over fp8_ds_mla pages)."""
    return torch.cuda.is_available() and _probe("flash_mla")


@functools.cache
def has_triton_kernels() -> bool:
    """True when OpenAI's `triton_kernels` imports (after the triton 3.6 shims) on a CUDA machine."""
    if not (torch.cuda.is_available() and has_triton()):
        return False
    _triton_kernels_shims()
    return _probe("triton_kernels.matmul") and _probe("triton_kernels.tensor")


def _triton_kernels_shims() -> None:
    """Names tokenspeed-triton-kernels reads that triton 3.6 lacks (hopper-kernels notes): an AMD-only target
    probe (False on NVIDIA) and JITFunction's definition line/column (aliases of what 3.6 records)."""
    import triton.language.target_info as target_info
    from triton.runtime.jit import JITFunction

    if not hasattr(target_info, "is_hip_gfx1250"):
        target_info.is_hip_gfx1250 = lambda: False
    for name, default in (
        ("def_file_line_number", lambda self: self.starting_line_number),
        ("def_file_col_number", lambda self: 0),
    ):
        if not hasattr(JITFunction, name):
            key = "_dsv4_" + name

            def getter(self, key=key, default=default):
                return self.__dict__[key] if key in self.__dict__ else default(self)

            def setter(self, value, key=key):
                self.__dict__[key] = value

            setattr(JITFunction, name, property(getter, setter))


@functools.cache
def has_marlin_moe() -> bool:
    """True when the Marlin MXFP4 MoE candidate's loaders and TVM FFI import on a CUDA machine (a local wheel:
    tools/device_wheels/marlin_wheel.py; the GEMM library itself loads on first use)."""
    return torch.cuda.is_available() and _probe("tvm_ffi") and _probe("tokenspeed_marlin_moe.marlin_moe")


def why_not_marlin_moe() -> str:
    """Why the Marlin candidate is unusable here ('' when it is, or was never probed)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    return why_not("tvm_ffi") or why_not("tokenspeed_marlin_moe.marlin_moe")


def import_marlin_moe():
    """-> (tvm_ffi, the repack module, the MoE GEMM module) of the Marlin candidate, or ImportError naming why."""
    if not has_marlin_moe():
        raise ImportError(
            f"the Marlin MoE candidate is not usable here ({why_not_marlin_moe()}): "
            "python tools/device_wheels/marlin_wheel.py, then install .whl/ on the CUDA machine"
        )
    import tvm_ffi
    from tokenspeed_marlin_moe import marlin, marlin_moe

    return tvm_ffi, marlin, marlin_moe


def import_deep_gemm():
    """-> the deep_gemm module, or ImportError naming why it is unusable here."""
    if not has_deep_gemm():
        raise ImportError(
            f"deep_gemm is not usable here ({why_not('deep_gemm') or 'no CUDA device'}): "
            "pip install '.[gpu]' on a CUDA machine"
        )
    import deep_gemm

    return deep_gemm


def import_flash_mla():
    """-> the flash_mla module, or ImportError naming why it is unusable here."""
    if not has_flash_mla():
        raise ImportError(
            f"flash_mla is not usable here ({why_not('flash_mla') or 'no CUDA device'}): "
            "pip install '.[gpu]' on a CUDA machine"
        )
    import flash_mla

    return flash_mla


def import_triton_kernels():
    """-> (matmul, tensor, layout, PrecisionConfig) of triton_kernels, or ImportError naming why."""
    if not has_triton_kernels():
        raise ImportError(
            f"triton_kernels is not usable here ({why_not('triton_kernels.matmul') or 'no CUDA'}): "
            "pip install '.[gpu]' on a CUDA machine"
        )
    from triton_kernels import matmul, tensor
    from triton_kernels.tensor_details import layout

    return matmul, tensor, layout, matmul.PrecisionConfig


def triton_interpret() -> bool:
    """True when triton kernels run in the CPU interpreter (TRITON_INTERPRET set to a true value)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_enabled(device: torch.device | str) -> bool:
    """Can triton kernels run on tensors of `device`? CUDA with triton, or CPU under the interpreter."""
    kind = torch.device(device).type
    if not has_triton():
        return False
    if kind == "cuda":
        return torch.cuda.is_available()
    return kind == "cpu" and triton_interpret()


def import_triton():
    """-> (triton, triton.language), or ImportError with the install hint."""
    if not has_triton():
        raise ImportError(_TRITON_HINT)
    import triton
    import triton.language as tl

    return triton, tl


def require_triton(device: torch.device | str) -> None:
    """Raise a RuntimeError naming the missing piece when triton kernels cannot run on `device`."""
    if not has_triton():
        raise RuntimeError(_TRITON_HINT)
    if not triton_enabled(device):
        raise RuntimeError(
            f"triton kernels cannot run on device {torch.device(device)}: need CUDA, "
            "or TRITON_INTERPRET=1 (set before importing dsv4_kernels.triton_*) for CPU tensors"
        )
