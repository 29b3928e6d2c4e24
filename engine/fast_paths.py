"""The one switch between the engine's reference torch ops and the Triton fast paths.

`use_triton(device)` decides per call, so a process can run both paths (tests compare them):
- CUDA tensors: on whenever triton imports (`kernels.gpu.has_triton`);
- CPU tensors: only when forced with DSV4_TRITON=1 *and* triton's interpreter is on (TRITON_INTERPRET=1,
  set before any kernels.triton_* import) -- slow, for tests;
- DSV4_TRITON=0 (or false/off/no) turns the fast paths off everywhere (the reference ops run on CUDA too).
The reference path is the CPU oracle the tests pin; a fast path must compute the same function.
MXFP4 experts kept packed have their own switch, `use_mxfp4_moe` ($DSV4_MXFP4_MOE, see there).
"""

from __future__ import annotations

import os

import torch

from kernels.gpu import has_triton, triton_enabled

ENV = "DSV4_TRITON"
MXFP4_ENV = "DSV4_MXFP4_MOE"
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def triton_setting(env: str = ENV) -> str | None:
    """'off', 'on' (forced, also on CPU under the interpreter) or None (automatic) from $env (DSV4_TRITON)."""
    value = os.environ.get(env, "").strip().lower()
    if value in _OFF:
        return "off"
    if value in _ON:
        return "on"
    return None


def use_triton(device: torch.device | str) -> bool:
    """Should ops on `device` take the Triton kernels? See the module docstring."""
    setting = triton_setting()
    if setting == "off":
        return False
    kind = torch.device(device).type
    if kind == "cuda":
        return has_triton() and torch.cuda.is_available()
    return setting == "on" and triton_enabled(kind)


def use_grouped_moe(x: torch.Tensor) -> bool:
    """Routed experts as grouped GEMMs (no host sync) on CUDA; the per-expert loop reference elsewhere.

    DSV4_GROUPED_MOE=1 forces it on the CPU too (tests compare both), =0 turns it off everywhere.
    """
    from kernels.moe import has_grouped_mm

    value = os.environ.get("DSV4_GROUPED_MOE", "").strip().lower()
    if value in _OFF or not has_grouped_mm():
        return False
    # On CUDA only 16-bit inputs have a native grouped kernel: fp32 falls back to a per-group loop that
    # reads the offsets on the host (slow, and it breaks CUDA-graph capture).
    return value in _ON or (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))


def keep_mxfp4_experts() -> bool:
    """Default of `load_engine(keep_mxfp4_experts=None)`: keep MXFP4 experts packed iff DSV4_MXFP4_MOE=1."""
    return triton_setting(MXFP4_ENV) == "on"


def use_mxfp4_moe(device: torch.device | str) -> bool:
    """Packed MXFP4 experts on `device`: the Triton kernel (True) or the dequantise-on-the-fly reference.

    DSV4_MXFP4_MOE=0 -> reference everywhere; =1 -> the kernel wherever triton runs (CPU only under the
    interpreter); unset -> follows `use_triton`. (Only matters when the weights were kept packed.)
    """
    setting = triton_setting(MXFP4_ENV)
    if setting == "off":
        return False
    if setting == "on":
        return triton_enabled(device)
    return use_triton(device)
