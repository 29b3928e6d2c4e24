"""Sections of BENCHMARKS.md made of whole slice-bench runs under one heading with what the runs used and what they
leave out: long context (issue 35 item 2: `tools/gpu/stages.sh longctx`, or a narrower `benchmarks/slice/run.sh`
run), the prefill by expert format (issue 35 item 1: `tools/gpu/stages.sh prefillfmt` / `prefillab`) and the
batch-1 decode step's launches (issue 35 item 4: `tools/gpu/stages.sh b1prof`).

    python -m benchmarks.slice.long_context --files RUN.md [RUN.md ...] [--note TEXT] [--prefill-formats |
        --decode-launches] [--write]

Each RUN.md is a slice bench's `--out` section (its command, machine, decode and prefill tables, chunk times and
peak memory); they are kept whole, under `###` headings, so every number keeps its own command and date.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from service.benchmarks_md import write_section

HEADING = "## Long context on the V4-Flash slice: chunked prefill and decode at 32K-1M tokens"
PREFILL_FORMATS_HEADING = "## Prefill by routed-expert format on the V4-Flash slice (8K tokens, 3 runs each)"
DECODE_LAUNCHES_HEADING = "## Batch-1 decode launches on the V4-Flash slice (issue 35 item 4)"


def render(runs: list[str], note: str, heading: str = HEADING) -> str:
    """One section from slice-bench sections (their `## ` heading demoted to `###`)."""
    parts = [heading, ""]
    if note:
        parts += [note.strip(), ""]
    for text in runs:
        body = text.strip()
        if body.startswith("## "):
            body = "#" + body
        parts += [body, ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.slice.long_context")
    ap.add_argument("--files", nargs="+", required=True, help="slice bench --out sections")
    ap.add_argument("--note", default="", help="what the runs used / left out (kept above the runs)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--prefill-formats", action="store_true", help="the prefill-by-format section instead")
    which.add_argument("--decode-launches", action="store_true", help="the batch-1 decode launches section instead")
    ap.add_argument("--write", action="store_true", help="put the section into BENCHMARKS.md")
    args = ap.parse_args(argv)
    runs = [Path(f).read_text() for f in args.files]
    if args.prefill_formats:
        section = render(runs, args.note, PREFILL_FORMATS_HEADING)
        print(section)
        if args.write:
            write_section("prefill_formats", section)
        return
    if args.decode_launches:
        section = render(runs, args.note, DECODE_LAUNCHES_HEADING)
        print(section)
        if args.write:
            write_section("decode_launches", section)
        return
    section = render(runs, args.note)
    print(section)
    if args.write:
        write_section("long_context", section)


if __name__ == "__main__":
    main()
