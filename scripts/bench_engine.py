#!/usr/bin/env python
"""CPU throughput of our engine vs transformers' `generate`, same checkpoint, same run (not a test).

For each preset of `engine.loading.make_model.PRESETS` asked for (default: tiny, small) and each batch size
(default: 1, 16): `batch` random prompts of `--prompt-len` tokens, greedy, EOS ignored.

- prefill tokens/s: batch * prompt_len / time until every request has its first generated token;
- decode tokens/s:  batch * new_tokens / time from there to the last token.
Both come from one generate call of 1+new_tokens split where every request has its first token; each
number is the median of `--repeats` runs after a short warm-up. transformers loads the same directory with
`DeepseekV4ForCausalLM.from_pretrained` (it maps DeepSeek's original tensor names itself) and runs its
own cached `generate` (fp32, eager attention). Note: transformers' cached decode is not numerically
trustworthy on CSA layers (see ../shared/docs/deepseek_v4.md, "Oracle pitfalls"); only its speed is used here, and
the "first" column checks that both pick the same first token (that one comes from a full prefill).

Prints a table and writes (or replaces) the `bench_engine` section of BENCHMARKS.md.
Default run: well under 5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from service.benchmarks_md import write_section  # noqa: E402



def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def _timed_runs(run, repeats: int) -> tuple[float, float, list[int]]:
    """run() -> (prefill_s, decode_s, first tokens); one short warm-up, then the median of `repeats`."""
    run(warmup=True)
    results = [run(warmup=False) for _ in range(repeats)]
    return _median([r[0] for r in results]), _median([r[1] for r in results]), results[-1][2]


def bench_ours(model_dir: str, prompts: list[list[int]], new_tokens: int, repeats: int, max_batch_tokens: int):
    """Drives the engine's step loop (what LLM.generate does) and splits the wall time at the step where
    the last request got its first token: before = prefill (incl. that first sample), after = decode."""
    from engine.llm import LLM
    from engine.execution.sampling_params import SamplingParams

    llm = LLM(model_dir=model_dir, device="cpu", dtype="float32", max_batch_tokens=max_batch_tokens)
    eng = llm.engine

    def run(warmup: bool):
        n = 2 if warmup else 1 + new_tokens
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        ids = [eng.add_request(list(p), params) for p in prompts]
        waiting, t_first, first = set(ids), None, {}
        while eng.has_work:
            for ev in eng.step():
                if ev.token_id is not None and ev.request_id in waiting:
                    waiting.discard(ev.request_id)
                    first[ev.request_id] = ev.token_id
            if t_first is None and not waiting:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        for rid in ids:
            eng.pop_finished(rid)
        return t_first - t0, t_end - t_first, [first[r] for r in ids]

    return _timed_runs(run, repeats)


def load_hf(model_dir: str):
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers did not map the DeepSeek names: the comparison would be meaningless
        raise RuntimeError(f"transformers could not load {model_dir}: missing {missing[:8]}")
    return model.eval()


def bench_hf(model, prompts: list[list[int]], new_tokens: int, repeats: int):
    """transformers' generate with a streamer that timestamps each step: the first put() is the prompt,
    the second the first new token (end of prefill), the last one the end of decode."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.stamps = []

        def put(self, value):
            self.stamps.append(time.perf_counter())

        def end(self):
            pass

    ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding needed
    mask = torch.ones_like(ids)

    @torch.no_grad()
    def run(warmup: bool):
        n = 2 if warmup else 1 + new_tokens
        clock = Clock()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, streamer=clock)
        s = clock.stamps
        assert len(s) == n + 1, len(s)
        return s[1] - t0, s[-1] - s[1], out[:, ids.shape[1]].tolist()

    return _timed_runs(run, repeats)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{platform.platform()}; {cpu}; {os.cpu_count()} CPUs ({affinity} usable); "
            f"torch threads {torch.get_num_threads()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(REPO / "BENCHMARKS.md"), help="markdown file to update ('' = none)")
    args = ap.parse_args(argv)

    import transformers

    from engine.loading.make_model import PRESETS, make_model

    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        ap.error(f"unknown preset(s) {unknown}; known: {sorted(PRESETS)}")
    batches = [int(b) for b in args.batches.split(",") if b]

    rows = []
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-") as tmp:
        for preset in presets:
            model_dir = make_model(preset, os.path.join(tmp, preset), seed=args.seed)
            vocab = PRESETS[preset]["vocab_size"]
            hf = load_hf(model_dir)
            for batch in batches:
                g = torch.Generator().manual_seed(args.seed + batch)
                prompts = torch.randint(2, vocab, (batch, args.prompt_len), generator=g).tolist()
                o_pre, o_dec, o_first = bench_ours(model_dir, prompts, args.new_tokens, args.repeats,
                                                   args.max_batch_tokens)
                h_pre, h_dec, h_first = bench_hf(hf, prompts, args.new_tokens, args.repeats)
                n_pre, n_dec = batch * args.prompt_len, batch * args.new_tokens
                row = dict(
                    preset=preset, batch=batch,
                    ours_prefill=n_pre / o_pre, hf_prefill=n_pre / h_pre,
                    ours_decode=n_dec / o_dec, hf_decode=n_dec / h_dec,
                    first=f"{sum(a == b for a, b in zip(o_first, h_first))}/{batch}",
                )
                rows.append(row)
                print(_fmt_row(row), flush=True)
            del hf
    elapsed = time.perf_counter() - t_start

    command = "python scripts/bench_engine.py" + ("" if argv is None and len(sys.argv) == 1 else
                                                 " " + shlex.join(sys.argv[1:] if argv is None else argv))
    table = _table(rows)
    meta = [
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- machine: {machine()}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
        f"- workload: prompt {args.prompt_len} tokens, {args.new_tokens} decode tokens, greedy, fp32 CPU, "
        f"engine max_batch_tokens {args.max_batch_tokens}, median of {args.repeats} runs after a warm-up; "
        f"total bench time {elapsed:.0f} s; 1-min load average {load_before:.2f} before, "
        f"{os.getloadavg()[0] if hasattr(os, 'getloadavg') else float('nan'):.2f} after "
        "(other processes on the machine skew the numbers)",
        "- one generate of 1+new tokens per run, split at the moment every request has its first token: "
        "prefill tok/s = batch x prompt / time to that point; decode tok/s = batch x new / the rest "
        "(ours: the engine's step loop; transformers: `generate` with a timestamping streamer); "
        "ratio = ours / transformers; `first` = requests whose first generated token agrees",
    ]
    print()
    print(table)
    print(f"\n(total {elapsed:.0f} s)")
    if args.output:
        _update_markdown(Path(args.output), meta, table)
        print(f"updated {args.output}")
    return 0


