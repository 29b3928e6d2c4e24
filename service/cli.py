"""The `dsv4` command line: `generate`, `make-model`, `serve`, `bench serve|route|soak|elastic|kernels|slice`, `chat-render`,
`chat-parse`, `eval perplexity|tasks`."""

from __future__ import annotations

import argparse
import json
import sys

from service.bench_tree import ENTRY as TREE_BENCHES


def _parse_ids(text: str) -> list[int]:
    text = text.strip()
    if not text:
        return []
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids expects comma-separated integers, got {text!r}") from None


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate tokens for one or more prompts (one continuous batch)")
    p.add_argument(
        "--model",
        default=None,
        help="model directory or Hugging Face repo id (org/name[@revision], "
        "fetched once into the HF cache); default: the built-in tiny model",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", type=_parse_ids, action="append", help="comma-separated token ids; repeatable")
    src.add_argument("--prompt", action="append", help="text prompt (needs a tokenizer); repeatable")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", action="store_true")
    p.add_argument("--prompt-logprobs", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "exact", "fp8"],
        help="KV cache format: fp8 = the production formats (fp8_ds_mla SWA / compressed KV, MXFP4 "
        "indexer keys), exact = rows in --dtype; auto = fp8 where FlashMLA decodes it (bf16 on a "
        "Hopper GPU with V4's attention geometry), else exact",
    )
    p.add_argument(
        "--index-cache-dtype",
        default="auto",
        choices=["auto", "mxfp4", "fp8"],
        help="indexer keys of an fp8 cache: auto = FP8 on Hopper (faster to score there), else MXFP4",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks of one engine (this process is rank 0 and spawns the others; gloo on cpu, "
        "NCCL on cuda with one GPU a rank): attention heads and dense projections split",
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="split routed experts by expert id across the tensor-parallel ranks",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="MTP speculative decoding: draft K tokens a step with the checkpoint's MTP layer and verify "
        "them in one target step (greedy requests; 0 = off); steps run eagerly",
    )
    p.add_argument(
        "--data-parallel-attention",
        action="store_true",
        help="with --expert-parallel: each rank keeps the whole attention and runs its share of the "
        "prompts (its own KV cache); only the MoE layers exchange tokens",
    )
    from service.launcher import add_engine_speed_args

    add_engine_speed_args(p)


def _add_make_model(sub) -> None:
    p = sub.add_parser("make-model", help="write a random DeepSeek V4 checkpoint")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", action="store_true", help="FP8 dense weights and MXFP4 experts")
    p.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        help="add N random MTP draft layers (mtp.{i}.*, num_nextn_predict_layers: N) for speculative "
        "decoding; the main model's weights are unchanged",
    )


def _generate(args) -> int:
    from engine.execution.sampling_params import SamplingParams
    from engine.llm import LLM
    from engine.loading.make_model import default_model_dir
    from engine.loading.model_source import local_model_dir
    from engine.loading.tokenizer import load_tokenizer

    model_dir = local_model_dir(args.model) or default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"model {model_dir!r} has no tokenizer: use --prompt-ids")
        prompts = [tokenizer.encode(text) for text in args.prompt]
    else:
        prompts = args.prompt_ids
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )
    llm = LLM(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        max_batch_tokens=args.max_batch_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        index_cache_dtype=args.index_cache_dtype,
        keep_mxfp4_experts=args.keep_mxfp4_experts,
        decode_mode=args.decode_mode,
        prefix_cache=args.prefix_cache is not False,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        data_parallel_attention=args.data_parallel_attention,
        speculative_tokens=args.speculative_tokens,
    )
    with llm:  # releases the other ranks
        outs = llm.generate(prompts, params)
    for out in outs:
        if args.json:
            print(
                json.dumps(
                    {
                        "token_ids": out.token_ids,
                        "logprobs": out.logprobs,
                        "prompt_logprobs": out.prompt_logprobs,
                        "finish_reason": out.finish_reason,
                        "cached_tokens": out.cached_tokens,
                        "drafted_tokens": out.drafted_tokens,
                        "accepted_tokens": out.accepted_tokens,
                    }
                )
            )
        else:
            text = tokenizer.decode(out.token_ids) if tokenizer is not None else ""
            print(f"{out.token_ids} {text!r} ({out.finish_reason})")
    return 0


def _make_model(args) -> int:
    from engine.loading.make_model import make_model

    path = make_model(args.preset, args.out, seed=args.seed, quantize=args.quantize, mtp_layers=args.mtp_layers)
    print(path or args.out)
    return 0


def _add_serve(sub) -> None:
    from service.launcher import add_serve_args

    add_serve_args(sub.add_parser("serve", help="run the disaggregated service (Ray, gRPC router, OpenAI HTTP)"))


