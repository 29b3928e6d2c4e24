"""A fused step prologue's first derivation per bucket, checked against its torch reference.

Why: the fused prologue (dsv4_kernels.triton_decode_prologue, laid out by engine.model.decode_batch.PrologueLayout)
computes every index tensor of a fixed-shape decode or verify step: page tables, ring rows, compressor plans,
visible entries. It is tested element for element against the torch derivation (tests/engine/test_decode_prologue.py,
test_verify_prologue.py), but a miscompile on a GPU, driver or Triton release the tests never ran on would address
every step's caches wrongly without an error. So each layout's first derivation outside CUDA-graph capture (the graph
warm-up's eager forwards run before the capture; an eager bucketed step otherwise) also runs the reference and
compares every tensor (under CUDA graphs that first derivation is the warm-up's padding-only batch: it catches a
kernel that fails to compile or launch and a wrong layout, not every value path; eager steps check real ones). A
difference, or an exception from the kernel, turns the fused prologue off for the process
with an ERROR naming what differed; the torch ops (the same function, ~170-220 more small kernels a step) run from
then on. Cost: one reference derivation and one comparison per bucket, at warm-up.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from engine.model.batch import StepBatch

log = logging.getLogger("dsv4.engine")
_off_reason: str | None = None  # why the fused prologue is off in this process (None: on)


class CheckedLayout(Protocol):
    checked: bool  # its first derivation outside capture was compared with the reference


def fused_prologue_off() -> str | None:
    """Why this process stopped using the fused prologue, or None while it uses it."""
    return _off_reason


def turn_back_on() -> None:
    """Forget a turned-off state (tests: one that turned the fused prologue off must not leave it off for the next)."""
    global _off_reason
    _off_reason = None


def derive_checked(
    layout: CheckedLayout, fused: Callable[[], StepBatch], reference: Callable[[], StepBatch], device: torch.device
) -> StepBatch:
    """fused() -> the step's StepBatch, compared with reference() on the layout's first call outside capture; the
    reference's batch wherever the fused prologue is off."""
    global _off_reason
    if _off_reason is not None:
        return reference()
    if layout.checked or _capturing(device):
        return fused()
    want = reference()
    try:
        got = fused()
        diff = first_difference(got, want)
    except Exception as error:  # a kernel that does not compile or launch here: the reference runs instead
        diff = f"the kernel raised {type(error).__name__}: {error}"
    layout.checked = True
    if diff is None:
        return got
    _off_reason = diff
    log.error("fused step prologue disagrees with its torch reference (%s): the torch ops run from now on", diff)
    return want


def first_difference(got: StepBatch, want: StepBatch) -> str | None:
    """The first tensor (by field path) whose dtype, shape or values differ between two StepBatches, or None."""
    a, b = _tensors(got), _tensors(want)
    if a.keys() != b.keys():
        return f"fields {sorted(a.keys() ^ b.keys())} present in one batch only"
    for key, w in b.items():
        g = a[key]
        if not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor):
            if g != w:
                return f"{key}: {g!r} != {w!r}"
        elif g.dtype != w.dtype or g.shape != w.shape:
            return f"{key}: {g.dtype} {tuple(g.shape)} != {w.dtype} {tuple(w.shape)}"
        elif not torch.equal(g, w):
            return f"{key}: {int((g != w).sum())} of {w.numel()} elements differ"
    return None


def _tensors(obj, prefix: str = "") -> dict[str, object]:
    """Every leaf of a StepBatch (tensors and plain values) by its field path."""
    if dataclasses.is_dataclass(obj):
        out: dict[str, object] = {}
        for f in dataclasses.fields(obj):
            out.update(_tensors(getattr(obj, f.name), f"{prefix}{f.name}."))
        return out
    if isinstance(obj, dict):
        out = {}
        for name, item in obj.items():
            out.update(_tensors(item, f"{prefix}{name}."))
        return out
    return {prefix.rstrip("."): obj}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
