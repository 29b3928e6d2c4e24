"""The one import point of optional GPU libraries (triton, deep_gemm): probes and a clear error.

Nothing here imports a GPU library at module import time; the probes import on first call and cache the
answer, so `import kernels.gpu` is cheap on a CPU-only machine. Modules that need triton get it through
`import_triton()`, which raises one actionable error instead of a bare ModuleNotFoundError.

Triton's interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors. The flag is read when a kernel is
*decorated*, i.e. when a `kernels.triton_*` module is first imported, so it must be set before that.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

_TRITON_HINT = "triton is required for the kernels.triton_* ops: pip install '.[gpu]' (triton>=3.0)"


@functools.cache
def has_triton() -> bool:
    """True when `import triton` succeeds (a broken install counts as missing)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


@functools.cache
def has_deep_gemm() -> bool:
    """True when `import deep_gemm` succeeds. It needs a CUDA build, so this is False on CPU hosts."""
    try:
        importlib.import_module("deep_gemm")
    except Exception:  # noqa: BLE001
        return False
    return True


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
        raise RuntimeError(f"triton kernels cannot run on device {torch.device(device)}: need CUDA, "
                           "or TRITON_INTERPRET=1 (set before importing kernels.triton_*) for CPU tensors")
