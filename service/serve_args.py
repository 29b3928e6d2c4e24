"""The flags of `dsv4 serve` (and the engine-speed flags `dsv4 generate` shares) and the ServiceConfig built
from them."""

from __future__ import annotations

import argparse
import dataclasses

from dsv4_kernels.settings import settings
from engine.runtime.health import DEFAULT_STALL_TIMEOUT_S
from kv_transfer.registry import TRANSFER_CHOICES, TRANSFER_HELP
from service.ingress_guard import DEFAULT_MAX_BODY_BYTES
from service.planner import PlannerConfig, PoolBounds, parse_pool_spec
from service.service_config import ENGINE_OPTION_KEYS, ServiceConfig


def add_engine_speed_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `dsv4 generate` and `dsv4 serve` that pick GPU execution paths (default None = auto)."""
    parser.add_argument(
        "--decode-mode",
        default=None,
        choices=["auto", "eager", "graphs", "bucketed"],
        help="decode steps: auto = CUDA graphs on CUDA with exact caches, else eager",
    )
    parser.add_argument(
        "--keep-mxfp4-experts",
        action="store_true",
        default=None,
        help="keep MXFP4 routed experts packed in GPU memory (Triton MXFP4 MoE kernel)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="share of GPU memory the engine may use (default 0.90): the KV cache gets what is left "
        "after weights and an activation/CUDA-graph reserve; --max-cached-tokens overrides it",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest request (prompt + output) in tokens, at most the model's max_position_embeddings "
        "(default): bounds the minimum KV cache the start-up fit check asks for",
    )
    parser.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        default=None,
        help="do not reuse cached prompt prefixes across requests (engine.execution.prefix_cache; on by default)",
    )


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    from engine.loading.make_model import default_model_dir
    from engine.loading.model_source import local_model_dir

    engine_options = tuple((k, getattr(args, k)) for k in ENGINE_OPTION_KEYS if getattr(args, k, None) is not None)
    # A repo id is fetched here, once, before any pool starts: workers get the local snapshot path (one on
    # another node that lacks it fetches that same commit itself: engine.loading.model_source).
    return ServiceConfig(
        model_dir=local_model_dir(args.model) or default_model_dir(),
        model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        router_port=args.router_port,
        prefill_workers=args.prefill_workers.min,
        decode_workers=args.decode_workers.min,
        prefill_max_workers=args.prefill_workers.max,
        decode_max_workers=args.decode_workers.max,
        planner=planner_config(args),
        drain_timeout_s=args.drain_timeout_seconds,
        transfer=args.transfer,
        router_policy=args.router_policy,
        engine_options=engine_options,
        worker_num_cpus=args.worker_num_cpus,
        ingress_replicas=args.ingress_replicas,
        routers=getattr(args, "routers", 2),
        api_key=args.api_key or settings().api_key,
        max_body_bytes=args.max_body_bytes,
        allow_request_chat_template=args.allow_request_chat_template,
        api_docs=args.api_docs,
        metrics_host=args.metrics_host,
        drain_s=args.drain_seconds,
        router_max_queued=args.max_queued,
        router_queue_timeout_s=args.queue_timeout_seconds,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
        data_parallel_attention=getattr(args, "data_parallel_attention", False),
        prefill_tensor_parallel_size=getattr(args, "prefill_tensor_parallel_size", None),
        decode_tensor_parallel_size=getattr(args, "decode_tensor_parallel_size", None),
        worker_num_gpus=getattr(args, "worker_num_gpus", None),
        stall_timeout_s=getattr(args, "stall_timeout_seconds", DEFAULT_STALL_TIMEOUT_S),
        ready_timeout_s=getattr(args, "ready_timeout_seconds", 900.0),
    )


def pool_spec_type(flag: str):
    """An argparse type for a pool size flag: N or MIN:MAX -> PoolBounds (the error names the flag and value)."""

    def parse(text: str) -> PoolBounds:
        try:
            return parse_pool_spec(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "pool size"  # argparse names the type in its error
    return parse


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    """The elastic pools' targets and pacing (service/planner.py: PlannerConfig); unused by fixed pools."""
    d = PlannerConfig()
    g = parser.add_argument_group("elastic pools (with --prefill-workers / --decode-workers MIN:MAX)")
    g.add_argument("--planner-interval-seconds", type=float, default=d.interval_s, help="how often the planner runs")
    g.add_argument(
        "--ttft-target-seconds",
        type=float,
        default=d.ttft_target_s,
        help="p90 arrival -> first token per prefill worker",
    )
    g.add_argument(
        "--prefill-queue-tokens",
        type=int,
        default=d.prefill_queue_tokens,
        help="queued prompt tokens per prefill worker that count as full",
    )
    g.add_argument(
        "--itl-target-seconds", type=float, default=d.itl_target_s, help="p90 inter-token latency per decode worker"
    )
    g.add_argument(
        "--decode-streams", type=int, default=d.decode_streams, help="running streams per decode worker at target"
    )
    g.add_argument(
        "--kv-target", type=float, default=d.kv_target, help="KV-cache use per decode worker at target (0..1)"
    )
    g.add_argument(
        "--scale-up-cooldown-seconds", type=float, default=d.up_cooldown_s, help="after a change, before adding workers"
    )
    g.add_argument(
        "--scale-down-cooldown-seconds",
        type=float,
        default=d.down_cooldown_s,
        help="after a change, before removing one",
    )
    g.add_argument(
        "--drain-timeout-seconds",
        type=float,
        default=300.0,
        help="a worker leaving its pool: how long its streams may take to finish before they migrate",
    )


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    return dataclasses.replace(
        PlannerConfig(),
        interval_s=args.planner_interval_seconds,
        ttft_target_s=args.ttft_target_seconds,
        prefill_queue_tokens=args.prefill_queue_tokens,
        itl_target_s=args.itl_target_seconds,
        decode_streams=args.decode_streams,
        kv_target=args.kv_target,
        up_cooldown_s=args.scale_up_cooldown_seconds,
        down_cooldown_s=args.scale_down_cooldown_seconds,
    )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="model directory or Hugging Face repo id (org/name[@revision], "
        "fetched once into the HF cache); default: the built-in tiny model",
    )
    parser.add_argument("--served-model-name", default="dsv4")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8080)
    parser.add_argument("--router-port", type=int, default=0, help="gRPC router port (0 = any free port)")
    parser.add_argument(
        "--metrics-host",
        default=None,
        help="metrics listen address (default: loopback on one node, the node address on a cluster)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every /v1 route (default: $DSV4_API_KEY)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest accepted HTTP request body (413 beyond)",
    )
    parser.add_argument(
        "--allow-request-chat-template",
        action="store_true",
        help="let requests supply `chat_template` (rendered in a sandbox with a time budget)",
    )
    parser.add_argument("--api-docs", action="store_true", help="serve /docs and /openapi.json")
    parser.add_argument("--ingress-replicas", type=int, default=2, help="HTTP ingress replicas")
    parser.add_argument(
        "--routers",
        type=int,
        default=2,
        help="gRPC router replicas (they place requests; tokens stream from the decode workers to the ingress "
        "replicas): any of them places any request, so killing one loses no stream",
    )
    parser.add_argument(
        "--worker-num-cpus", type=float, default=0.25, help="Ray CPU reservation of each prefill/decode worker"
    )
    parser.add_argument(
        "--worker-num-gpus",
        type=float,
        default=None,
        help="GPUs each worker rank reserves on cuda (default 1); a fraction such as 0.5 puts a "
        "prefill and a decode worker on one GPU, each with that share of the memory budget",
    )
    parser.add_argument(
        "--ready-timeout-seconds",
        type=float,
        default=900.0,
        help="how long each start-up stage may take (workers: loading plus the warm-up that compiles "
        "every kernel before serving, minutes for a large model on a cold kernel cache)",
    )
    parser.add_argument(
        "--stall-timeout-seconds",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="a worker whose engine stays this long in one step is unhealthy: the router moves its "
        "streams and the worker is restarted (keep it well above the slowest step, a compile)",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM / Ctrl-C, how long in-flight requests may take to finish",
    )
    parser.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests that may wait at the router for a decode slot (429 beyond)",
    )
    parser.add_argument(
        "--queue-timeout-seconds", type=float, default=60.0, help="how long a request may wait there (503 after)"
    )
    parser.add_argument(
        "--prefill-workers",
        type=pool_spec_type("--prefill-workers"),
        default=PoolBounds(min=1, max=1),
        help="N (a fixed pool) or MIN:MAX (elastic: the planner grows and shrinks the pool from its queued prompt "
        "tokens and TTFT; service/pools.py)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks per prefill/decode worker: one Ray actor (one GPU on cuda) each, packed on "
        "one host by a STRICT_PACK placement group; heads and dense projections split",
    )
    parser.add_argument(
        "--prefill-tensor-parallel-size",
        type=int,
        default=None,
        help="ranks per prefill worker when it differs from --tensor-parallel-size",
    )
    parser.add_argument(
        "--decode-tensor-parallel-size",
        type=int,
        default=None,
        help="ranks per decode worker when it differs from --tensor-parallel-size",
    )
    parser.add_argument(
        "--expert-parallel", action="store_true", help="split routed experts by expert id across each worker's ranks"
    )
    parser.add_argument(
        "--data-parallel-attention",
        action="store_true",
        help="with --expert-parallel: every rank of a worker keeps the whole attention and serves its "
        "own requests and KV cache (a worker of its own to the router); only the MoE layers "
        "exchange tokens, the ranks stepping in lockstep",
    )
    parser.add_argument(
        "--decode-workers",
        type=pool_spec_type("--decode-workers"),
        default=PoolBounds(min=1, max=1),
        help="N (a fixed pool) or MIN:MAX (elastic: scaled on running streams, KV use and inter-token latency)",
    )
    add_planner_args(parser)
    parser.add_argument("--transfer", default="auto", choices=TRANSFER_CHOICES, help=TRANSFER_HELP)
    parser.add_argument(
        "--router-policy", default="cache_aware", choices=["cache_aware", "least_loaded", "round_robin"]
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-cached-tokens", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "exact", "fp8"],
        help="KV cache format of every worker (default auto: fp8 where FlashMLA decodes it, else exact rows)",
    )
    parser.add_argument(
        "--index-cache-dtype",
        default=None,
        choices=["auto", "mxfp4", "fp8"],
        help="indexer keys of an fp8 cache (default auto: FP8 on Hopper, else MXFP4)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        choices=[0, 1, 2, 3],
        help="MTP speculative decoding on the decode pool: draft K tokens a step with the checkpoint's "
        "MTP layer (0 = off). The prefill pool gets it too: it runs the MTP layer over each prompt "
        "so that layer's KV travels with the hand-off (and both pools' cache layouts match)",
    )
    parser.add_argument(
        "--prefill-expert-format",
        default=None,
        choices=["auto", "mxfp4", "fp8"],
        help="routed experts of the prefill pool (default auto: FP8 128x128 through DeepGEMM's grouped "
        "GEMM on a bf16 CUDA engine with DeepGEMM, else MXFP4); the decode pool keeps MXFP4",
    )
    add_engine_speed_args(parser)
