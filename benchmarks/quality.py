"""`dsv4 bench quality`: what each production format costs in quality, on the trained dsv4-mini-py.

Every format is one engine (one subprocess each, so the `DSV4_*` switches a format sets apply from the start) that
scores the same held-out text and completes the same prompts:
- bits per byte of held-out stdlib files (`training.corpus`: files the model never saw), from prompt logprobs in
  windows of --window tokens after BOS (service.eval_perplexity's windows);
- mean |dlogprob| per token against the reference format's prompt logprobs, and the share within 0.1;
- greedy continuations (--gen-tokens after the first --gen-context tokens of each file): the share identical to the
  reference's, and the mean length of the common prefix;
- exact match on the completion tasks cut from the same files (service.eval_tasks).
The reference is exact fp32 (rows in fp32, weights dequantised); each other row names what it changes. `--url`
adds a row scored through a running `dsv4 serve` (e.g. the disaggregated service): prompt logprobs and greedy
continuations over /v1/completions, the same windows and prompts.

The tolerance (stated, not tuned): a format passes when its bits per byte is within TOLERANCE_BPB of the
exact-bf16 row's on the same device (the reference row itself, for fp32 formats), and a speculative row must give
the greedy tokens of its non-speculative twin; anything else is flagged in the table as a finding.
On the CPU the rows a CPU runs: fp32/bf16 exact, the fp8 KV formats and the FP8 GEMMs through their plain-torch
references (the numerics the GPU kernels are tested to match), speculative decoding. On CUDA every row, including
each MXFP4 expert backend and the FP8 prefill experts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

TOLERANCE_BPB = 0.01  # bits per byte (~0.6% of the model's 1.58): a larger change is a finding
MODEL = "models/dsv4-mini-py"


@dataclass(frozen=True)
class Format:
    """One row: engine options (engine.loading.load.EngineOptions fields) and `DSV4_*` switches."""

    name: str
    options: dict
    env: dict = field(default_factory=dict)
    cuda_only: bool = False
    twin: str | None = None  # a speculative row: the non-speculative row whose greedy tokens it must give


EXACT = dict(kv_cache_dtype="exact", keep_fp8_weights=False, keep_mxfp4_experts=False, prefix_cache=False)
BF16 = dict(EXACT, dtype="bfloat16")
MXFP4 = dict(BF16, keep_mxfp4_experts=True)
PRODUCTION = dict(dtype="bfloat16", kv_cache_dtype="fp8", prefix_cache=False)  # fp8 KV + FP8 GEMMs + MXFP4 auto
FORMATS = (
    Format("exact fp32 (reference)", dict(EXACT, dtype="float32")),
    Format("exact bf16", BF16),
    Format("bf16 + fp8 KV cache (MXFP4 index keys)", dict(BF16, kv_cache_dtype="fp8", index_cache_dtype="mxfp4")),
    Format("bf16 + fp8 KV cache (FP8 index keys)", dict(BF16, kv_cache_dtype="fp8", index_cache_dtype="fp8")),
    Format("bf16 + FP8 GEMMs", dict(BF16, keep_fp8_weights=True)),
    Format("bf16 + MXFP4 experts: triton_kernels", MXFP4, {"DSV4_MXFP4_MOE_BACKEND": "triton_kernels"}, True),
    Format("bf16 + MXFP4 experts: Marlin", MXFP4, {"DSV4_MXFP4_MOE_BACKEND": "marlin"}, True),
    Format("bf16 + MXFP4 experts: our Triton kernel", MXFP4, {"DSV4_MXFP4_MOE_BACKEND": "engine"}, True),
    Format("bf16 + FP8 prefill experts", dict(MXFP4, prefill_expert_format="fp8"), cuda_only=True),
    Format("production (fp8 KV, FP8 GEMMs, MXFP4 experts)", PRODUCTION, cuda_only=True),
    Format("production + MTP K=1", dict(PRODUCTION, speculative_tokens=1), cuda_only=True, twin="production"),
    # exact in fp32 (token for token); in bf16 a verify step's shapes round differently from a one-token step's
    Format(
        "exact fp32 + MTP K=1",
        dict(EXACT, dtype="float32", speculative_tokens=1),
        cuda_only=True,
        twin="exact fp32 (reference)",
    ),
    Format("bf16 + MTP K=1", dict(BF16, speculative_tokens=1), twin="exact bf16"),
    Format("bf16 + MTP K=2", dict(BF16, speculative_tokens=2), twin="exact bf16"),
)


@dataclass(frozen=True)
class Texts:
    """The held-out material every row scores: windows (BOS + ids) and greedy prompts, token ids."""

    files: list
    n_bytes: int
    windows: list
    prompts: list
    tasks: list  # service.eval_tasks.Task as dicts


def held_out_texts(tokenizer, n_files: int, window: int, gen_context: int, per_idiom: int) -> Texts:
    """The first `n_files` held-out stdlib files of at least 2 KB, in path order (deterministic)."""
    from service.eval_perplexity import windows_of
    from service.eval_tasks import find_tasks
    from training.corpus import list_files, read_text

    files, n_bytes, windows, prompts, tasks = [], 0, [], [], []
    for f in list_files():
        if len(files) == n_files:
            break
        text = read_text(f.path) if f.heldout else None
        if text is None or len(text) < 2048:
            continue
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        files.append(f.rel)
        n_bytes += len(text.encode("utf-8"))
        windows += [[tokenizer.bos_id, *w] for w in windows_of(ids, window)]
        prompts.append([tokenizer.bos_id, *ids[:gen_context]])
        tasks += [asdict(t) for t in find_tasks(f.rel, text, per_idiom)]
    if not files:
        raise ValueError("no held-out stdlib file found (training.corpus.list_files)")
    return Texts(files, n_bytes, windows, prompts, tasks)


def score_one(model, tokenizer, texts: Texts, gen_tokens: int, context: int) -> dict:
    """Run one format's `model` (LLM or service.eval_http.HttpModel) over `texts` -> the row's raw results."""
    from engine.execution.sampling_params import SamplingParams
    from service.eval_tasks import Task, score

    t0 = time.perf_counter()
    scored = model.generate(
        texts.windows, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    )
    logprobs = [list(out.prompt_logprobs[1:]) for out in scored]
    greedy = model.generate(texts.prompts, SamplingParams(max_new_tokens=gen_tokens, temperature=0.0, ignore_eos=True))
    tasks = score(model, tokenizer, [Task(**t) for t in texts.tasks], context)
    drafted = sum(getattr(o, "drafted_tokens", 0) or 0 for o in greedy)
    accepted = sum(getattr(o, "accepted_tokens", 0) or 0 for o in greedy)
    return dict(
        logprobs=logprobs,
        greedy=[list(o.token_ids) for o in greedy],
        exact_match=tasks.exact_match,
        tasks=tasks.tasks,
        drafted=drafted,
        accepted=accepted,
        seconds=time.perf_counter() - t0,
    )


def run_format(args, fmt: Format) -> dict:
    """Load `fmt`'s engine in this process and score it."""
    from engine.llm import LLM
    from engine.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    texts = held_out_texts(tokenizer, args.files, args.window, args.gen_context, args.per_idiom)
    with LLM(args.model, device=args.device, max_batch_tokens=args.max_batch_tokens, **fmt.options) as llm:
        return score_one(llm, tokenizer, texts, args.gen_tokens, args.context)


