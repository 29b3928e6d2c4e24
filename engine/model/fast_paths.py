"""The one switch between the engine's reference torch ops and the Triton fast paths.

`use_triton(device)` decides per call, so a process can run both paths (tests compare them):
- CUDA tensors: on whenever triton imports (`dsv4_kernels.gpu.has_triton`);
- CPU tensors: only when forced with DSV4_TRITON=1 *and* triton's interpreter is on (TRITON_INTERPRET=1,
  set before any dsv4_kernels.triton_* import) -- slow, for tests;
- DSV4_TRITON=0 (or false/off/no) turns the fast paths off everywhere (the reference ops run on CUDA too).
Every switch here is read from `dsv4_kernels.settings` (parsed once; docs/settings.md).
The reference path is the CPU oracle the tests pin; a fast path must compute the same function.
MXFP4 experts kept packed have their own switch, `use_mxfp4_moe` ($DSV4_MXFP4_MOE, see there), and so do
the library paths: FP8 dense GEMMs through DeepGEMM (`use_fp8_gemm`, $DSV4_FP8_GEMM) and the MXFP4 MoE
through OpenAI's triton_kernels (`mxfp4_moe_backend`, $DSV4_MXFP4_MOE_BACKEND). `describe()` is the log line
naming each fast path in use and why one fell back; `fast_path_states` the same as data, and
`log_fast_paths` logs the line (a WARNING on CUDA when any path fell back).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dsv4_kernels.gpu import (
    has_deep_gemm,
    has_flash_mla,
    has_marlin_moe,
    has_triton,
    has_triton_kernels,
    triton_enabled,
    why_not,
    why_not_marlin_moe,
)
from dsv4_kernels.settings import (
    BY_NAME,
    FLASH_MLA,
    FP8_GEMM,
    MXFP4_GEMV,
    MXFP4_MOE,
    MXFP4_MOE_BACKEND,
    TRITON,
    settings,
)

ENV = TRITON
MXFP4_ENV = MXFP4_MOE
FP8_GEMM_ENV = FP8_GEMM
MOE_BACKEND_ENV = MXFP4_MOE_BACKEND
MXFP4_GEMV_ENV = MXFP4_GEMV
FLASH_MLA_ENV = FLASH_MLA
MOE_BACKENDS = BY_NAME[MOE_BACKEND_ENV].choices


def use_triton(device: torch.device | str) -> bool:
    """Should ops on `device` take the Triton kernels? See the module docstring. (Called for every layer of
    every eager step: reads the cached settings, never the environment.)"""
    setting = settings().triton
    if setting is False:
        return False
    kind = torch.device(device).type
    if kind == "cuda":
        return has_triton() and torch.cuda.is_available()
    return setting is True and triton_enabled(kind)


def use_grouped_moe(x: torch.Tensor) -> bool:
    """Routed experts as grouped GEMMs (no host sync) on CUDA; the per-expert loop reference elsewhere.

    DSV4_GROUPED_MOE=1 forces it on the CPU too (tests compare both), =0 turns it off everywhere.
    """
    from dsv4_kernels.moe import has_grouped_mm

    setting = settings().grouped_moe
    if setting is False or not has_grouped_mm():
        return False
    # On CUDA only 16-bit inputs have a native grouped kernel: fp32 falls back to a per-group loop that
    # reads the offsets on the host (slow, and it breaks CUDA-graph capture).
    return setting is True or (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))


def keep_mxfp4_experts(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Default of `load_engine(keep_mxfp4_experts=None)`: DSV4_MXFP4_MOE=1 / =0 decide; unset, keep MXFP4 experts
    packed where the fast MXFP4 MoE runs (a bf16 CUDA engine with triton_kernels; ~4x fewer expert bytes than
    bf16 and faster than the bf16 grouped GEMM there: BENCHMARKS.md mxfp4_moe), else dequantise at load."""
    setting = settings().mxfp4_moe
    if setting is not None:
        return setting
    return (
        torch.device(device).type == "cuda" and dtype == torch.bfloat16 and use_triton(device) and has_triton_kernels()
    )


