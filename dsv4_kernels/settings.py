"""Every `DSV4_*` environment switch: declared once here, typed, parsed once per process.

Code reads a switch as `settings.current().triton` (`from dsv4_kernels import settings`): a frozen `Settings`,
one field a variable. Nothing else reads `DSV4_*` from the environment (tests/test_settings.py fails if code
does); code that *sets* one for a child process (a Ray runtime env, a subprocess) still writes os.environ.

The first `current()` parses every `DSV4_*` variable set, by one rule:
- empty or unset: the default;
- booleans: 1 / true / on / yes or 0 / false / off / no, any case;
- whole numbers: decimal digits, at least the stated minimum;
- choices: one of the listed words, any case;
- JSON: a JSON object.
A bad value raises ValueError naming the variable, the value and what it accepts, at the first read of any
switch (so every process fails on it, not only the one that reads that switch). A `DSV4_*` name declared
nowhere here is logged once as a warning with the closest declared name. The parse is kept for the life of the
process: one that changes its environment afterwards calls `reload()` (in tests, the `monkeypatch` fixture of
tests/conftest.py does so whenever it sets or restores a DSV4_ name).

This module imports only the standard library, so every layer (and the service's processes) may import it.
docs/settings.md is generated from the declarations below: `python -m dsv4_kernels.settings --write docs/settings.md`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dsv4.settings")

PREFIX = "DSV4_"
TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Spec:
    """How one variable is read. kind: "bool", "int", "choice", "json" or "str". read_by: where it acts."""

    env: str
    kind: str
    help: str
    read_by: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    accepted: str = ""  # what the error names as accepted, where the generated words would not say enough
    secret: bool = False  # never shown (a credential)

    def accepts(self) -> str:
        if self.accepted:
            return self.accepted
        if self.kind == "bool":
            return "a boolean: " + " / ".join(TRUE) + " or " + " / ".join(FALSE)
        if self.kind == "int":
            return "a whole number" + ("" if self.minimum is None else f" >= {self.minimum}")
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "json":
            return "a JSON object"
        return "any text"

    def parse(self, raw: str) -> Any:
        """The value of a set, non-empty variable (already stripped); ValueError naming it when it is bad."""
        value = raw.lower()
        if self.kind == "bool":
            if value in TRUE:
                return True
            if value in FALSE:
                return False
        elif self.kind == "int":
            if raw.isdigit() and raw.isascii() and (self.minimum is None or int(raw) >= self.minimum):
                return int(raw)
            if raw.startswith("-") and raw[1:].isdigit() and raw.isascii() and self.minimum is None:
                return int(raw)
        elif self.kind == "choice":
            if value in self.choices:
                return value
        elif self.kind == "json":
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                return parsed
        else:
            return raw
        raise ValueError(f"{self.env}={raw!r} is not valid: expected {self.accepts()} "
                         f"(empty or unset: the default)")


def _setting(env: str, default: Any, kind: str, help: str, read_by: str, **kw: Any) -> Any:
    return field(default=default, metadata={"spec": Spec(PREFIX + env, kind, help, read_by, **kw)})


KERNELS, ENGINE, TRANSFER, SERVICE = "dsv4_kernels", "engine", "kv_transfer", "service"
BENCH, TESTS, DEPLOY = "benchmarks / scripts", "tests", "deploy (Helm chart)"


@dataclass(frozen=True)
class Settings:
    """The parsed switches. None where the default is decided by the code that reads it (named in its help)."""

    # ---- kernels -------------------------------------------------------------------------------------------
    hc_split_max_tokens: int = _setting(
        "HC_SPLIT_MAX_TOKENS", 256, "int", "mHC pre with fp32 residual streams: the longest step that takes the "
        "split kernels; longer steps take the long path (triton_mhc.split_max_tokens). Read at import.",
        KERNELS, minimum=0)
    hc_split_max_tokens_bf16: int = _setting(
        "HC_SPLIT_MAX_TOKENS_BF16", 1 << 30, "int", "The same for bf16 residual streams (default: every step "
        "splits). Read at import.", KERNELS, minimum=0)
    hc_long_path: str = _setting(
        "HC_LONG_PATH", "rows", "choice", "mHC pre's long path after the fp32 matmul: `rows` (whole-row collapse, "
        "triton_mhc_rows) or `token` (one program a token). Read at import.", KERNELS, choices=("rows", "token"))
    ogs_constraints: dict | None = _setting(
        "OGS_CONSTRAINTS", None, "json", "triton_kernels' opt-flag constraints for every MXFP4 MoE call, replacing "
        "mxfp4_ogs's decode and prefill choices (`{}` = triton_kernels' own heuristics). Unset: mxfp4_ogs's.",
        KERNELS)

    # ---- engine: fast paths ---------------------------------------------------------------------------------
    triton: bool | None = _setting(
        "TRITON", None, "bool", "The Triton fast paths. Unset: on for CUDA tensors where triton imports, off on "
        "the CPU; true also forces them onto CPU tensors under TRITON_INTERPRET=1 (tests); false: the torch "
        "reference ops everywhere (engine.model.fast_paths.use_triton).", ENGINE)
    mxfp4_moe: bool | None = _setting(
        "MXFP4_MOE", None, "bool", "Packed MXFP4 experts. Unset: kept packed on a bf16 CUDA engine with "
        "triton_kernels and run by a kernel where triton runs; true: kept packed and run by the kernel wherever "
        "triton runs; false: dequantised at load, the reference op everywhere.", ENGINE)
    mxfp4_moe_backend: str = _setting(
        "MXFP4_MOE_BACKEND", "auto", "choice", "The kernel for packed MXFP4 experts on CUDA: `auto` takes "
        "triton_kernels, else Marlin, else the engine's own kernel; a named library that does not load falls "
        "back the same way.", ENGINE, choices=("auto", "triton_kernels", "marlin", "engine"))
    fp8_gemm: bool = _setting(
        "FP8_GEMM", True, "bool", "FP8 checkpoint weights kept as e4m3 and multiplied by DeepGEMM (bf16 CUDA "
        "engines with deep_gemm); false dequantises them at load.", ENGINE)
    flash_mla: bool = _setting(
        "FLASH_MLA", True, "bool", "FlashMLA's sparse decode over fp8_ds_mla pages where it imports; false keeps "
        "the engine's Triton kernel (and --kv-cache-dtype auto then picks exact rows).", ENGINE)
    grouped_moe: bool | None = _setting(
        "GROUPED_MOE", None, "bool", "Dequantised routed experts as grouped GEMMs. Unset: on CUDA for 16-bit "
        "inputs; true also on the CPU (tests compare both); false: the per-expert loop everywhere.", ENGINE)
    fp32_residual: bool = _setting(
        "FP32_RESIDUAL", True, "bool", "mHC's residual streams in fp32 in 16-bit engines; false keeps them in the "
        "model dtype, as the transformers reference does.", ENGINE)
    tp_backend: str | None = _setting(
        "TP_BACKEND", None, "choice", "The torch.distributed backend of a tensor-parallel group. Unset: gloo on "
        "the CPU, NCCL on CUDA; `gloo` on CUDA lets ranks share one GPU (a check, not for serving).", ENGINE,
        choices=("gloo", "nccl"))

    # ---- engine: start-up -----------------------------------------------------------------------------------
    warmup: str = _setting(
        "WARMUP", "1", "choice", "Start-up warm-up of a one-rank CUDA engine: `1` everything, `quick` without the "
        "DeepGEMM sweep over M classes, `0` none (engine.execution.warmup).", ENGINE, choices=("1", "quick", "0"))
    warmup_procs: int | None = _setting(
        "WARMUP_PROCS", None, "int", "Processes compiling the warm-up's GEMM sweep side by side (<= 1: in this "
        "process). Unset: half the CPUs this process may use, at most 8.", ENGINE, minimum=0)
    overlap_decode: bool | None = _setting(
        "OVERLAP_DECODE", None, "bool", "Launch the next decode step before the host reads the last one "
        "(engine.execution.decode_overlap). Unset: on with CUDA graphs; an explicit overlap_decode= wins.",
        ENGINE)
    load_progress: bool | None = _setting(
        "LOAD_PROGRESS", None, "bool", "The checkpoint load's progress bar / log lines. Unset: on, except under "
        "pytest.", ENGINE)
    home: str = _setting(
        "HOME", "~/.cache/dsv4", "str", "Where the built-in tiny model is built on first use (`<home>/tiny`).",
        ENGINE)

    # ---- KV transfer ----------------------------------------------------------------------------------------
    nixl_staging_bytes: int | None = _setting(
        "NIXL_STAGING_BYTES", None, "int", "Bytes of the NIXL backend's staging arena when staging_bytes= is not "
        "given (0 = no staging). Unset: room for one request as long as the pool holds, capped.", TRANSFER,
        minimum=0, accepted="a whole number of bytes >= 0, as the staging_bytes option (0 = no staging)")
    nixl_progress_delay_us: int | None = _setting(
        "NIXL_PROGRESS_DELAY_US", None, "int", "The NIXL agent's progress-thread delay in microseconds. Unset: "
        "kv_transfer.nixl_backend.DEFAULT_PROGRESS_DELAY_US.", TRANSFER, minimum=0)

    # ---- service --------------------------------------------------------------------------------------------
    api_key: str | None = _setting(
        "API_KEY", None, "str", "The API key every /v1 route requires (`Authorization: Bearer KEY`) when "
        "--api-key is not given; the Helm chart sets it from a Secret. Unset: the API is open.", SERVICE,
        secret=True)
    api_docs: bool = _setting(
        "API_DOCS", False, "bool", "Serve the interactive API docs (/docs, /redoc, /openapi.json); "
        "`dsv4 serve --api-docs` sets it for the Serve replicas.", SERVICE)

    # ---- benchmarks and scripts -----------------------------------------------------------------------------
    transformers_source: str | None = _setting(
        "TRANSFORMERS_SOURCE", None, "str", "Where the transformers baseline came from, for the benchmark "
        "report (set by the slice benchmark's shell runner).", BENCH)
    bench_command: str | None = _setting(
        "BENCH_COMMAND", None, "str", "The command line the benchmark report names (set by the slice "
        "benchmark's shell runner).", BENCH)
    bench_site: str | None = _setting(
        "BENCH_SITE", None, "str", "Read by the slice benchmark's shell runner only: the directory it installs "
        "the transformers baseline into (default /tmp/dsv4_bench_site).", BENCH)

    # ---- tests ----------------------------------------------------------------------------------------------
    strict_skips: bool = _setting(
        "STRICT_SKIPS", False, "bool", "A skipped test that is not GPU-only fails the session (.ci/run sets it).",
        TESTS)
    test_transfer: str = _setting(
        "TEST_TRANSFER", "nixl", "str", "The KV transfer backend of tests/service/test_service_ray.py's service.",
        TESTS)
    test_mark: str | None = _setting(
        "TEST_MARK", None, "str", "A marker tests/service/test_service_shutdown.py puts in a service's "
        "environment to find every process it left behind; no code acts on it.", TESTS)

    # ---- deploy ---------------------------------------------------------------------------------------------
    role: str | None = _setting(
        "ROLE", None, "str", "Set by the Helm chart on every Ray container (its role: head or a worker group); "
        "no code acts on it.", DEPLOY)
    model_repo: str | None = _setting(
        "MODEL_REPO", None, "str", "Read by the chart's model-download init container only: the Hub repository.",
        DEPLOY)
    model_revision: str | None = _setting(
        "MODEL_REVISION", None, "str", "Read by the chart's model-download init container only: the revision.",
        DEPLOY)
    model_dir: str | None = _setting(
        "MODEL_DIR", None, "str", "Read by the chart's model-download init container only: where the model goes.",
        DEPLOY)


def specs() -> dict[str, tuple[str, Spec, Any]]:
    """env name -> (Settings field name, its Spec, its default), in declaration order."""
    return {f.metadata["spec"].env: (f.name, f.metadata["spec"], f.default) for f in dataclasses.fields(Settings)}


_SPECS = specs()
_current: Settings | None = None
_warned: set[str] = set()


def parse(environ: Any = None) -> Settings:
    """Settings from `environ` (default os.environ); see the module docstring for the rules."""
    environ = os.environ if environ is None else environ
    values = {}
    for env, (name, spec, _) in _SPECS.items():
        raw = environ.get(env)
        if raw is not None and raw.strip():
            values[name] = spec.parse(raw.strip())
    for env in sorted(k for k in environ if k.startswith(PREFIX) and k not in _SPECS):
        if env not in _warned:
            _warned.add(env)
            near = difflib.get_close_matches(env, _SPECS, n=1)
            log.warning("%s is not a dsv4 setting and is ignored%s (all of them: docs/settings.md)", env,
                        f"; did you mean {near[0]}?" if near else "")
    return Settings(**values)


def current() -> Settings:
    """This process's settings, parsed from its environment at the first call (after `reload()`, the next)."""
    global _current
    if _current is None:
        _current = parse()
    return _current