def run_in_subprocess(args, fmt: Format) -> dict | str:
    """One format in a fresh interpreter (its DSV4_* switches set from the start) -> results, or why it failed."""
    cmd = [sys.executable, "-m", "benchmarks.quality", "--one", fmt.name, *_passthrough(args)]
    env = dict(os.environ, **fmt.env)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        last = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or ["(no stderr)"]
        return f"failed (rc {proc.returncode}): {last[0][:200]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _passthrough(args) -> list[str]:
    return [
        f"--model={args.model}",
        f"--device={args.device}",
        f"--files={args.files}",
        f"--window={args.window}",
        f"--gen-context={args.gen_context}",
        f"--gen-tokens={args.gen_tokens}",
        f"--context={args.context}",
        f"--per-idiom={args.per_idiom}",
        f"--max-batch-tokens={args.max_batch_tokens}",
    ]


def compare(row: dict, ref: dict, n_bytes: int) -> dict:
    """A row's figures against the reference's: bits per byte, |dlogprob|, greedy agreement."""
    import math

    nll = -sum(sum(w) for w in row["logprobs"])
    diffs = [abs(a - b) for rw, fw in zip(row["logprobs"], ref["logprobs"]) for a, b in zip(rw, fw)]
    same, prefix = 0, 0
    for a, b in zip(row["greedy"], ref["greedy"]):
        same += a == b
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += common
    n = max(1, len(ref["greedy"]))
    return dict(
        bits_per_byte=nll / math.log(2) / n_bytes,
        mean_abs_dlogprob=sum(diffs) / max(1, len(diffs)),
        within_0_1=sum(d <= 0.1 for d in diffs) / max(1, len(diffs)),
        greedy_identical=same / n,
        greedy_common_prefix=prefix / n,
    )


