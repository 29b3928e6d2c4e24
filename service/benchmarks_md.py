"""The one writer of BENCHMARKS.md sections: every benchmark puts its generated section between its own markers.

A section is `<!-- dsv4:NAME begin -->` ... `<!-- dsv4:NAME end -->`; writing replaces that span (or appends it),
so reruns never duplicate and sections never overwrite each other. The file is the repository's BENCHMARKS.md
(found from this module, not the current directory) unless a path is given.
"""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def markers(name: str) -> tuple[str, str]:
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"section name must be lower-case letters, digits and '_', got {name!r}")
    return f"<!-- dsv4:{name} begin -->", f"<!-- dsv4:{name} end -->"


def write_section(name: str, body: str, path: Path | str | None = None) -> Path:
    """Put `body` (markdown, starting with its own `## ` heading) into section `name` of BENCHMARKS.md."""
    path = Path(path) if path else BENCHMARKS_MD
    begin, end = markers(name)
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text, count=1) if pattern.search(text) else text.rstrip() + "\n\n" + block
    path.write_text(text.rstrip() + "\n")
    return path
