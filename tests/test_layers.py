"""The import graph follows the layers, has no cycles, and no private name crosses a module boundary.

  dsv4_kernels <- engine <- {kv_transfer, prefill_worker, decode_worker} <- router <- service <- benchmarks
benchmarks/ (not installed) sits on top: it may import every product package and none imports it (`dsv4 bench
kernels|slice` reaches it by name at run time, service/bench_tree.py).
Workers may use kv_transfer but never each other; kv_transfer uses neither worker. deploy/ (files that are
deployed: chart, dashboards, rules) imports nothing of the runtime except `engine.telemetry.metrics`, whose names it charts.
Inside engine/ the folders are layers of their own (engine.handoff, the cross-pool contract, imports nothing):
  engine.model <- engine.execution <- engine.telemetry <- engine.loading <- engine.runtime <- engine.llm
Read with `ast`, so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER = {
    "dsv4_kernels": 0,
    "engine": 1,
    "kv_transfer": 2,
    "prefill_worker": 2,
    "decode_worker": 2,
    "router": 3,
    "service": 4,
    "benchmarks": 5,
}
SIDEWAYS_OK = {("prefill_worker", "kv_transfer"), ("decode_worker", "kv_transfer")}
RUNTIME = set(LAYER)
# engine/ by role: the model and its caches, scheduling and execution, loading, telemetry, the worker runtime.
# (importer, imported module) pairs allowed a private name until the imported module offers a public one: the slice
# benchmark builds the release's quantisation layout from make_model's name patterns.
PRIVATE_OK = {
    ("benchmarks.slice.roofline", "engine.loading.make_model"),
    ("benchmarks.slice.slice_model", "engine.loading.make_model"),
}
ENGINE_LAYER = {
    "engine.handoff": 0,
    "engine.model": 1,
    "engine.execution": 2,
    "engine.telemetry": 3,
    "engine.loading": 4,
    "engine.runtime": 5,
    "engine.llm": 6,
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in [*LAYER, "deploy"]:
        for path in (ROOT / pkg).rglob("*.py"):
            if "_gen" in path.parts:  # generated gRPC stubs
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imports_of(path: Path, name: str) -> list[tuple[str, list[str], int]]:
    """[(imported module, [imported names], line)] of one file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join([*base, mod] if mod else base)
            found.append((mod, [a.name for a in node.names], node.lineno))
    return found


MODULES = modules()


def top(mod: str) -> str:
    return mod.split(".")[0]


def test_modules_found():
    assert {"service.cli", "engine.handoff", "kv_transfer.registry", "router.server"} <= set(MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_follow_layers(name):
    src = top(name)
    bad = []
    for mod, _names, line in imports_of(MODULES[name], name):
        dst = top(mod)
        if dst not in RUNTIME or dst == src:
            continue
        if src == "deploy":
            if mod != "engine.telemetry.metrics":
                bad.append(f"line {line}: deploy/ imports {mod} (only engine.telemetry.metrics' names may be charted)")
        elif LAYER[dst] > LAYER[src] or (LAYER[dst] == LAYER[src] and (src, dst) not in SIDEWAYS_OK):
            bad.append(f"line {line}: {src} (layer {LAYER[src]}) imports {mod} (layer {LAYER[dst]})")
    assert not bad, f"{name}:\n" + "\n".join(bad)


def engine_part(mod: str) -> str | None:
    parts = mod.split(".")
    return ".".join(parts[:2]) if parts[0] == "engine" and len(parts) > 1 else None


@pytest.mark.parametrize("name", sorted(n for n in MODULES if engine_part(n)))
def test_engine_roles_follow_layers(name):
    src = engine_part(name)
    assert src in ENGINE_LAYER, f"{name}: engine/ holds only {sorted(ENGINE_LAYER)}"
    bad = []
    for mod, _, line in imports_of(MODULES[name], name):
        dst = engine_part(mod)
        if dst is None or dst == src:
            continue
        if dst not in ENGINE_LAYER or ENGINE_LAYER[dst] >= ENGINE_LAYER[src]:
            bad.append(f"line {line}: {src} imports {mod}")
    assert not bad, f"{name}:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_names_across_modules(name):
    bad = []
    for mod, names, line in imports_of(MODULES[name], name):
        if top(mod) not in RUNTIME | {"deploy"} or mod == name or (name, mod) in PRIVATE_OK:
            continue
        bad += [f"line {line}: {n} from {mod}" for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, f"{name} imports private names:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = {
        name: {m for m, _, _ in imports_of(path, name) if m in MODULES and m != name} for name, path in MODULES.items()
    }
    # `from pkg import mod` names a submodule: count it as an edge to pkg.mod.
    for name, path in MODULES.items():
        for mod, names, _ in imports_of(path, name):
            graph[name] |= {f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES and f"{mod}.{n}" != name}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    # A package __init__ re-exporting its own submodules is not a cycle between modules.
    real = [
        c for c in cycles if not any(a == b.rpartition(".")[0] or b == a.rpartition(".")[0] for a, b in zip(c, c[1:]))
    ]
    assert not real, "import cycles:\n" + "\n".join(" -> ".join(c) for c in real)
