"""The human-facing side of the settings registry (dsv4_kernels.settings): the docs/settings.md table, one line a
switch of the values an environment gives, and the `python -m dsv4_kernels.settings_doc [--markdown]` entry point."""

from __future__ import annotations

import os
import sys
from dataclasses import fields

from dsv4_kernels.settings import SWITCHES, Settings, settings
from dsv4_kernels.switch import GROUPS, Switch


def markdown() -> str:
    """docs/settings.md: every switch by group, with its type, default and help."""
    out = [
        "# Settings",
        "",
        "Every `DSV4_*` environment variable the code reads. Generated from `dsv4_kernels/settings.py` by",
        "`python -m dsv4_kernels.settings_doc --markdown > docs/settings.md` (tests/test_settings.py fails when this",
        "file is out of date); `python -m dsv4_kernels.settings_doc` prints the values your environment gives.",
        "",
        "One rule for every value; an empty value counts as unset (the default):",
        "- bool: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`, case-insensitive; where unset means automatic,",
        "  `auto` too;",
        "- int / number: parsed once, at the first read; choice: one of its values, case-insensitive; json: a JSON "
        "object.",
        "A bad value fails with an error naming the variable, the value and what it accepts. An unknown `DSV4_*`",
        "name in the environment logs one warning (naming the closest known one).",
        "",
    ]
    for group, heading in GROUPS.items():
        out += [f"## {heading}", "", "| Variable | Type | Default | What it does |", "|---|---|---|---|"]
        for s in SWITCHES:
            if s.group == group:
                kind = s.kind if s.kind != "choice" else "choice: " + " / ".join(s.choices)
                if s.kind == "bool" and s.auto:
                    kind = "bool or auto"
                if s.minimum is not None:
                    kind += f" >= {s.minimum}"
                cell = s.help.replace("|", "\\|")
                out.append(f"| `{s.name}` | {kind} | {s.shown_default()} | {cell} |")
        out.append("")
    return "\n".join(out)


def describe(values: Settings) -> str:
    """One line a switch: NAME=value (secrets hidden), those the environment sets marked."""
    lines = []
    for f in fields(values):
        s: Switch = f.metadata["switch"]
        value = getattr(values, f.name)
        shown = "<hidden>" if s.secret and value is not None else ("unset" if value is None else value)
        mark = " (set)" if s.name in os.environ else ""
        lines.append(f"{s.name}={shown}{mark}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv == ["--markdown"]:
        print(markdown(), end="")
        return 0
    if argv:
        print("usage: python -m dsv4_kernels.settings_doc [--markdown]", file=sys.stderr)
        return 2
    print(describe(settings()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
