"""The frozen dataclasses that cross between pools (engine/handoff.py) are built with keywords only.

A positional call of a 12-field dataclass silently shifts every later value when a field is added in the middle;
with keywords that is a TypeError at the call. Read with `ast` over the product packages and the tests.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from engine import handoff

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dsv4_kernels", "engine", "kv_transfer", "prefill_worker", "decode_worker", "router", "service", "tests")
BOUNDARY = {
    name
    for name, obj in vars(handoff).items()
    if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj.__module__ == handoff.__name__
}


def test_boundary_types_found():
    assert {"PrefillResult", "TransferTicket", "Transferred", "WorkerStats", "EngineLoad", "PrefixDigest"} <= BOUNDARY


def positional_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            name = (
                node.func.id
                if isinstance(node.func, ast.Name)
                else node.func.attr
                if isinstance(node.func, ast.Attribute)
                else None
            )
            if name in BOUNDARY and not (isinstance(node.func, ast.Attribute) and node.func.attr != name):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(...) with {len(node.args)} positional")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_boundary_dataclasses_built_with_keywords(package):
    bad = [
        b for path in sorted((ROOT / package).rglob("*.py")) if "_gen" not in path.parts for b in positional_calls(path)
    ]
    assert not bad, "build these with keywords:\n" + "\n".join(bad)