def _fmt_row(r) -> str:
    return (f"{r['preset']:>6} batch {r['batch']:>3}: prefill ours {r['ours_prefill']:9.1f} tok/s  "
            f"hf {r['hf_prefill']:9.1f} tok/s  x{r['ours_prefill'] / r['hf_prefill']:.2f} | decode ours "
            f"{r['ours_decode']:8.1f} tok/s  hf {r['hf_decode']:8.1f} tok/s  x{r['ours_decode'] / r['hf_decode']:.2f}"
            f" | first {r['first']}")


def _table(rows) -> str:
    head = ("| preset | batch | prefill ours (tok/s) | prefill transformers (tok/s) | ratio | "
            "decode ours (tok/s) | decode transformers (tok/s) | ratio | first |")
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['batch']} | {r['ours_prefill']:.0f} | {r['hf_prefill']:.0f} | "
            f"{r['ours_prefill'] / r['hf_prefill']:.2f} | {r['ours_decode']:.0f} | {r['hf_decode']:.0f} | "
            f"{r['ours_decode'] / r['hf_decode']:.2f} | {r['first']} |")
    return "\n".join(lines)


def _update_markdown(path: Path, meta: list[str], table: str) -> None:
    write_section("bench_engine", "\n".join(["## Engine vs transformers (CPU, fp32): `scripts/bench_engine.py`", "",
                                             *meta, "", table]), path)


if __name__ == "__main__":
    sys.exit(main())