def _add_bench(sub) -> None:
    from service.bench_serve import add_bench_serve_args

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    add_bench_serve_args(bench.add_parser("serve", help="concurrent clients against 1P1D, 2P2D and colocated"))
    from service.bench_route import add_bench_route_args, add_make_trace_args

    add_bench_route_args(
        bench.add_parser(
            "route", help="replay a Mooncake trace against the routing policies and a model of the workers' caches"
        )
    )
    add_make_trace_args(bench.add_parser("make-trace", help="write a synthetic Mooncake-format trace"))
    from service.bench_frontdoor import add_bench_frontdoor_args

    add_bench_frontdoor_args(
        bench.add_parser(
            "frontdoor",
            help="streamed tokens/s, added latency and CPU through "
            "the ingress, router and Serve proxy (synthetic pool)",
        )
    )
    from service.bench_elastic import add_bench_elastic_args

    add_bench_elastic_args(
        bench.add_parser(
            "elastic",
            help="elastic pools under a burst on the real service: pool sizes over time, failed requests",
        )
    )
    from service.bench_soak import add_bench_soak_args

    add_bench_soak_args(
        bench.add_parser(
            "soak", help="mixed load with worker kills for N minutes: errors by type, /health latency, memory growth"
        )
    )
    # Listed for --help only: main() hands `bench kernels|slice ...` to service.bench_tree before parsing.
    bench.add_parser("kernels", help="kernel micro-benchmarks: `dsv4 bench kernels <op> ...`, --list (source tree)")
    bench.add_parser("slice", help="V4-Flash-slice decode/prefill vs rooflines on one GPU (source tree)")
    bench.add_parser(
        "spec",
        help="MTP speculative decoding on the V4-Flash slice: verify-step time, tok/s per user "
        "at forced acceptance rates (source tree)",
    )
    bench.add_parser(
        "quality", help="bits/byte, |dlogprob|, greedy agreement of each production format on the trained model"
    )


def _add_chat(sub) -> None:
    p = sub.add_parser("chat-render", help="print the prompt text the server tokenises for a chat request")
    p.add_argument("--request", required=True, help="a /v1/chat/completions request body (JSON file)")
    p.add_argument(
        "--model",
        default=None,
        help="model directory or Hugging Face repo id (default: the built-in tiny model's format)",
    )
    p = sub.add_parser("chat-parse", help="parse a completion text (stdin) into content, reasoning, tool calls")
    p.add_argument("--thinking", action="store_true", help="the prompt opened a thought (thinking mode)")
    p.add_argument("--model", default=None, help="model directory or Hugging Face repo id (must be DeepSeek V4)")


def _write_stdout(text: str) -> None:
    sys.stdout.flush()
    sys.stdout.buffer.write(text.encode("utf-8"))  # exact bytes: no newline added, no locale encoding
    sys.stdout.buffer.flush()


def _chat_render(args) -> int:
    from pydantic import ValidationError

    from engine.loading.model_source import local_model_dir
    from service import chat_v4
    from service.openai_protocol import ChatCompletionRequest

    args.model = local_model_dir(args.model, with_weights=False)
    with open(args.request, encoding="utf-8") as fh:
        body = json.load(fh)
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # the server's 400
        raise ValueError(f"invalid request {args.request!r}: {e}") from None
    if args.model is not None and not req.chat_template:
        from engine.loading.tokenizer import load_tokenizer

        tok = load_tokenizer(args.model)
        if not chat_v4.uses_v4_encoding(args.model, tok):
            if tok is None or not tok.chat_template:
                raise ValueError(f"model {args.model!r} has no tokenizer or chat format")
            req.chat_template = tok.chat_template
    if req.chat_template:  # a Jinja template, as the server renders it
        from engine.loading.tokenizer import load_tokenizer
        from service.openai_protocol import render_chat

        tok = load_tokenizer(args.model) if args.model else None
        bos, eos = (
            (tok.tokenizer.id_to_token(i) if i is not None else "" for i in (tok.bos_id, tok.eos_id))
            if tok
            else ("", "")
        )
        _write_stdout(render_chat(req, req.chat_template, bos, eos))
        return 0
    _write_stdout(chat_v4.render(req).text)
    return 0


def _chat_parse(args) -> int:
    from engine.loading.model_source import local_model_dir
    from service import chat_v4

    args.model = local_model_dir(args.model, with_weights=False)
    if args.model is not None and not chat_v4.is_v4_model(args.model):
        raise ValueError(f"model {args.model!r} is not DeepSeek V4 (config.json model_type / architectures)")
    text = sys.stdin.buffer.read().decode("utf-8")
    _write_stdout(json.dumps(chat_v4.parse_output(text, args.thinking), ensure_ascii=False) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in TREE_BENCHES:  # each op parses its own flags
        from service.bench_tree import bench_tree_main

        return bench_tree_main(argv[1], argv[2:])
    parser = argparse.ArgumentParser(prog="dsv4", description="DeepSeek V4 inference service")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_make_model(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_chat(sub)
    from service.eval_cli import add_eval_args

    add_eval_args(sub.add_parser("eval", help="model quality through the engine: perplexity (bits per byte), tasks"))
    from service.doctor import add_doctor_args

    add_doctor_args(
        sub.add_parser(
            "doctor",
            help="print the environment: Python, torch, GPUs, kernel libraries, NIXL, Ray (version, token auth), gRPC",
        )
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "make-model":
            return _make_model(args)
        if args.command == "serve":
            from service.launcher import serve_main

            return serve_main(args)
        if args.command == "chat-render":
            return _chat_render(args)
        if args.command == "chat-parse":
            return _chat_parse(args)
        if args.command == "eval":
            from service.eval_cli import eval_main

            return eval_main(args)
        if args.command == "doctor":
            from service.doctor import doctor_main

            return doctor_main(args)
        if args.command == "bench" and args.bench_command in ("route", "make-trace"):
            from service.bench_route import bench_route_main, make_trace_main

            return bench_route_main(args) if args.bench_command == "route" else make_trace_main(args)
        if args.command == "bench" and args.bench_command == "elastic":
            from service.bench_elastic import bench_elastic_main

            return bench_elastic_main(args)
        if args.command == "bench" and args.bench_command == "frontdoor":
            from service.bench_frontdoor import bench_frontdoor_main

            return bench_frontdoor_main(args)
        if args.command == "bench" and args.bench_command == "soak":
            from service.bench_soak import bench_soak_main

            return bench_soak_main(args)
        if args.command == "bench":
            from service.bench_serve import bench_serve_main

            return bench_serve_main(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dsv4 {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
