"""The GPU run is `pytest -m "gpu or triton"` (tools/gpu/run_tests.sh), so every test that needs CUDA must carry
the `gpu` marker, or the GPU run silently leaves it out (no hand-kept file lists).

Needs CUDA, read with `ast` from each test file: a module named test_gpu_*, or a skip / skipif whose condition
calls `cuda.is_available` or whose reason starts "GPU only" (conftest's rule for skips CI may have), at module
level (then the module is marked: `pytestmark` or conftest's AREA_MARKERS), on a test function or class (then it or
its module is marked), in a `pytest.param(..., marks=...)` (then those marks or its module are), or inside a
test's body (then the test or its module is).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import AREA_MARKERS, GPU_ONLY_PREFIX

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Named test_gpu_* but CPU tests: they check the BENCHMARKS sections built from GPU runs' output files.
NOT_CUDA = {"tests/service/test_gpu_run_reports.py", "tests/service/test_gpu_share_and_bench_options.py"}


def _is_skip(call: ast.Call) -> bool:
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr in ("skip", "skipif")


def gated(node: ast.AST, aliases: set[str] = frozenset()) -> bool:
    """Whether node holds a CUDA skip (or names a module-level marker that is one)."""
    if isinstance(node, ast.Name) and node.id in aliases:
        return True
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call) and _is_skip(n)):
        text = ast.unparse(call)
        strings = [n.value for n in ast.walk(call) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if "cuda.is_available" in text or any(s.startswith(GPU_ONLY_PREFIX) for s in strings):
            return True
    return False


def marks_gpu(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == "gpu" and ast.unparse(n).endswith("mark.gpu") for n in ast.walk(node)
    )


def _module_level(tree: ast.Module):
    """Statements run at import (top level and inside top-level `if` / `try`), not function or class bodies."""
    todo = list(tree.body)
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield stmt
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo += [s for s in getattr(stmt, field, []) if isinstance(s, ast.stmt)]


def _module_skip(stmt: ast.stmt) -> bool:
    """A skip run at import (`pytest.skip(..., allow_module_level=True)`, under an `if` on CUDA or not), or a
    `pytestmark` that is one; a marker merely assigned to a name is checked where it decorates."""
    if isinstance(stmt, ast.Expr):
        return gated(stmt)
    if isinstance(stmt, ast.If):
        body_skips = any(isinstance(n, ast.Call) and _is_skip(n) for s in stmt.body for n in ast.walk(s))
        return body_skips and "cuda.is_available" in ast.unparse(stmt.test)
    if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
        return gated(stmt.value)
    return False


def unmarked(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    area = any(rel.startswith(frag) and "gpu" in names for frag, names in AREA_MARKERS.items())
    pytestmark = [
        s
        for s in tree.body
        if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
    ]
    module_marked = area or any(marks_gpu(s.value) for s in pytestmark)
    aliases = {
        t.id
        for s in tree.body
        if isinstance(s, ast.Assign) and gated(s.value)
        for t in s.targets
        if isinstance(t, ast.Name)
    }
    if module_marked:
        return []
    bad = []
    if path.name.startswith("test_gpu_") and rel not in NOT_CUDA:
        bad.append("a test_gpu_* module")
    bad += [f"line {s.lineno}: a module-level CUDA skip" for s in _module_level(tree) if _module_skip(s)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.lower()[:4] == "test":
            if any(marks_gpu(d) for d in node.decorator_list):
                continue
            if any(gated(d, aliases) for d in node.decorator_list):
                bad.append(f"line {node.lineno}: {node.name} has a CUDA skip")
            elif any(gated(s, aliases) for s in node.body):
                bad.append(f"line {node.lineno}: {node.name} skips without CUDA in its body")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "param":
            marks = [k.value for k in node.keywords if k.arg == "marks"]
            if any(gated(m, aliases) for m in marks) and not any(marks_gpu(m) for m in marks):
                bad.append(f"line {node.lineno}: a pytest.param with a CUDA skip")
    return bad


FILES = sorted(p for p in TESTS.rglob("test_*.py") if "support" not in p.parts)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(TESTS).as_posix())
def test_tests_that_need_cuda_carry_the_gpu_marker(path):
    bad = unmarked(path)
    assert not bad, f"{path.relative_to(ROOT)} needs the gpu marker (pytest.mark.gpu):\n" + "\n".join(bad)


def test_the_rule_sees_each_kind_of_cuda_skip(tmp_path):
    cases = {
        "test_gpu_x.py": "def test_a():\n    pass\n",
        "test_mod.py": "import pytest, torch\nif not torch.cuda.is_available():\n"
        "    pytest.skip('GPU only: x', allow_module_level=True)\n",
        "test_fn.py": "import pytest, torch\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\n"
        "def test_a():\n    pass\n",
        "test_alias.py": "import pytest\nneeds = pytest.mark.skipif(True, reason='GPU only: x')\n@needs\n"
        "def test_a():\n    pass\n",
        "test_body.py": "import pytest\ndef test_a():\n    pytest.skip('GPU only: x')\n",
        "test_param.py": "import pytest, torch\n@pytest.mark.parametrize('d', [pytest.param('cuda', marks="
        "pytest.mark.skipif(not torch.cuda.is_available(), reason='x'))])\ndef test_a(d):\n    pass\n",
    }
    for name, text in cases.items():
        path = ROOT / "tests" / "_marker_probe" / name
        path.parent.mkdir(exist_ok=True)
        try:
            path.write_text(text)
            assert unmarked(path), name
            path.write_text("import pytest\npytestmark = pytest.mark.gpu\n" + text)
            assert not unmarked(path), name
        finally:
            path.unlink()
    (ROOT / "tests" / "_marker_probe").rmdir()
