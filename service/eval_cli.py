"""`dsv4 eval perplexity|tasks`: a model's quality on text, through the engine (the same path that serves).

    dsv4 eval perplexity --file F [--file F2 ...] [--model M] [--window 1024] [--json]   (JSON: bits_per_byte)
    dsv4 eval tasks --file F [...] [--model M] [--json]                                  (JSON: exact_match)

Give held-out files (text the model never saw): for dsv4-mini-py, any Python source outside its training split.
--device / --dtype / --kv-cache-dtype choose the engine path, so each production format can be measured against
exact fp32 on the same model. --url http://host:8000 scores through a running `dsv4 serve` instead (the same
requests over /v1/completions; --model then names the local dir whose tokenizer the service uses).
"""

from __future__ import annotations

import contextlib
import json


def add_eval_args(parser) -> None:
    sub = parser.add_subparsers(dest="eval_command", required=True)
    for name, help_text in (
        ("perplexity", "bits per byte of the given files (prompt logprobs)"),
        ("tasks", "exact-match completion of Python idioms found in the given files"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--file", action="append", required=True, help="a text file (repeatable)")
        p.add_argument("--model", default=None, help="model dir or repo id (default: the built-in model)")
        p.add_argument("--json", action="store_true")
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--kv-cache-dtype", default="auto")
        p.add_argument("--max-batch-tokens", type=int, default=2048)
        p.add_argument("--url", default=None, help="score through a running service's OpenAI API instead")
        p.add_argument("--served-model", default="dsv4", help="the model name the service answers to (--url)")
        p.add_argument("--api-key", default=None, help="the service's --api-key (--url)")
        if name == "perplexity":
            p.add_argument("--window", type=int, default=1024, help="tokens a request scores (after BOS)")
        else:
            p.add_argument("--context", type=int, default=1024, help="prompt tokens kept before the cut")
            p.add_argument("--per-idiom", type=int, default=3, help="tasks of each idiom a file, at most")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def eval_main(args) -> int:
    from engine.llm import LLM
    from engine.loading.make_model import default_model_dir
    from engine.loading.model_source import local_model_dir
    from engine.loading.tokenizer import load_tokenizer

    model_dir = local_model_dir(args.model) or default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"model {model_dir!r} has no tokenizer.json: text cannot be scored")
    texts = {path: _read(path) for path in args.file}
    model: contextlib.AbstractContextManager
    if args.url:
        from service.eval_http import HttpModel

        model = contextlib.nullcontext(HttpModel(args.url, args.served_model, args.api_key))
    else:
        model = LLM(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            max_batch_tokens=args.max_batch_tokens,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    with model as llm:
        if args.eval_command == "perplexity":
            from service.eval_perplexity import perplexity

            result = perplexity(llm, tokenizer, list(texts.values()), args.window).as_dict()
            line = (
                f"{result['bits_per_byte']:.4f} bits/byte ({result['nats_per_token']:.4f} nats/token) over "
                f"{result['bytes']} bytes, {result['tokens']} tokens, {result['texts']} file(s)"
            )
        else:
            from service.eval_tasks import find_tasks, score

            tasks = [t for path, text in texts.items() for t in find_tasks(path, text, args.per_idiom)]
            result = score(llm, tokenizer, tasks, args.context).as_dict()
            line = f"exact match {result['correct']}/{result['tasks']} = {result['exact_match']:.3f}"
    result["model"] = args.url or model_dir
    print(json.dumps(result) if args.json else line)
    return 0
