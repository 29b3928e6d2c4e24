"""The transfer backends the kv_transfer tests run over: tcp always, nixl when its package imports (it
works on host memory, so the CI machine has it: a skip there fails CI, see tests/conftest.py)."""

from __future__ import annotations

import pytest

from kv_transfer.nixl_backend import import_nixl

try:
    import_nixl()
    NIXL_SKIP = None
except ImportError as e:
    NIXL_SKIP = f"nixl not importable: {e}"

needs_nixl = pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
BACKEND_NAMES = ["tcp", pytest.param("nixl", marks=(needs_nixl, pytest.mark.nixl))]
