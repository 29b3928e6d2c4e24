"""Test-wide settings: thread count, markers by area, and the rule that CI skips only GPU-only tests.

The suite runs tiny models on a 2-core CI machine, often next to Ray workers and gRPC servers started by
other tests: one intra-op thread avoids the spin-wait contention that makes tiny ops 10x slower.

Markers (registered in pyproject.toml) say what a test needs: `gpu` (a CUDA device), `nixl` (the NIXL
package, host memory is enough), `ray` (a local Ray cluster), `triton` (compiled on a GPU, else the
interpreter), `prometheus` (Debian's promtool / prometheus, installed by `make tools`). Files are marked by
their area below, so a new test in such a file is marked without remembering to.

With DSV4_STRICT_SKIPS=1 (set by .ci/run) a skipped test fails the session unless it is GPU-only (marked
`gpu`, or skipped with a reason starting "GPU only"): the CI machine can run NIXL on host memory, Ray, the
Triton interpreter and promtool, so a skip there means a broken environment that would otherwise hide.

`DSV4_*` switches are parsed once and cached (dsv4_kernels.settings): the `monkeypatch` fixture here is pytest's,
except that setting or deleting a `DSV4_*` variable, and its undo, make the next `settings()` parse again.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a dsv4_kernels.triton_* module is imported.
# Set it here, before any test module's imports (their import order is ruff's to sort), not in each test module
# (tests/support/triton_env.py still skips a module where Triton cannot run). The engine's CPU paths never take
# the interpreter on their own: DSV4_TRITON=1 does that (engine.model.fast_paths.use_triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# HAProxy's stats page and exporter on free ports (service.serve_front): a test's front door must not fail to start
# because the last test's HAProxy still holds the fixed defaults while it exits.
os.environ.setdefault("DSV4_HAPROXY_STATS_PORT", "0")
os.environ.setdefault("DSV4_HAPROXY_METRICS_PORT", "0")

from dsv4_kernels import settings as switches  # noqa: E402

torch.set_num_threads(1)

# Path fragment -> markers of every test collected from a matching file.
AREA_MARKERS = {
    "tests/kernels/test_triton_": ("triton",),
    "tests/engine/test_fast_paths.py": ("triton",),
    "tests/engine/test_gpu_engine.py": ("gpu",),
    "tests/service/test_service_ray.py": ("ray", "nixl"),
    "tests/deploy/test_deploy_prometheus_e2e.py": ("prometheus", "ray"),
    "tests/deploy/test_deploy_dashboards.py": ("prometheus",),
    "tests/deploy/test_deploy_serve_entry.py": ("ray",),
}
GPU_ONLY_PREFIX = "GPU only"
_forbidden_skips: list[str] = []


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.replace("\\", "/")
        for fragment, names in AREA_MARKERS.items():
            if path.startswith(fragment) or f"/{fragment}" in path:
                for name in names:
                    item.add_marker(getattr(pytest.mark, name))
        if "nixl" in item.nodeid.split("[")[-1]:  # parametrised over transfer backends
            item.add_marker(pytest.mark.nixl)


def _strict() -> bool:
    return switches.settings().strict_skips


class SettingsMonkeyPatch(pytest.MonkeyPatch):
    """pytest's MonkeyPatch whose DSV4_* setenv / delenv / undo drop the cached settings (parsed again, so a bad
    value raises where the test reads it)."""

    def setenv(self, name: str, value: str, prepend: str | None = None) -> None:
        super().setenv(name, value, prepend)
        if name.startswith(switches.PREFIX):
            switches.settings.cache_clear()

    def delenv(self, name: str, raising: bool = True) -> None:
        super().delenv(name, raising)
        if name.startswith(switches.PREFIX):
            switches.settings.cache_clear()

    def undo(self) -> None:
        super().undo()
        switches.settings.cache_clear()


@pytest.fixture
def monkeypatch():
    """Overrides pytest's fixture of that name (see SettingsMonkeyPatch)."""
    patch = SettingsMonkeyPatch()
    yield patch
    patch.undo()


@pytest.fixture(autouse=True)
def _fused_prologue_stays_on():
    """engine.model.prologue_check turns the fused prologue off for the process when it disagrees with the torch
    reference, and returns the reference's batch: a test comparing derive_decode_batch / derive_verify_batch with the
    reference would then pass on a wrong kernel. A test that leaves it off fails here (one that turns it off on
    purpose patches its state back), and the state is reset for the next test."""
    yield
    check = sys.modules.get("engine.model.prologue_check")
    reason = check.fused_prologue_off() if check is not None else None
    if reason is not None:
        check.turn_back_on()
        pytest.fail(f"the fused step prologue disagreed with its torch reference: {reason}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _allowed(report, keywords) -> bool:
    reason = _skip_reason(report).removeprefix("Skipped: ")
    return "gpu" in keywords or reason.startswith(GPU_ONLY_PREFIX)


def pytest_runtest_logreport(report):
    if report.skipped and _strict() and not _allowed(report, report.keywords):
        _forbidden_skips.append(f"{report.nodeid}: {_skip_reason(report)}")


def pytest_collectreport(report):
    # A module-level skip (`pytest.skip(..., allow_module_level=True)`) is a collect report.
    if report.skipped and _strict() and not _allowed(report, {}):
        _forbidden_skips.append(f"{report.nodeid}: {_skip_reason(report)}")


def pytest_terminal_summary(terminalreporter):
    if _forbidden_skips:
        terminalreporter.section("skips the CI machine must not have (DSV4_STRICT_SKIPS=1)", red=True)
        for line in _forbidden_skips:
            terminalreporter.line(line)


def pytest_sessionfinish(session, exitstatus):
    if _forbidden_skips and session.exitstatus == 0:
        session.exitstatus = 1
