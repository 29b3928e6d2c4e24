"""Kernel micro-benchmarks behind one command: `dsv4 bench kernels <op> [op flags]` (or
`python -m benchmarks.kernels <op> ...`), `--list` for the ops. Every op times through benchmarks.timing.

Each op is a module with `main(argv) -> int`; its flags and BENCHMARKS.md section are its own. `attention` and
`cache` are the `triton` op with `--only` preset to those groups.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Op:
    module: str  # under benchmarks.kernels
    summary: str
    preset: dict = field(default_factory=dict)  # keyword arguments of the module's main


OPS = {
    "triton": Op(
        "triton_decode",
        "every Triton kernel at V4-Flash decode shapes vs copy bandwidth / matmul roofs (section bench_kernels)",
    ),
    "attention": Op(
        "triton_decode",
        "the sparse attention kernels only (triton --only attention)",
        {"only": "attention", "prog": "attention"},
    ),
    "cache": Op(
        "triton_decode",
        "the cache-writing kernels only (triton --only swa_insert,indexer_query,compressor_cache)",
        {"only": "swa_insert,indexer_query,compressor_cache", "prog": "cache"},
    ),
    "indexer-prefill": Op("indexer_prefill", "indexer logits + top-k of a prefill chunk: prefill vs per-token kernel"),
    "topk": Op("topk", "the indexer's top-k: radix kernels vs torch.topk (section indexer_topk)"),
    "rope": Op("rope", "the attention output's inverse RoPE in place by rows a program and warps"),
    "mhc": Op("mhc", "mHC pre's split and long paths by token count (section mhc_pre)"),
    "moe": Op("moe", "routed MXFP4 experts: triton_kernels, Marlin, Triton vs grouped_mm (section mxfp4_moe)"),
    "moe-fp8-grouped": Op(
        "moe_fp8",
        "routed experts for prefill: FP8 through DeepGEMM's contiguous grouped GEMM vs "
        "MXFP4 through triton_kernels at 2K / 8K tokens, % of the FP8 roof",
    ),
    "fp8-gemm": Op("fp8_gemm", "V4-Flash projections in FP8 through DeepGEMM vs bf16 (section fp8_gemm)"),
    "nixl-raw": Op("nixl_raw", "NIXL READ GB/s between two processes of one machine"),
}


def listing() -> str:
    width = max(map(len, OPS))
    return "\n".join(f"{name:<{width}}  {op.summary}" for name, op in OPS.items())


USAGE = "usage: dsv4 bench kernels <op> [op flags] | --list   (<op> --help for its flags)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nops:\n{listing()}")
        return 0 if argv else 2
    if argv[0] == "--list":
        print(listing())
        return 0
    op = OPS.get(argv[0])
    if op is None:
        print(f"dsv4 bench kernels: unknown op {argv[0]!r}; ops: {', '.join(OPS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.kernels.{op.module}")
    return module.main(argv[1:], **op.preset) or 0
