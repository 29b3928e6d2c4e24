"""The checked-in stubs load without grpcio-tools; a changed .proto regenerates them (or says how to)."""

import shutil
import subprocess
import sys
from pathlib import Path

import router

ROUTER_DIR = Path(router.__file__).parent
# Importing with grpc_tools made unimportable = an install without grpcio-tools.
NO_TOOLS = "import sys; sys.modules['grpc_tools'] = None; sys.modules['grpc_tools.protoc'] = None; "


def _copy(tmp_path):
    shutil.copytree(ROUTER_DIR, tmp_path / "router", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "router"


def _python(cwd, code):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_fresh_stubs_load_without_grpc_tools(tmp_path):
    _copy(tmp_path)
    out = _python(tmp_path, NO_TOOLS + "from router.protos import pb2; print(pb2.GenerateRequest.DESCRIPTOR.full_name)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "dsv4.router.GenerateRequest"


def test_changed_proto_regenerates_or_fails_clearly(tmp_path):
    copy = _copy(tmp_path)
    proto = copy / "dsv4_router.proto"
    text = proto.read_text().replace("message StatsRequest {}", "message StatsRequest {\n  bool verbose = 1;\n}")
    proto.write_text(text)
    out = _python(tmp_path, NO_TOOLS + "import router.protos")
    assert out.returncode != 0 and "pip install grpcio-tools" in out.stderr
    out = _python(
        tmp_path,
        "from router.protos import pb2, stubs_fresh; print(stubs_fresh(), pb2.StatsRequest(verbose=True).verbose)",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
