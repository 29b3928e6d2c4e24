"""Kernels compiled while serving: which Triton / DeepGEMM kernels a slow step compiled.

Why: a kernel variant the warm-up (engine.execution.warmup) did not cover compiles on first use, in the middle of a request,
for seconds; the H200 runs saw a colocated service's TTFT p99 at 2.6-3.5 s with its median at 0.17 s and could not
say whether compiles were the cause. Both libraries compile into on-disk caches (Triton: one directory a variant
holding its metadata `.json`; DeepGEMM: its JIT cache), so the files that appeared since the last look name what
compiled. Listing the caches costs milliseconds: the worker looks only after a step slower than SLOW_STEP_S.

The files name a kernel, not why a new variant of it was needed. Triton builds one variant per specialisation of
its arguments (an integer's type i32 / i64, == 1, divisible by 16; a pointer's 16-byte alignment; constexprs;
num_warps / num_stages), so `VariantLog` hooks Triton's JIT (`triton.knobs.runtime.jit_cache_hook`: called on
every in-process cache miss, before the disk cache is tried) and keeps each variant's specialisation. A variant
first needed while serving is logged with the arguments in which it differs from the nearest variant of the
same kernel seen before (e.g. `b1: i32 -> i64`), which names what the warm-up has to cover.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
from dataclasses import dataclass

from engine.telemetry import metrics

log = logging.getLogger(__name__)

SLOW_STEP_S = 1.0  # a step this slow is worth a look (a compile takes seconds; a normal step, milliseconds)
MAX_DIFFS_SHOWN = 6


def cache_dirs() -> dict[str, str]:
    """kind -> the compile cache directory this process uses (where it exists)."""
    dirs = {
        "triton": os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache"),
        "deep_gemm": os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm"),
    }
    return {k: d for k, d in dirs.items() if os.path.isdir(d)}


class CompileWatch:
    """The compile caches' files at the last look; `since()` names the kernels whose files appeared after it."""

    def __init__(self, dirs: dict[str, str] | None = None, variants: VariantLog | None = None):
        self.dirs = cache_dirs() if dirs is None else dict(dirs)
        self.seen = self._files()
        self.variants = variants  # the process's VariantLog (install_variant_log), None: not watched
        self.variant_mark = len(variants.variants) if variants is not None else 0

    def new_variants(self) -> list[str]:
        """VariantLog.explain lines for the Triton variants specialised since the last look."""
        if self.variants is None or len(self.variants.variants) == self.variant_mark:
            return []
        start, self.variant_mark = self.variant_mark, len(self.variants.variants)
        return self.variants.explain(start)[: self.variant_mark - start]

    def _files(self) -> set[tuple[str, str]]:
        return {
            (kind, os.path.join(d, f))
            for kind, root in self.dirs.items()
            for d, _, files in os.walk(root)
            for f in files
        }

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


@dataclass(frozen=True)
class Variant:
    """One specialisation of a Triton kernel. spec: argument name -> its specialisation ('i32', 'i64/16',
    '*bf16/16', '=1', '=64' for constexprs, ...), with the launch options as 'num_warps' / 'num_stages'."""

    kernel: str
    spec: tuple[tuple[str, str], ...]

    def diff(self, other: Variant) -> dict[str, tuple[str, str]]:
        """argument -> (other's, this one's) where they differ."""
        mine, theirs = dict(self.spec), dict(other.spec)
        return {
            k: (theirs.get(k, "-"), mine.get(k, "-"))
            for k in dict.fromkeys([*mine, *theirs])
            if mine.get(k) != theirs.get(k)
        }


