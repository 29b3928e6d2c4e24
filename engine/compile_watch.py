"""Kernels compiled while serving: which Triton / DeepGEMM kernels a slow step compiled.

Why: a kernel variant the warm-up (engine.warmup) did not cover compiles on first use, in the middle of a request,
for seconds; the H200 runs saw a colocated service's TTFT p99 at 2.6-3.5 s with its median at 0.17 s and could not
say whether compiles were the cause. Both libraries compile into on-disk caches (Triton: one directory a variant
holding its metadata `.json`; DeepGEMM: its JIT cache), so the files that appeared since the last look name what
compiled. Listing the caches costs milliseconds: the worker looks only after a step slower than SLOW_STEP_S.
"""

from __future__ import annotations

import collections
import json
import logging
import os

from engine import metrics

log = logging.getLogger(__name__)

SLOW_STEP_S = 1.0  # a step this slow is worth a look (a compile takes seconds; a normal step, milliseconds)


def cache_dirs() -> dict[str, str]:
    """kind -> the compile cache directory this process uses (where it exists)."""
    dirs = {"triton": os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache"),
            "deep_gemm": os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")}
    return {k: d for k, d in dirs.items() if os.path.isdir(d)}


class CompileWatch:
    """The compile caches' files at the last look; `since()` names the kernels whose files appeared after it."""

    def __init__(self, dirs: dict[str, str] | None = None):
        self.dirs = cache_dirs() if dirs is None else dict(dirs)
        self.seen = self._files()

    def _files(self) -> set[tuple[str, str]]:
        return {(kind, os.path.join(d, f)) for kind, root in self.dirs.items()
                for d, _, files in os.walk(root) for f in files}

    def since(self) -> dict[str, int]:
        """Kernel name -> variants compiled since the last look (DeepGEMM: its new files, counted as one name);
        the look becomes the new baseline."""
        now = self._files()
        new, self.seen = now - self.seen, now
        names: collections.Counter = collections.Counter()
        for kind, path in new:
            if kind == "deep_gemm":
                names["DeepGEMM kernels (files)"] += 1
            elif path.endswith(".json") and "__grp__" not in os.path.basename(path):
                try:
                    with open(path) as f:
                        names[json.load(f).get("name", "?")] += 1
                except (OSError, ValueError):
                    names["?"] += 1
        return dict(names)


def describe(names: dict[str, int]) -> str:
    return ", ".join(f"{n} x{c}" for n, c in sorted(names.items(), key=lambda kv: -kv[1])) or "nothing"


def note_slow_step(watch: CompileWatch | None, role: str, worker_id: str, seconds: float) -> None:
    """After each step of a serving engine (engine thread): when it took over SLOW_STEP_S, count and log the
    kernels compiled during it (`dsv4_kernel_compiles_total`). watch None (CPU engines): nothing."""
    if watch is None or seconds <= SLOW_STEP_S:
        return
    names = watch.since()
    if names:
        metrics.KERNEL_COMPILES.labels(role, worker_id).inc(sum(names.values()))
    log.warning("%s %s: a step took %.2f s; kernels compiled since the last look: %s", role, worker_id, seconds,
                describe(names))
