"""The padded prefill step's device half and forward read nothing back from the device (what a CUDA graph captures).

On the CPU the fast paths run under Triton's interpreter (DSV4_TRITON=1; tests/conftest.py sets TRITON_INTERPRET),
grouped experts too (DSV4_GROUPED_MOE=1): the ops a CUDA engine's prefill runs. Every call that would wait for
the device on CUDA (a tensor read into Python: item, tolist, bool / int / float, numpy; data-dependent sizes:
nonzero, unique, bincount, masked_select, repeat_interleave by a tensor without output_size, boolean-mask
indexing) is recorded when the engine's own code makes it; the step must make none. The reference paths do
(the test checks that the guard sees them), which is why prefill graphs need the CUDA fast paths. On a GPU the
capture itself is the check (tests/engine/test_gpu_prefill_graphs.py).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch

from dsv4_kernels.gpu import has_triton, triton_enabled
from engine.execution.prefill_graphs import padded_inputs
from engine.loading.make_model import default_model_dir
from engine.model.batch import device_step
from tests.engine.test_prefill_buckets import _engine

pytestmark = pytest.mark.skipif(
    not (has_triton() and triton_enabled("cpu")),
    reason="CPU only: needs Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets without a GPU)",
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
SYNCING = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "nonzero", "unique", "bincount")


def _is_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _guard(monkeypatch, owner, name: str, seen: Counter, when=lambda *a, **k: True) -> None:
    fn = getattr(owner, name)

    def wrapped(*args, **kwargs):
        frame = sys._getframe(1)
        path = frame.f_code.co_filename
        # the engine's own calls only: Triton's interpreter reads its arguments on the host by design
        if path.startswith(ROOT) and not path.startswith(ROOT + "tests") and when(*args, **kwargs):
            seen[(f"{getattr(owner, '__name__', owner)}.{name}", path[len(ROOT) :], frame.f_lineno)] += 1
        return fn(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


def _guarded_forward(engine, inputs, monkeypatch) -> Counter:
    views, _ = inputs.upload("cpu")
    seen: Counter = Counter()
    for name in SYNCING:
        _guard(monkeypatch, torch.Tensor, name, seen)
    for name in ("nonzero", "unique", "bincount", "masked_select"):
        _guard(monkeypatch, torch, name, seen)

    def by_tensor(*args, **kwargs):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None

    _guard(monkeypatch, torch, "repeat_interleave", seen, by_tensor)
    _guard(monkeypatch, torch.Tensor, "repeat_interleave", seen, by_tensor)
    _guard(monkeypatch, torch.Tensor, "__getitem__", seen, lambda _, index: _is_mask(index))
    try:
        engine.model.forward(device_step(engine.pool, inputs.host, views), engine.pool)
    finally:
        monkeypatch.undo()
    return seen


def _step(engine):
    """Two requests: a first chunk of 37 tokens and a later chunk of 9 (its window rows from the rings), padded to
    64 tokens with a padding row."""
    a, b = {}, {}
    engine.pool.grow(a, 300)
    engine.pool.grow(b, 300)
    inputs = padded_inputs(engine.prefill_runner, [list(range(1, 38)), list(range(5, 14))], [0, 131], [a, b])
    assert inputs is not None
    return inputs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_padded_prefill_forward_is_sync_free(kv_cache_dtype, monkeypatch):
    monkeypatch.setenv("DSV4_TRITON", "1")
    monkeypatch.setenv("DSV4_GROUPED_MOE", "1")
    engine = _engine(default_model_dir(), "bucketed", 64, kv_cache_dtype=kv_cache_dtype)
    seen = _guarded_forward(engine, _step(engine), monkeypatch)
    assert not seen, f"host reads in the prefill forward: {seen.most_common(10)}"


def test_the_guard_sees_the_reference_paths_syncs(monkeypatch):
    """The reference paths (no Triton, per-expert loop) read ids back (quantised cache reads' unique, the experts'
    bincount): the guard must catch them, or the test above proves nothing."""
    monkeypatch.setenv("DSV4_TRITON", "0")
    monkeypatch.setenv("DSV4_GROUPED_MOE", "0")
    engine = _engine(default_model_dir(), "bucketed", 64, kv_cache_dtype="fp8")
    seen = _guarded_forward(engine, _step(engine), monkeypatch)
    names = {name for name, _, _ in seen}
    assert {"torch.unique", "torch.bincount", "Tensor.tolist"} <= names, seen
