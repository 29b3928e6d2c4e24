"""`dsv4 bench kernels ...` and `dsv4 bench slice ...`: the rest of the command line goes to the source tree's
`benchmarks` package (kernel micro-benchmarks, the V4-Flash-slice engine benchmark).

benchmarks/ is not installed with dsv4 (a developer's tool next to the code it measures, free to import every
product package), so it is reached by name at run time: the service depends on nothing in it, and a wheel
install without the source tree gets a clear error instead of an ImportError trace.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ENTRY = {
    "kernels": "benchmarks.kernels",
    "slice": "benchmarks.slice.cli",
    "spec": "benchmarks.spec",
    "quality": "benchmarks.quality",
}


def bench_tree_main(what: str, argv: list[str]) -> int:
    try:
        module = _load(ENTRY[what])
    except ModuleNotFoundError as e:
        if e.name != "benchmarks":
            raise
        print(
            f"dsv4 bench {what}: the `benchmarks` package is not importable: it lives in the source tree "
            "(benchmarks/ beside service/) and is not installed with dsv4; run from a checkout",
            file=sys.stderr,
        )
        return 2
    return module.main(argv) or 0


def _load(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        root = Path(__file__).resolve().parents[1]  # an editable install maps only the product packages
        if e.name != "benchmarks" or not (root / "benchmarks" / "__init__.py").is_file():
            raise
        sys.path.insert(0, str(root))
        return importlib.import_module(name)
