"""A/B table of slice-bench runs that differ in one setting (`tools/gpu/stages.sh ab`): overlapped decode on and
off, FP8 and MXFP4 indexer keys. Reads the runs' markdown sections (`dsv4 bench slice --out`) and writes one
comparison into BENCHMARKS.md (section gpu_decode_ab).

    python -m benchmarks.slice.ab --dir DIR [--write]

DIR holds ab_o{0,1}_{auto,mxfp4}.md as the stage writes them.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from service.benchmarks_md import write_section

VARIANTS = (
    ("ab_o1_auto.md", "overlap on, FP8 keys (the default)"),
    ("ab_o0_auto.md", "overlap off, FP8 keys"),
    ("ab_o1_mxfp4.md", "overlap on, MXFP4 keys"),
)
# | batch | context | experts | step ms | tok/s | touched | prod GB | prod roof ms | x prod roof | ...
ROW = re.compile(
    r"^\| (\d+) \| (\d+K) \| [^|]+ \| ([\d.]+) \| (\d+) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \| "
    r"([\d.]+) \|",
    re.M,
)


def parse(text: str) -> dict[tuple[int, str], tuple[float, float]]:
    """(batch, context) -> (step ms, x prod roof) of one run's decode table."""
    return {(int(b), c): (float(ms), float(x)) for b, c, ms, _, _, x in ROW.findall(text)}


def header(text: str, key: str) -> str:
    m = re.search(rf"^- {key}: (.*)$", text, re.M)
    return m.group(1) if m else "?"


def render(runs: dict[str, str]) -> str:
    first = next(iter(runs.values()))
    tables = {label: parse(text) for label, text in runs.items()}
    keys = sorted({k for t in tables.values() for k in t}, key=lambda k: (k[0], int(k[1][:-1])))
    labels = list(runs)
    lines = [
        "## GPU decode A/B: overlapped decode, indexer key format (V4-Flash slice)",
        "",
        "- command: `tools/gpu/stages.sh ab` (three `benchmarks/slice/run.sh --no-peer --experts mxfp4 "
        "--batches 1 64 --contexts 4096 32768` runs: `DSV4_OVERLAP_DECODE=1/0`, `--index-cache auto/mxfp4`), then "
        "`python -m benchmarks.slice.ab --dir DIR --write`",
        f"- date: {header(first, 'date')}",
        f"- GPU: {header(first, 'GPU')}",
        f"- roofs: {header(first, 'roofs measured in this run')}",
        "- step ms = one `EngineCore.step()` in a run of steps (no device sync between steps: an overlapped step "
        "returns while the next one runs), median of 8; x roof = step / production-format roofline "
        "(bytes the step must read / copy bandwidth); the slice section above says what is counted",
        "",
        "| batch | context | " + " | ".join(f"{lab}: ms (x roof)" for lab in labels) + " | overlap gain |",
        "|---:|---:|" + "---:|" * len(labels) + "---:|",
    ]
    for key in keys:
        cells = [
            f"{tables[lab][key][0]:.1f} ({tables[lab][key][1]:.1f}x)" if key in tables[lab] else "-" for lab in labels
        ]
        on, off = (tables.get(VARIANTS[i][1], {}).get(key) for i in (0, 1))
        gain = f"{off[0] / on[0]:.2f}x" if on and off else "-"
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {gain} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--write", action="store_true", help="put the section into BENCHMARKS.md")
    args = ap.parse_args()
    runs = {label: (Path(args.dir) / name).read_text() for name, label in VARIANTS if (Path(args.dir) / name).exists()}
    if not runs:
        sys.exit(f"no ab_*.md in {args.dir}")
    section = render(runs)
    print(section)
    if args.write:
        write_section("gpu_decode_ab", section)


if __name__ == "__main__":
    main()
