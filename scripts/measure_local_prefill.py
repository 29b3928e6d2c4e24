"""Where conditional disaggregation pays: prefill of the uncached part on the decode worker vs the KV transfer
it saves. Writes the `local_prefill` section of BENCHMARKS.md.

For contexts of L tokens it measures, on the engine this script loads (`--device`, `--dtype`):
- transfer(L): one request's whole cache pulled through a real kv_transfer backend (`--transfer`, tcp by
  default: what a CPU deployment uses) between two engines of this process;
- prefill(u): the first-token time of a request whose first L - u tokens the decode engine's prefix cache
  holds (so it computes u tokens), median of `--repeats`.
The crossover u* (the largest u with prefill(u) <= transfer(L)) is the `local_prefill_tokens` threshold at
which prefilling on the decode worker costs that worker no more time than the transfer takes: below it the
request skips the transfer and loses nothing. It depends on the device, model and network: rerun it on the
deployment (`RoutingPolicy`'s `local_prefill_tokens` stays 0 = off until set).

    .venv/bin/python scripts/measure_local_prefill.py [--device cpu] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.loading.load import load_engine  # noqa: E402
from engine.execution.sampling_params import SamplingParams  # noqa: E402
from kv_transfer.registry import make_backend  # noqa: E402
from service.benchmarks_md import write_section  # noqa: E402

FIRST = SamplingParams(max_new_tokens=1, ignore_eos=True)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def _run(engine) -> None:
    while engine.has_work:
        engine.step()


def transfer_s(opts: dict, kind: str, length: int, repeats: int) -> tuple[float, int]:
    """Median seconds (and bytes) to pull one `length`-token request's caches."""
    src_eng, dst_eng = load_engine(prefix_cache=False, **opts), load_engine(prefix_cache=False, **opts)
    src = make_backend(kind, src_eng.pool, on_release=lambda rid, err: src_eng.release(rid))
    dst = make_backend(kind, dst_eng.pool)
    times, size = [], 0
    try:
        dst.add_peer(src.worker_name, src.metadata())
        for r in range(repeats):
            prompt = _prompt(length, r, src_eng.cfg.vocab_size)
            params = SamplingParams(max_new_tokens=2, ignore_eos=True)
            rid = src_eng.add_request(prompt, params, request_id=f"t{r}", prefill_only=True, seed=r)
            _run(src_eng)
            req = src_eng.held_request(rid)
            ticket = src.export(rid, req.pages, req.num_computed)
            pages = dst_eng.reserve_import(prompt, params, f"d{r}", req.seed, req.output[0], req.logprobs[0])
            t0 = time.perf_counter()
            stats = dst.pull(ticket, pages, timeout_s=60)
            times.append(time.perf_counter() - t0)
            size = stats.bytes
            dst_eng.abort(f"d{r}")
            deadline = time.monotonic() + 5
            while src.exported() and time.monotonic() < deadline:
                src.poll()
                time.sleep(0.002)
    finally:
        src.close()
        dst.close()
    return statistics.median(times), size


def prefill_s(opts: dict, length: int, uncached: int, repeats: int) -> float:
    """Median first-token seconds of a `length`-token prompt whose first length - uncached tokens are cached."""
    engine = load_engine(**opts)
    block = engine.prefix.block
    if (length - uncached) % block:
        raise ValueError(f"cached part {length - uncached} is not a multiple of the {block}-token block")
    times = []
    for r in range(repeats):
        shared = _prompt(length - uncached, 100 + r, engine.cfg.vocab_size)
        warm = engine.add_request(shared + [5] * block, FIRST)  # leaves a snapshot at length - uncached
        _run(engine)
        engine.pop_finished(warm)
        rid = engine.add_request(shared + _prompt(uncached, 200 + r, engine.cfg.vocab_size), FIRST)
        t0 = time.perf_counter()
        _run(engine)
        times.append(time.perf_counter() - t0)
        out = engine.pop_finished(rid)
        if out.cached_tokens != length - uncached:
            raise RuntimeError(f"expected {length - uncached} cached tokens, got {out.cached_tokens}")
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--transfer", default="tcp")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    opts = dict(device=args.device, dtype=args.dtype, page_tokens=64)  # 128-token blocks on the tiny model
    rows, lines = [], []
    for length in [int(x) for x in args.lengths.split(",")]:
        t, nbytes = transfer_s(opts, args.transfer, length, args.repeats)
        us = [u for u in (128, 256, 512, 1024, 2048) if u <= length]
        pre = {u: prefill_s(opts, length, u, args.repeats) for u in us}
        fits = [u for u in us if pre[u] <= t]
        rows.append((length, t, nbytes, pre, max(fits) if fits else 0))
        print(length, round(t * 1000, 2), "ms transfer;", {u: round(v * 1000, 2) for u, v in pre.items()}, flush=True)
    lines += ["## Conditional disaggregation: local prefill vs transfer", "",
              f"`scripts/measure_local_prefill.py` on {args.device} ({args.dtype}, the built-in tiny model, "
              f"{args.transfer} transfer between two engines of one process, {platform.machine()}, median of "
              f"{args.repeats}): the first-token time of computing u uncached tokens on the decode worker (the rest "
              "from its prefix cache) against the transfer of the whole context it replaces.", "",
              "| context L | transfer ms (MB) | " + " | ".join(f"prefill u={u} ms" for u in (128, 256, 512, 1024, 2048))
              + " | crossover u* |", "|---" * 8 + "|"]
    for length, t, nbytes, pre, cross in rows:
        cells = [f"{pre[u] * 1000:.1f}" if u in pre else "-" for u in (128, 256, 512, 1024, 2048)]
        lines.append(f"| {length} | {t * 1000:.1f} ({nbytes / 1e6:.1f}) | " + " | ".join(cells) + f" | {cross} |")
    crosses = [r[4] for r in rows]
    lines += ["", f"Crossover on this machine: u* = {min(crosses)}..{max(crosses)} tokens (below it a local prefill "
                  "costs the decode worker no more than the transfer would take). These are CPU figures of a tiny "
                  "model over loopback TCP; the router's `local_prefill_tokens` stays 0 (off) by default and is "
                  "meant to be set from this script's run on the deployment's GPUs and network (on a real V4 a "
                  "token costs ~3.4 KB of compressed cache + a fixed ~75 KB SWA window per layer, and RDMA transfer "
                  "cost is dominated by descriptor count, so the crossover is a GPU measurement)."]
    text = "\n".join(lines)
    print(text if args.no_write else f"wrote {write_section('local_prefill', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