def reload() -> None:
    """Forget the parse: the next `current()` reads the environment again (after a process changes it)."""
    global _current
    _current = None


def active() -> list[tuple[str, str]]:
    """[(name, value)] of the DSV4_* variables set in this process, credentials masked (for diagnostics)."""
    out = []
    for env in sorted(k for k in os.environ if k.startswith(PREFIX)):
        spec = _SPECS[env][1] if env in _SPECS else None
        out.append((env, "(set, hidden)" if spec is not None and spec.secret else os.environ[env]))
    return out


def _kind_text(spec: Spec) -> str:
    if spec.kind == "bool":
        return "boolean"
    if spec.kind == "int":
        return "whole number" + ("" if spec.minimum is None else f" >= {spec.minimum}")
    if spec.kind == "choice":
        return " / ".join(f"`{c}`" for c in spec.choices)
    return {"json": "JSON object", "str": "text"}[spec.kind]


def _default_text(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, int) and default >= 1 << 20 and (default & (default - 1)) == 0:
        return f"2^{default.bit_length() - 1}"
    return f"`{default}`"


def markdown() -> str:
    """docs/settings.md: the rules and one table of every variable."""
    lines = [
        "# Settings: the `DSV4_*` environment variables",
        "",
        "Generated from `dsv4_kernels/settings.py` by `python -m dsv4_kernels.settings --write docs/settings.md`;",
        "edit the declarations there, not this file (tests/test_settings.py checks the two agree).",
        "",
        "Code reads them only through `dsv4_kernels.settings.current()`, which parses them once per process.",
        "Empty or unset takes the default. Booleans are " + " / ".join(f"`{v}`" for v in TRUE) + " or",
        " / ".join(f"`{v}`" for v in FALSE) + ", choices any case. A bad value stops the process with an error",
        "naming the variable and what it accepts; a `DSV4_*` name not listed here is logged as a warning and",
        "ignored.",
        "",
        "| Variable | Type | Default | Read by | What it does |",
        "|---|---|---|---|---|",
    ]
    for env, (_, spec, default) in _SPECS.items():
        lines.append(f"| `{env}` | {_kind_text(spec)} | {_default_text(default)} | {spec.read_by} | "
                     f"{spec.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write"] and len(argv) == 2:
        with open(argv[1], "w") as f:
            f.write(markdown())
        return 0
    if argv:
        print("usage: python -m dsv4_kernels.settings [--write PATH]  (no argument: print the table)",
              file=sys.stderr)
        return 2
    print(markdown(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