def variant_from_specialization(kernel: str, data: str) -> Variant:
    """A Variant from Triton's `specialization_data` (the JSON its JIT hook receives: signature {arg: type},
    constants and attributes keyed by argument-index paths, options)."""
    obj = json.loads(data)
    names = list(obj["signature"])
    spec = {n: str(t) for n, t in obj["signature"].items()}
    for path, value in zip(obj.get("constant_keys", []), obj.get("constant_vals", [])):
        if path and path[0] < len(names):
            spec[names[path[0]]] = f"={value.get('constexpr', value) if isinstance(value, dict) else value}"
    for path, attrs in zip(obj.get("attrs_keys", []), obj.get("attrs_vals", [])):
        if path and path[0] < len(names):
            for attr in attrs:
                if attr and attr[0] == "tt.divisibility":
                    spec[names[path[0]]] += f"/{attr[1]}"
    options = obj.get("options", {})
    for opt in ("num_warps", "num_stages"):
        if opt in options:
            spec[opt] = str(options[opt])
    return Variant(kernel, tuple(spec.items()))


class VariantLog:
    """Every Triton kernel variant this process specialised, in order (one process-wide log: `install`)."""

    def __init__(self):
        self.variants: list[Variant] = []
        self._lock = threading.Lock()

    def hook(self, *, fn=None, compile=None, **_) -> None:
        """Triton's jit_cache_hook (called on an in-process cache miss, before compiling); returns None so
        the compile goes ahead."""
        try:
            name = getattr(fn, "name", None) or "?"
            variant = variant_from_specialization(name, compile["specialization_data"])
        except (KeyError, TypeError, ValueError):  # a Triton whose hook data differs: record the name only
            variant = Variant(getattr(fn, "name", "?"), ())
        with self._lock:
            self.variants.append(variant)
        return None

    def explain(self, start: int) -> list[str]:
        """One line per variant from index `start` on: its kernel and its differences from the nearest earlier
        variant of that kernel (or that it is the kernel's first)."""
        with self._lock:
            variants = list(self.variants)
        lines = []
        for i in range(start, len(variants)):
            v = variants[i]
            earlier = [e for e in variants[:i] if e.kernel == v.kernel]
            if not earlier:
                lines.append(f"{v.kernel} (its first variant in this process)")
                continue
            diff = min((v.diff(e) for e in earlier), key=len)
            shown = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in list(diff.items())[:MAX_DIFFS_SHOWN])
            more = f" (+{len(diff) - MAX_DIFFS_SHOWN} more)" if len(diff) > MAX_DIFFS_SHOWN else ""
            lines.append(f"{v.kernel} [{shown or 'same specialisation, other options'}{more}]")
        return lines


_VARIANT_LOG: VariantLog | None = None


def install_variant_log() -> VariantLog | None:
    """Hook Triton's JIT once per process (chaining a hook already there); None where Triton has no such hook."""
    global _VARIANT_LOG
    if _VARIANT_LOG is not None:
        return _VARIANT_LOG
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = knobs.runtime
    log_ = VariantLog()
    previous = getattr(runtime, "jit_cache_hook", None)

    def hook(**kwargs):
        log_.hook(**kwargs)
        return previous(**kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook
    _VARIANT_LOG = log_
    return log_


def describe(names: dict[str, int]) -> str:
    return ", ".join(f"{n} x{c}" for n, c in sorted(names.items(), key=lambda kv: -kv[1])) or "nothing"


def note_slow_step(watch: CompileWatch | None, role: str, worker_id: str, seconds: float) -> None:
    """After each step of a serving engine (engine thread): log each Triton variant first specialised in it
    (with what differs from its nearest earlier variant); when the step took over SLOW_STEP_S, count and log the
    kernels compiled during it (`dsv4_kernel_compiles_total`). watch None (CPU engines): nothing."""
    if watch is None:
        return
    for line in watch.new_variants():
        log.warning(
            "%s %s: a kernel variant first needed while serving (step of %.2f s): %s", role, worker_id, seconds, line
        )
    if seconds <= SLOW_STEP_S:
        return
    names = watch.since()
    if names:
        metrics.KERNEL_COMPILES.labels(role, worker_id).inc(sum(names.values()))
    log.warning(
        "%s %s: a step took %.2f s; kernels compiled since the last look: %s", role, worker_id, seconds, describe(names)
    )
