"""Programmatic dependent launch (PDL) for the engine's own Triton kernels: `pdl_kwargs` and `tl_pdl_wait`.

A decode step replays ~150 small kernels in one CUDA graph, and each launch gap costs about half a microsecond on
an H100. With PDL (sm_90+) a kernel launched with `launch_pdl=True` may start while its predecessor in the stream
is still running; it must then wait (`griddepcontrol.wait`, `tl.extra.cuda.gdc_wait()`) before it touches
memory the predecessor writes or reads. The rule here is the simplest safe one: every kernel that takes part calls
`tl_pdl_wait(PDL)` as its FIRST statement, before any global load or store, so every read-after-write and
write-after-read against earlier kernels holds (and transitively: a kernel's predecessor finished only after its
own wait returned). No kernel calls gdc_launch_dependents (the probe measured no gain from it): a dependent then
starts as the predecessor's programs exit.

Each launch site passes `**pdl_kwargs(tensor)`: `{"PDL": True, "launch_pdl": True}` only for a CUDA tensor on a
device of compute capability >= 9.0, with $DSV4_PDL on and a triton that has both gdc_wait and the launch_pdl
option; else `{"PDL": False}` (the kernel's wait compiles away, and the interpreter never sees launch_pdl nor
runs gdc_wait). The capability is cached per device on first use (launches are captured into CUDA graphs: no CUDA
query per launch). $DSV4_PDL is off: on an H100 it gained nothing in the engine's decode step, as every kernel here
waits first (BENCHMARKS.md decode_launches; docs/settings.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch

from dsv4_kernels.gpu import import_triton, triton_interpret
from dsv4_kernels.settings import settings

triton, tl = import_triton()

PDL_OFF: Mapping[str, bool] = MappingProxyType({"PDL": False})
PDL_ON: Mapping[str, bool] = MappingProxyType({"PDL": True, "launch_pdl": True})

# Read once, as triton reads TRITON_INTERPRET when the kernels are decorated (the importing modules' import).
_INTERPRET = triton_interpret()
_forced: Mapping[str, bool] | None = None


@triton.jit
def tl_pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@functools.cache
def triton_has_pdl() -> bool:
    """True when this triton has gdc_wait and the CUDA backend's launch_pdl option (both in triton 3.6)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        has_option = any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))
        return has_option and hasattr(tl.extra.cuda, "gdc_wait")
    except Exception:  # noqa: BLE001 - no NVIDIA backend, or a layout this check does not know: no PDL
        return False


@functools.cache
def _device_has_pdl(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 9


def device_has_pdl(device: torch.device) -> bool:
    """PDL possible on `device`: a CUDA device of compute capability >= 9.0 (cached per device) and this triton."""
    if device.type != "cuda" or _INTERPRET or not triton_has_pdl():
        return False
    return _device_has_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_kwargs(x: torch.Tensor) -> Mapping[str, bool]:
    """The extra launch kwargs of a kernel whose tensors are on `x`'s device (see the module's docstring)."""
    if _forced is not None:
        return _forced
    if not settings().pdl:
        return PDL_OFF
    return PDL_ON if device_has_pdl(x.device) else PDL_OFF


def force(on: bool | None) -> None:
    """Tools only (scripts/compile_triton_sm90.py --pdl records CPU launches as the CUDA path would make them):
    every launch gets PDL on (True) or off (False); None restores the rule above."""
    global _forced
    _forced = None if on is None else (PDL_ON if on else PDL_OFF)
