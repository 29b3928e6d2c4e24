"""Build the Marlin MXFP4 MoE candidate's wheels for the GPU machine into .whl/ (carried by device calls).

The Marlin W4A16 MoE GEMM that vLLM and SGLang run on Hopper ships pre-compiled in `tokenspeed-kernel==0.1.4`
(`thirdparty/cuda/objs/marlin_moe/marlin_moe.so`, loaded through TVM FFI). That wheel pins torch 2.14 and its
`__init__` imports a dozen other libraries, but the two shared objects link only the CUDA 13 runtime and libc
(no libtorch), so they load under the GPU machine's torch 2.11: this takes the two loader modules and their
objects (MIT, LightSeek Foundation; the licence files go along) into a local wheel, `tokenspeed_marlin_moe`,
and fetches the TVM FFI runtime they need (`apache-tvm-ffi==0.1.13.post3`, the cp312 build). Both land in .whl/,
which `tools/gpu/stages.sh` installs on the device with the other GPU wheels.

    python tools/device_wheels/marlin_wheel.py            # needs network (PyPI); ~55 MB downloaded, ~9 MB written
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "tokenspeed-kernel==0.1.4"
TVM_FFI = "apache-tvm-ffi==0.1.13.post3"
PACKAGE, VERSION = "tokenspeed_marlin_moe", "0.1.4"
# source path in tokenspeed_kernel -> path in the local package (the loaders find objs/ beside themselves)
FILES = {
    "tokenspeed_kernel/thirdparty/cuda/marlin.py": "marlin.py",
    "tokenspeed_kernel/thirdparty/cuda/marlin_moe.py": "marlin_moe.py",
    "tokenspeed_kernel/thirdparty/cuda/objs/marlin/marlin.so": "objs/marlin/marlin.so",
    "tokenspeed_kernel/thirdparty/cuda/objs/marlin_moe/marlin_moe.so": "objs/marlin_moe/marlin_moe.so",
    "tokenspeed_kernel-0.1.4.dist-info/licenses/LICENSE": "LICENSE",
    "tokenspeed_kernel-0.1.4.dist-info/licenses/THIRDPARTYNOTICES": "THIRDPARTYNOTICES",
}


def _download(spec: str, dest: Path, *extra: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *extra, spec],
                   check=True)
    name = spec.split("==")[0].replace("-", "_")
    return next(p for p in dest.glob("*.whl") if p.name.lower().startswith(name.lower()))


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build(source_wheel: Path, out_dir: Path) -> Path:
    """The local wheel from the files of `source_wheel` (FILES) -> its path in out_dir."""
    out = out_dir / f"{PACKAGE}-{VERSION}-py3-none-any.whl"
    dist = f"{PACKAGE}-{VERSION}.dist-info"
    entries: list[tuple[str, bytes]] = [(f"{PACKAGE}/__init__.py",
                                         b'"""Marlin MoE loaders and objects from tokenspeed-kernel 0.1.4 '
                                         b'(tools/device_wheels/marlin_wheel.py)."""\n')]
    with zipfile.ZipFile(source_wheel) as src:
        for path, target in FILES.items():
            entries.append((f"{PACKAGE}/{target}", src.read(path)))
    entries.append((f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n"
                                        f"Summary: Marlin MoE loaders from {SOURCE}\nLicense: MIT\n".encode()))
    entries.append((f"{dist}/WHEEL", b"Wheel-Version: 1.0\nGenerator: dsv4 tools/device_wheels/marlin_wheel.py\n"
                                     b"Root-Is-Purelib: true\nTag: py3-none-any\n"))
    record = "\n".join([_record_line(n, d) for n, d in entries] + [f"{dist}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in entries:
            whl.writestr(name, data)
        whl.writestr(f"{dist}/RECORD", record)
    return out


def main() -> int:
    out_dir = ROOT / ".whl"
    out_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        built = build(_download(SOURCE, Path(tmp)), out_dir)
    tvm = _download(TVM_FFI, out_dir, "--python-version", "3.12", "--only-binary=:all:", "--platform",
                    "manylinux_2_28_x86_64")
    for p in (built, tvm):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