def table(args, texts: Texts, results: dict) -> str:
    ref = results[FORMATS[0].name]
    if isinstance(ref, str):
        raise RuntimeError(f"the reference row did not run: {ref}")
    compared = {name: compare(row, ref, texts.n_bytes) for name, row in results.items() if not isinstance(row, str)}
    base_bpb = compared.get("exact bf16", compared[FORMATS[0].name])["bits_per_byte"]
    rows = []
    for name, row in results.items():
        if isinstance(row, str):
            rows.append(f"| {name} | {row} | | | | | | |")
            continue
        c = compared[name]
        verdict = _verdict(name, c, row, results, base_bpb)
        acc = f"{row['accepted'] / row['drafted']:.0%}" if row.get("drafted") else ""
        rows.append(
            f"| {name} | {c['bits_per_byte']:.4f} | {c['mean_abs_dlogprob']:.4f} | {c['within_0_1']:.1%} | "
            f"{c['greedy_identical']:.0%} ({c['greedy_common_prefix']:.1f}) | {row['exact_match']:.3f} | {acc} | "
            f"{verdict} |"
        )
    head = (
        f"Command: `dsv4 bench quality --device {args.device} --files {args.files} --window {args.window}"
        f"{' --url ' + args.url if args.url else ''} --write`. Machine: {_machine(args.device)}. Model "
        f"{args.model} (the trained 10M-parameter V4 in its release formats). Text: {len(texts.files)} held-out stdlib "
        f"files ({texts.n_bytes} bytes, {sum(len(w) - 1 for w in texts.windows)} tokens in {len(texts.windows)} windows "
        f"of <= {args.window}), {len(texts.prompts)} greedy prompts of {args.gen_context} tokens + {args.gen_tokens} "
        f"new, {len(texts.tasks)} completion tasks. Columns against exact fp32: |dlogprob| per prompt token (mean, "
        f"share <= 0.1), greedy continuations identical (mean common prefix in tokens). Verdict: bits/byte within "
        f"{TOLERANCE_BPB} of exact bf16 (of the reference for fp32 rows); a speculative fp32 row must also give its "
        "non-speculative twin's greedy tokens (in bf16 a verify's K+1-row shapes round differently: counted, not "
        "failed)."
    )
    return "\n".join(
        [
            f"## Quality by format on the trained dsv4-mini-py ({args.device})",
            "",
            head,
            "",
            "| format | bits/byte | mean abs dlogprob | within 0.1 | greedy identical (prefix) | exact match | "
            "MTP acceptance | verdict |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )


def _verdict(name: str, c: dict, row: dict, results: dict, base_bpb: float) -> str:
    fmt = next((f for f in FORMATS if f.name == name), None)
    findings, notes = [], []
    if abs(c["bits_per_byte"] - base_bpb) > TOLERANCE_BPB:
        findings.append(f"FINDING: bits/byte {c['bits_per_byte'] - base_bpb:+.4f} against exact bf16")
    if fmt is not None and fmt.twin:
        twin = next((v for k, v in results.items() if k.startswith(fmt.twin) and not isinstance(v, str)), None)
        if twin is not None and twin["greedy"] != row["greedy"]:
            if fmt.options.get("dtype") == "float32":
                findings.append("FINDING: greedy tokens differ from its non-speculative twin")
            else:
                differ = sum(a != b for a, b in zip(twin["greedy"], row["greedy"]))
                # a verify step runs K+1 rows a request where the twin runs one: its matmuls round in another order,
                # so reduced-precision argmaxes at near-ties may flip; speculation's exactness is the fp32 row's test
                notes.append(
                    f"greedy differs from its twin in {differ} of {len(row['greedy'])} prompts: "
                    f"{fmt.options.get('dtype', 'bf16')} rounding of the verify's shapes; exact in fp32"
                )
    verdict = "; ".join(findings) or "pass"
    return f"{verdict} ({'; '.join(notes)})" if notes else verdict


def _machine(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dsv4 bench quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--formats", default=None, help="comma-separated prefixes of row names (default: all that run)")
    ap.add_argument("--files", type=int, default=8, help="held-out files scored")
    ap.add_argument("--window", type=int, default=512, help="tokens a scored window holds after BOS")
    ap.add_argument("--gen-context", type=int, default=128, help="prompt tokens of a greedy continuation")
    ap.add_argument("--gen-tokens", type=int, default=32, help="tokens a greedy continuation generates")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens kept for a completion task")
    ap.add_argument("--per-idiom", type=int, default=2, help="completion tasks of each idiom a file, at most")
    ap.add_argument("--max-batch-tokens", type=int, default=4096)
    ap.add_argument("--url", default=None, help="also score a running service (its row: 'service at URL')")
    ap.add_argument("--url-label", default=None, help="the service row's name: what the service runs")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="a format's subprocess")
    ap.add_argument("--out", default=None, help="also write the markdown section to this file")
    ap.add_argument("--write", action="store_true", help="put the section into BENCHMARKS.md")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one format, print JSON
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one is not None:
        fmt = next((f for f in FORMATS if f.name == args.one), None)
        if fmt is None:
            raise ValueError(f"unknown format {args.one!r}")
        print(json.dumps(run_format(args, fmt)))
        return 0
    from engine.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer.json")
    texts = held_out_texts(tokenizer, args.files, args.window, args.gen_context, args.per_idiom)
    cuda = args.device.startswith("cuda")
    wanted = [p.strip() for p in args.formats.split(",")] if args.formats else None
    chosen = [f for f in FORMATS if (cuda or not f.cuda_only) and (wanted is None or _matches(f.name, wanted))]
    if FORMATS[0] not in chosen:
        chosen.insert(0, FORMATS[0])  # the reference every row is compared with
    results: dict = {}
    for fmt in chosen:
        print(f"... {fmt.name}", file=sys.stderr, flush=True)
        results[fmt.name] = run_in_subprocess(args, fmt)
        # each row as it ends: a run cut short by its limit keeps the rows it finished (in its log)
        print(f"    {json.dumps(results[fmt.name], default=str)[:2000]}", file=sys.stderr, flush=True)
    if args.url:
        from service.eval_http import HttpModel

        results[args.url_label or f"service at {args.url}"] = score_one(
            HttpModel(args.url), tokenizer, texts, args.gen_tokens, args.context
        )
    body = table(args, texts, results)
    print(body)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(body + "\n")
    if args.write:
        from service.benchmarks_md import write_section

        if not cuda:
            write_section("quality_cpu", body)
        elif args.url:  # the service's row and the engine rows it is read against, beside the table of every format
            write_section("quality_cuda_service", body.replace("## Quality by format", "## Quality of the service"))
        else:
            write_section("quality_cuda", body)
    return 0


def _matches(name: str, wanted: list[str]) -> bool:
    return any(name.startswith(w) for w in wanted)


if __name__ == "__main__":
    sys.exit(main())
