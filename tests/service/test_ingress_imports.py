"""The HTTP ingress replica's modules import no torch.

Ingress replicas scale elastically, and torch costs each one ~2-4 s of start-up and ~250 MB of RSS for nothing: the
replica runs no model. Checked in a fresh interpreter (this one has torch already), where a meta-path finder notes
the import stack of torch's first import, so a failure names the chain to cut.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INGRESS_MODULES = (
    "service.serve_ingress",
    "service.direct_path",
    "service.openai_app",
    "service.tcp_feed",
    "service.place_link",
    "service.prefill_link",
    "service.callback_link",
    "service.token_feed",
    "service.ray_stream",
    # imported inside functions the replica runs: its listener's bind host (internal_host, "node": node_address)
    "service.ray_cluster",
    "kv_transfer.node_address",
)

PROBE = r"""
import importlib, sys, traceback

chains = []

class TorchWatch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not chains:
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename and f.filename != "<string>"]
            chains.append("\n".join(f"  {f.filename}:{f.lineno}: {f.line}" for f in frames))
        return None  # only watching: the import goes on, so one run shows the whole first chain

sys.meta_path.insert(0, TorchWatch())
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(f"importing {name} imported torch:\n{chains[0]}")
        sys.exit(1)
"""


def test_ingress_modules_import_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *INGRESS_MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
