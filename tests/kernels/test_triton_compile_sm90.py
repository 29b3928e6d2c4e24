"""The cache-writing Triton kernels compile for sm_90 (H100 / H200) with the CUDA-path constexprs.

The interpreter tests cannot see what only the GPU compiler rejects (reshapes, dot shapes, pointer casts);
scripts/compile_triton_sm90.py compiles every recorded launch with triton's bundled ptxas, no GPU needed, and
checks the fp32 -> e4m3 conversion is one round-to-nearest-even cvt. Runs in a subprocess because the other
Triton tests set TRITON_INTERPRET in this one.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cache_kernels_compile_for_sm90():
    try:
        from triton.backends.nvidia import compiler as nv
    except ImportError as e:  # a triton build without the NVIDIA backend (not the PyPI Linux wheel CI installs)
        pytest.skip(f"triton has no NVIDIA backend here: {e}")
    ptxas = nv.get_ptxas(90).path  # triton's bundled ptxas: its absence is a failure, not a skip
    assert ptxas and os.path.exists(ptxas), f"triton's ptxas for sm_90 is missing: {ptxas!r}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run(
        # both of CI's cores (pytest runs one test at a time); the register report is for people, not the test
        [sys.executable, str(ROOT / "scripts" / "compile_triton_sm90.py"), "--jobs", "2", "--no-report"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "all kernels compiled for sm_90" in res.stdout