def use_mxfp4_moe(device: torch.device | str) -> bool:
    """Packed MXFP4 experts on `device`: the Triton kernel (True) or the dequantise-on-the-fly reference.

    DSV4_MXFP4_MOE=0 -> reference everywhere; =1 -> the kernel wherever triton runs (CPU only under the
    interpreter); unset -> follows `use_triton`. (Only matters when the weights were kept packed.)
    """
    setting = settings().mxfp4_moe
    if setting is False:
        return False
    if setting is True:
        return triton_enabled(device)
    return use_triton(device)


def use_fp8_gemm(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """FP8 checkpoint weights kept as e4m3 + block scales and multiplied by DeepGEMM (bf16 engines on CUDA).

    DSV4_FP8_GEMM=0 turns it off (weights dequantised to the engine dtype at load, as on the CPU).
    """
    if not settings().fp8_gemm or dtype != torch.bfloat16:
        return False
    return torch.device(device).type == "cuda" and use_triton(device) and has_deep_gemm()


# Steps of at least this many tokens take the FP8 experts when an engine holds both formats ("both"); below, the
# MXFP4 backend. Not measured yet (`dsv4 bench kernels moe-fp8-grouped` times 2K and 8K): FP8 weights are 2x the
# bytes, so decode-sized steps, which read the touched experts' weights once, stay on MXFP4.
FP8_EXPERT_MIN_TOKENS = 1024
PREFILL_EXPERT_FORMATS = ("auto", "mxfp4", "fp8")


def use_fp8_expert_gemm(device: torch.device | str) -> bool:
    """FP8 routed experts through DeepGEMM's contiguous grouped GEMM (dsv4_kernels.deepgemm_moe) on `device`: CUDA
    with the Triton fast paths on and deep_gemm importable; elsewhere they run the dequantising reference."""
    return torch.device(device).type == "cuda" and use_triton(device) and has_deep_gemm()


def resolve_prefill_expert_format(
    requested: str, device: torch.device | str, dtype: torch.dtype, prefill_only: bool, packed: bool
) -> tuple[str, str]:
    """EngineOptions.prefill_expert_format -> ("mxfp4" | "fp8" | "both", why): the routed experts' formats held
    (engine.model.fp8_expert_weights). "auto" = FP8 alone on a prefill-only engine of bf16 on CUDA with DeepGEMM
    (its steps are prefill-sized: the grouped FP8 GEMM runs at FP8 tensor-core rates where bf16 x MXFP4 runs at
    bf16 ones), else MXFP4 as today. "fp8" as asked: FP8 alone on a prefill-only engine, both formats on one that
    decodes (decode-sized steps keep MXFP4). Only MXFP4 experts kept packed (`keep_mxfp4_experts`) convert."""
    if requested not in PREFILL_EXPERT_FORMATS:
        raise ValueError(f"prefill_expert_format must be one of {PREFILL_EXPERT_FORMATS}, got {requested!r}")
    if requested == "mxfp4":
        return "mxfp4", "as requested"
    if not packed:
        return "mxfp4", "routed experts not kept as MXFP4 (dequantised at load): nothing to convert"
    usable = use_fp8_expert_gemm(device) and dtype == torch.bfloat16
    if requested == "auto":
        if not prefill_only:
            return "mxfp4", "auto on an engine that decodes: MXFP4 experts"
        if not usable:
            return "mxfp4", (
                f"auto without DeepGEMM's grouped FP8 GEMM here "
                f"({why_not('deep_gemm') or 'needs a bf16 CUDA engine with deep_gemm'}): MXFP4 experts"
            )
        return "fp8", "auto on a prefill-only engine with DeepGEMM: FP8 experts (2x the MXFP4 bytes)"
    how = "" if usable else " (no DeepGEMM here: the dequantising reference runs them)"
    if prefill_only:
        return "fp8", "as requested, prefill-only: FP8 experts alone" + how
    return "both", f"as requested on an engine that decodes: FP8 for steps >= {FP8_EXPERT_MIN_TOKENS} tokens" + how


def use_flash_mla(device: torch.device | str) -> bool:
    """FlashMLA's sparse decode over fp8_ds_mla pages (engine.model.attention_fp8) on `device`: CUDA with the Triton
    fast paths on and flash_mla importable. DSV4_FLASH_MLA=0 keeps the engine's own Triton kernel."""
    if not settings().flash_mla:
        return False
    return torch.device(device).type == "cuda" and use_triton(device) and has_flash_mla()


def use_deepgemm_indexer(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """DeepGEMM's fp8_mqa_logits for the indexer's scores of prefill chunks over FP8 keys (FP8 queries:
    dsv4_kernels.deepgemm_indexer), where DeepGEMM runs the FP8 GEMMs and DSV4_INDEXER_PREFILL=deepgemm."""
    return settings().indexer_prefill == "deepgemm" and use_fp8_gemm(device, dtype)


def use_flash_mla_prefill(device: torch.device | str) -> bool:
    """FlashMLA's sparse prefill kernel for prefill and mixed steps over dequantised fp8 caches
    (engine.model.attention_fp8.dequantised_attend) on `device`: where its decode kernel is used
    (`use_flash_mla`) and DSV4_FLASH_MLA_PREFILL is on."""
    return settings().flash_mla_prefill and use_flash_mla(device)


def resolve_kv_cache_dtype(
    requested: str, device: torch.device | str, dtype: torch.dtype, head_dim: int, rope_dim: int, num_heads: int
) -> tuple[str, str]:
    """--kv-cache-dtype -> ("exact" | "fp8", why). "auto" takes the production fp8 formats (fp8_ds_mla KV,
    packed indexer keys) where FlashMLA decodes them: a bf16 CUDA engine with flash_mla and V4's attention
    geometry (head_dim 512, rope 64, <= 128 heads); exact rows in the model dtype everywhere else (the CPU
    and the test presets, whose oracle pins exact rows). "exact" and "fp8" are taken as asked.
    num_heads: the query heads one rank attends with (num_attention_heads / tensor-parallel size)."""
    if requested != "auto":
        return requested, "as requested"
    from dsv4_kernels.flashmla_sparse import HEAD_COUNTS, HEAD_DIM, ROPE_DIM

    dev = torch.device(device)
    if dev.type != "cuda":
        return "exact", "auto on a CPU: exact rows"
    if dtype != torch.bfloat16:
        return "exact", f"auto with a {str(dtype).replace('torch.', '')} engine: exact rows"
    if not use_flash_mla(dev):
        return (
            "exact",
            f"auto without FlashMLA ({why_not('flash_mla') or FLASH_MLA_ENV + '=0 or not installed'}): exact rows",
        )
    if head_dim != HEAD_DIM or rope_dim != ROPE_DIM or num_heads > max(HEAD_COUNTS):
        return "exact", (
            f"auto: heads {num_heads} x {head_dim} (rope {rope_dim}) are not FlashMLA's V4 geometry: exact rows"
        )
    return "fp8", "auto on a Hopper engine with FlashMLA: fp8_ds_mla KV + packed indexer keys"


def resolve_index_cache_dtype(requested: str, device: torch.device | str) -> tuple[str, str]:
    """--index-cache-dtype -> ("mxfp4" | "fp8", why): the indexer keys' format when the cache is fp8.
    "auto" picks per GPU: FP8 keys on Hopper (sm90), where the indexer kernels decode MXFP4 keys 2.7x slower
    than FP8 ones (BENCHMARKS.md, "Prefill indexer"; `dsv4 bench kernels indexer-prefill`) and DeepGEMM's paged
    MQA logits take only FP8 keys, at 132 B a key instead of 68 (about 10% more cache a token for V4-Flash); MXFP4
    keys, the release format, everywhere else (Blackwell's MQA logits read them natively; the CPU)."""
    if requested not in ("auto", "mxfp4", "fp8"):
        raise ValueError(f"index_cache_dtype must be auto, mxfp4 or fp8, got {requested!r}")
    if requested != "auto":
        return requested, "as requested"
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] == 9:
        return "fp8", "auto on Hopper: FP8 indexer keys (faster to score than MXFP4 there)"
    return "mxfp4", "auto: MXFP4 indexer keys (the release format)"


def mxfp4_moe_backend(device: torch.device | str) -> str:
    """Which kernel runs packed MXFP4 experts on `device`: "triton_kernels" (OpenAI's matmul with Hopper
    weight layouts), "marlin" (Marlin's W4A16 grouped GEMM, dsv4_kernels.marlin_moe), "engine"
    (dsv4_kernels.triton_moe) or "reference". $DSV4_MXFP4_MOE_BACKEND picks one; "auto" (default) takes
    triton_kernels where it imports (CUDA), else Marlin where it loads, else the engine's kernel (BENCHMARKS.md:
    Marlin ties triton_kernels at 1 and 64 decode tokens and takes twice its time at prefill sizes; both are 5-6x
    the engine kernel's bandwidth). A requested library that does not load falls back the same way."""
    if not use_mxfp4_moe(device):
        return "reference"
    want = settings().mxfp4_moe_backend  # one of MOE_BACKENDS (checked when parsed)
    if want == "engine" or torch.device(device).type != "cuda":
        return "engine"
    if want == "marlin" and has_marlin_moe():
        return "marlin"
    if has_triton_kernels():
        return "triton_kernels"
    return "marlin" if has_marlin_moe() else "engine"


def use_mxfp4_gemv(x: torch.Tensor, top_k: int) -> bool:
    """Do the routed experts of a call over x [T, H] on triton_kernels' MXFP4 layouts take the split-K GEMV
    (dsv4_kernels.triton_mxfp4_gemv) instead of triton_kernels' matmul? Only with DSV4_MXFP4_GEMV=1 (off until
    measured: the `gemv` stage of tools/gpu/stages.sh), on bf16 CUDA tensors, for at most its MAX_ROUTES routes
    (T * top_k). Host ints only: the answer is fixed per captured step size."""
    if not settings().mxfp4_gemv or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    from dsv4_kernels.triton_mxfp4_gemv import fits  # imports triton: only where the switch is on

    return fits(x.shape[0], top_k)


def describe(
    device: torch.device | str,
    dtype: torch.dtype,
    fp8_dense: bool,
    packed_experts: bool,
    ogs_fits: bool = True,
    marlin_fits: bool = True,
    fp8_experts: bool = False,
) -> str:
    """One line naming each fast path this engine uses and why any fell back (logged at model build).
    fp8_experts: the routed experts are (also) held as FP8 128x128 (engine.model.fp8_expert_weights)."""
    dev = torch.device(device)
    parts = [f"triton ops: {'on' if use_triton(dev) else 'off (' + _triton_reason(dev) + ')'}"]
    if fp8_dense:
        how = "DeepGEMM fp8_gemm_nt" if use_fp8_gemm(dev, dtype) else "reference (dequantise per call)"
        parts.append(f"dense FP8 projections: e4m3 + 128x128 scales, {how}")
    else:
        parts.append("dense projections: " + str(dtype).replace("torch.", "") + " (" + _fp8_reason(dev, dtype) + ")")
    if fp8_experts:
        how = "DeepGEMM m_grouped_fp8_gemm_nt_contiguous" if use_fp8_expert_gemm(dev) else "reference (dequantised)"
        when = f" for steps >= {FP8_EXPERT_MIN_TOKENS} tokens" if packed_experts else ""
        parts.append(f"routed experts: FP8 128x128{when}, {how}")
    if packed_experts:
        backend, note = _moe_choice(dev, ogs_fits, marlin_fits)
        parts.append(f"routed experts: packed MXFP4, {backend}{note}")
    elif not fp8_experts:
        parts.append("routed experts: dequantised, " + ("grouped GEMM" if dev.type == "cuda" else "per-expert loop"))
    return "; ".join(parts)


def _moe_choice(dev: torch.device, ogs_fits: bool, marlin_fits: bool) -> tuple[str, str]:
    """The packed experts' backend on `dev` and, when it is not the one asked for or expected, why."""
    backend = mxfp4_moe_backend(dev)
    note = ""
    want = settings().mxfp4_moe_backend
    no_ogs = f"triton_kernels unusable: {why_not('triton_kernels.matmul') or 'not installed'}"
    if want == "marlin" and backend != "marlin":
        note = f" (Marlin unusable: {why_not_marlin_moe()})"
    if backend == "marlin" and want != "marlin":
        note = f" ({no_ogs})"
    if backend == "marlin" and not marlin_fits:
        backend, note = "engine", " (widths not Marlin's tiles: hidden % 256, moe_inter % 64)"
    if backend == "triton_kernels" and not ogs_fits:
        backend, note = "engine", " (widths not in 128s: triton_kernels skipped)"
    if backend == "engine" and dev.type == "cuda" and not has_triton_kernels() and not has_marlin_moe():
        note = f" ({no_ogs}; Marlin unusable: {why_not_marlin_moe()})"
    return backend, note


@dataclass(frozen=True)
class FastPath:
    """One GPU fast path of a built engine: taken or not, and why not (for the start-up warning, the workers'
    stats and the `dsv4_fast_path_active` gauge)."""

    name: str  # "triton" | "fp8_gemm" | "flash_mla" | "mxfp4_moe" | "fp8_moe"
    active: bool
    why: str = ""  # why it fell back ("" when active)


def fast_path_states(
    device: torch.device | str,
    dtype: torch.dtype,
    fp8_dense: bool,
    packed_experts: bool,
    ogs_fits: bool = True,
    marlin_fits: bool = True,
    fp8_experts: bool = False,
) -> tuple[FastPath, ...]:
    """The fast paths that apply to this engine (FP8 GEMM only for FP8 checkpoint weights, the MoE library only
    for packed experts), each with whether it runs. Same decisions as `describe`."""
    dev = torch.device(device)
    out = [FastPath("triton", use_triton(dev), "" if use_triton(dev) else _triton_reason(dev))]
    if fp8_dense:
        on = use_fp8_gemm(dev, dtype)
        out.append(FastPath("fp8_gemm", on, "" if on else _fp8_reason(dev, dtype)))
    on = use_flash_mla(dev)
    missing = "not a CUDA engine" if dev.type != "cuda" else "flash_mla not installed"
    why = "" if on else (f"{FLASH_MLA_ENV}=0" if not settings().flash_mla else why_not("flash_mla") or missing)
    out.append(FastPath("flash_mla", on, why))
    if packed_experts:
        backend, note = _moe_choice(dev, ogs_fits, marlin_fits)
        on = backend in ("triton_kernels", "marlin")
        out.append(FastPath("mxfp4_moe", on, "" if on else f"{backend} path{note}"))
    if fp8_experts:
        on = use_fp8_expert_gemm(dev)
        out.append(FastPath("fp8_moe", on, "" if on else f"deep_gemm unusable: {why_not('deep_gemm') or 'no CUDA'}"))
    return tuple(out)


def log_fast_paths(line: str, states: tuple[FastPath, ...], device: torch.device | str) -> None:
    """The INFO line naming the paths, and on CUDA one WARNING naming each path that fell back and why: a GPU
    engine on reference ops is several times slower, and a single INFO line is too easy to miss."""
    log = logging.getLogger("dsv4.engine")
    log.info("fast paths: %s", line)
    fallen = [f"{p.name} ({p.why})" for p in states if not p.active]
    if torch.device(device).type == "cuda" and fallen:
        log.warning(
            "GPU fast paths fell back to slower code: %s. `dsv4 doctor` shows what imports and why not; "
            "`make install-gpu` installs the matching torch and kernel wheels",
            "; ".join(fallen),
        )


def _triton_reason(dev: torch.device) -> str:
    if settings().triton is False:
        return f"{ENV}=0"
    if not has_triton():
        return "triton not importable"
    return "CPU without TRITON_INTERPRET + DSV4_TRITON=1" if dev.type == "cpu" else "CUDA unavailable"


def _fp8_reason(dev: torch.device, dtype: torch.dtype) -> str:
    if not settings().fp8_gemm:
        return f"FP8 GEMM off by {FP8_GEMM_ENV}=0"
    if dev.type != "cuda":
        return "FP8 weights dequantised at load: no FP8 GEMM on the CPU"
    if dtype != torch.bfloat16:
        return f"FP8 GEMM path needs a bf16 engine, this one is {dtype}"
    if not has_deep_gemm():
        return f"deep_gemm unusable: {why_not('deep_gemm') or 'not installed'}"
    return "the checkpoint stores them unquantised"
