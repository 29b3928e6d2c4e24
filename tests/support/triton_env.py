"""Shared preamble of the Triton kernel tests: import this before any dsv4_kernels.triton_* module.

Without a GPU the kernels run in triton's CPU interpreter, which triton reads when a kernel is decorated,
so TRITON_INTERPRET must be set before those imports. Skips the importing test module when triton
cannot run here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv4_kernels.gpu import has_triton, triton_enabled  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not has_triton():
    pytest.skip("triton is not importable", allow_module_level=True)
if not triton_enabled(DEVICE):
    pytest.skip(f"triton cannot run on {DEVICE} (TRITON_INTERPRET is off)", allow_module_level=True)
