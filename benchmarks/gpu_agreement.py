"""Greedy tokens of the GPU engine vs the CPU fp32 engine (a CUDA machine; its bounds are asserted by
tests/engine/test_gpu_cpu_agreement.py, this writes the BENCHMARKS.md table).

For each preset and GPU dtype, prints:
- free-running agreement: generated positions before the first divergence from the CPU run, over all
  generated positions (a divergence ends the count: the contexts differ after it);
- teacher-forced agreement: at every generated position, the GPU engine is given the CPU run's prefix
  (prompt + CPU tokens so far) and its greedy token is compared with the CPU's: the share of positions
  where the greedy choice is the same, which is what "greedy tokens on >= 95% of positions" asks;
- the same restricted to decided positions: where the CPU run's top-1 / top-2 log-prob gap is at least
  NEAR_TIE nats (random tiny models put 5-15% of positions within 0.02-0.05 nats, below bf16 noise);
- mean / max |logprob| difference over the positions before the first divergence.
The GPU engine runs with its defaults (Triton fast paths, CUDA-graph decode).
Writes the table, with the run's own near-tie counts, to BENCHMARKS.md section `check_gpu_engine`
(`--no-write` to only print).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile

import torch

import engine.execution.runner
from engine.execution.sampling_params import SamplingParams
from engine.llm import LLM
from engine.loading.make_model import make_model
from service.benchmarks_md import write_section

NEAR_TIE = 0.05
PROMPT_LENS = (5, 33, 130, 300)


def top2_gaps(llm: LLM, seqs: list[list[int]]) -> list[float]:
    """CPU top-1 minus top-2 log-prob of the next token after each sequence (one batch).

    The engine's API returns only the sampled token's log-prob, so this wraps EngineCore._postprocess for
    the duration of the call to read the logits rows it samples from.
    """
    gaps: dict[str, float] = {}
    original = engine.execution.runner.EngineCore._postprocess

    def spy(self, chunks, logits, sample_rows, prompt_rows):
        for c, r in zip(chunks, sample_rows):
            if r is not None:
                top = torch.log_softmax(logits[r].float(), -1).topk(2).values
                gaps[c.request.request_id] = float(top[0] - top[1])
        return original(self, chunks, logits, sample_rows, prompt_rows)

    engine.execution.runner.EngineCore._postprocess = spy
    try:
        ids = [llm.engine.add_request(s, SamplingParams(max_new_tokens=1, ignore_eos=True)) for s in seqs]
        while llm.engine.has_work:
            llm.engine.step()
        for rid in ids:
            llm.engine.pop_finished(rid)
    finally:
        engine.execution.runner.EngineCore._postprocess = original
    return [gaps[rid] for rid in ids]


def free_running(cpu, gpu) -> tuple[int, int, list[float]]:
    agree = total = 0
    diffs = []
    for c, g in zip(cpu, gpu):
        total += len(c.token_ids)
        for i, (a, b) in enumerate(zip(c.token_ids, g.token_ids)):
            if a != b:
                break
            agree += 1
            diffs.append(abs(c.logprobs[i] - g.logprobs[i]))
    return agree, total, diffs


def forced_sequences(prompts, cpu) -> tuple[list[list[int]], list[int]]:
    """Every (prompt + CPU tokens before position i) and the CPU's token at i."""
    seqs, want = [], []
    for p, c in zip(prompts, cpu):
        for i, t in enumerate(c.token_ids):
            seqs.append(list(p) + list(c.token_ids[:i]))
            want.append(t)
    return seqs, want


def teacher_forced(llm: LLM, seqs, want, gaps) -> tuple[float, float]:
    """-> (share of positions where the GPU's greedy token is the CPU's, the same over decided positions)."""
    outs = llm.generate(seqs, SamplingParams(max_new_tokens=1, ignore_eos=True))
    same = [o.token_ids[0] == t for o, t in zip(outs, want)]
    decided = [s for s, g in zip(same, gaps) if g >= NEAR_TIE]
    return sum(same) / len(same), sum(decided) / max(1, len(decided))


def measure(preset: str, tokens: int, g: torch.Generator, dtypes=("float32", "bfloat16")) -> tuple[list[dict], str]:
    """One preset: the CPU fp32 run, then each GPU dtype against it -> (one row a dtype, the near-tie note)."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, logprobs=True)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        make_model(preset, d, seed=1)
        cpu_llm = LLM(d, device="cpu", dtype="float32")
        vocab = cpu_llm.config.vocab_size
        prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
        cpu = cpu_llm.generate(prompts, params)
        seqs, want = forced_sequences(prompts, cpu)
        gaps = top2_gaps(cpu_llm, seqs)
        note = (
            f"{preset}: {sum(x < NEAR_TIE for x in gaps)} of {len(gaps)} CPU positions are near-ties "
            f"(top-2 gap < {NEAR_TIE} nats), {sum(x < 0.02 for x in gaps)} below 0.02 nats"
        )
        del cpu_llm
        for dtype in dtypes:
            llm = LLM(d, device="cuda", dtype=dtype, max_num_seqs=256, max_cached_tokens=1 << 17)
            gpu = llm.generate(prompts, params)
            agree, total, diffs = free_running(cpu, gpu)
            forced, decided = teacher_forced(llm, seqs, want, gaps)
            dl = torch.tensor(diffs or [0.0])
            rows.append(
                {
                    "preset": preset,
                    "dtype": dtype,
                    "decode": llm.engine.decode_mode,
                    "free": agree / total,
                    "forced": forced,
                    "decided": decided,
                    "mean": dl.mean().item(),
                    "max": dl.max().item(),
                }
            )
            del llm
    return rows, note


def row_line(r: dict) -> str:
    return (
        f"| {r['preset']} | {r['dtype']} | {r['decode']} | {r['free']:.3f} | {r['forced']:.3f} "
        f"| {r['decided']:.3f} | {r['mean']:.2e} | {r['max']:.2e} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_agreement", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    g = torch.Generator().manual_seed(0)
    lines = [
        f"| preset | dtype | decode | free-running agreement | teacher-forced agreement | teacher-forced, "
        f"CPU gap >= {NEAR_TIE} | mean abs dlogprob | max abs dlogprob |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    notes = []
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(lines[0], lines[1], sep="\n")
    for preset in args.presets.split(","):
        rows, note = measure(preset, args.tokens, g)
        notes.append(note)
        print(note, flush=True)
        for r in rows:
            lines.append(row_line(r))
            print(lines[-1], flush=True)
    if not args.no_write:
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        head = [
            "## GPU engine vs CPU fp32 engine: `python -m benchmarks.gpu_agreement`",
            "",
            f"`python -m benchmarks.gpu_agreement {shlex.join(argv)}` on {torch.cuda.get_device_name()} "
            f"(torch {torch.__version__}), {when}; {len(PROMPT_LENS)} prompts of 5-300 tokens, {args.tokens} "
            "greedy tokens each. Free-running: positions before each prompt's first divergence from the CPU run; "
            "teacher-forced: the GPU engine's greedy token given the CPU run's prefix; decided: the same over "
            f"positions whose CPU top-1/top-2 gap is >= {NEAR_TIE} nats.",
            "",
        ]
        write_section("check_gpu_engine", "\n".join(head + lines + [""] + [f"- {n}" for n in notes]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
