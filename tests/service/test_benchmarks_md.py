"""BENCHMARKS.md is made of generated sections only: every heading sits between `dsv4:NAME` markers whose
NAME some benchmark writes through `service.benchmarks_md.write_section`; rewriting a section replaces it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.benchmarks_md import BENCHMARKS_MD, markers, write_section

ROOT = Path(__file__).resolve().parents[2]


def read_section(name: str, path: Path) -> str | None:
    """The body of section `name`, or None when the file has none (only the tests read sections back)."""
    begin, end = markers(name)
    m = re.search(re.escape(begin) + r"\n(.*?)\n" + re.escape(end), path.read_text() if path.exists() else "", re.S)
    return m.group(1) if m else None


def test_write_section_replaces_and_appends(tmp_path):
    path = tmp_path / "B.md"
    write_section("alpha", "## A\n\n1", path)
    write_section("beta", "## B\n\n2", path)
    write_section("alpha", "## A\n\n3", path)
    text = path.read_text()
    assert text.count("dsv4:alpha begin") == 1 and read_section("alpha", path) == "## A\n\n3"
    assert read_section("beta", path) == "## B\n\n2" and text.index("## A") < text.index("## B")
    with pytest.raises(ValueError, match="section name"):
        markers("Bad Name")


def test_every_section_of_benchmarks_md_is_generated():
    text = BENCHMARKS_MD.read_text()
    spans = [
        (m.start(), m.end(), m.group(1))
        for m in re.finditer(r"<!-- dsv4:([a-z0-9_]+) begin -->.*?<!-- dsv4:\1 end -->", text, re.S)
    ]
    for heading in re.finditer(r"^## .*$", text, re.M):
        assert any(a < heading.start() < b for a, b, _ in spans), f"hand-written section: {heading.group(0)!r}"
    dirs = ("benchmarks", "scripts", "service", "tools")
    code = "\n".join(p.read_text() for d in dirs for p in (ROOT / d).rglob("*.py"))
    writers = set(re.findall(r"""write_section\(\s*["']([a-z0-9_]+)["']""", code))
    for _, _, name in spans:
        assert name in writers, f"section {name!r} has no writer in benchmarks/, scripts/, service/ or tools/"
