"""Host time of one decode step under CUDA graphs, measured on the CPU (no GPU needed).

    .venv/bin/python scripts/profile_decode_host.py [--requests 64] [--steps 50] [--vocab 129280] [--cprofile]

Builds the built-in tiny model's EngineCore with `--requests` requests decoding, then swaps in what a graph
replay costs the host: the DecodeRunner runs in "graphs" mode with a stand-in graph whose replay does nothing
and whose static logits [slots, vocab] are random (vocab as V4's by default, so sampling and log-prob work on
the real row width). Every other part of `EngineCore.step()` runs as on the GPU: the schedule, the StepInputs,
the block-table rows, the [3, slots] input build and copy, sampling, log-probs, events and bookkeeping. Reports
the median host ms per step; `--cprofile` prints where it goes. (CPU tensors stand in for device ones, so a
device copy or sync costs what a CPU op costs here: the count of them matters more than their time.)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


class _NoopGraph:
    def replay(self) -> None:
        pass


def build(requests: int, vocab: int, temperature: float):
    """An EngineCore in graphs mode on the CPU with a stand-in graph; `requests` requests decoding."""
    import engine.execution.cuda_graphs as cg
    from engine.execution.sampling import greedy_pick
    from engine.loading.load import load_engine
    from engine.loading.make_model import make_model
    from engine.execution.sampling_params import SamplingParams

    model_dir = make_model("tiny", tempfile.mkdtemp(prefix="dsv4-host-"))
    engine = load_engine(model_dir, device="cpu", dtype="float32", max_num_seqs=requests, max_cached_tokens=1 << 16,
                         decode_mode="bucketed", prefix_cache=True)
    params = SamplingParams(max_new_tokens=1 << 10, ignore_eos=True, logprobs=True, temperature=temperature)
    g = torch.Generator().manual_seed(0)
    for _ in range(requests):
        engine.add_request(torch.randint(2, engine.cfg.vocab_size, (8,), generator=g).tolist(), params)
    while any(r.in_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    runner = engine.decode_runner
    runner.mode = "graphs"
    logits = torch.randn(max(runner.slots), vocab, generator=g)

    def capture(shape):
        inputs = cg.DecodeInputs(torch.zeros(3, shape.slots, dtype=torch.long))
        static = logits[:shape.slots]
        # what the graph computes on the device (engine.execution.cuda_graphs): no host cost per step
        greedy = greedy_pick(static) if hasattr(cg, "greedy_pick") else None
        graph = cg._Graph(inputs, _NoopGraph(), static, greedy) if greedy is not None else cg._Graph(
            inputs, _NoopGraph(), static)
        runner.graphs[shape] = graph
        return runner.graphs[shape]
    runner._capture = capture
    return engine


def time_steps(engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the bench's requests)")
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    engine = build(args.requests, args.vocab, args.temperature)
    time_steps(engine, 3)  # warm-up (the stand-in capture)
    ms = time_steps(engine, args.steps)
    print(f"host ms per decode step ({args.requests} requests, vocab {args.vocab}, temperature {args.temperature}): "
          f"median {statistics.median(ms):.3f}, min {min(ms):.3f} over {args.steps} steps")
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        time_steps(engine, args.steps)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
