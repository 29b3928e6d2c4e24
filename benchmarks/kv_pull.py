"""The service's KV pull between two processes, part by part, against NIXL's raw READ of the same bytes.

A source process (the prefill side) holds a pool of the V4-Flash slice geometry (`--layers` layers, the fp8
cache formats, pages of 256 tokens) filled with random bytes, and a `NixlBackend`; the reader (this process, the
decode side) holds its own pool and backend. Per request of `--tokens` prompt tokens: the source exports the
request's pages (plan + staging gather), the ticket crosses the pipe, the reader pulls them the way
`DecodeWorker.decode` does (`pull_deferred` on a worker thread handed over from an asyncio loop, then the deferred
scatter on the loop's thread) and the source's release callback fires on the READ's "done" notification.
Timed: every part, and the whole from the reader's hand-off to the scatter's end. Against it, in the same two
processes: NIXL's raw READ of the same byte count in one descriptor, and in as many descriptors as the request's
page plan has (what a pull without staging posts). Bytes are checked (a digest of each group's pages on both
sides) on the first pull of every size.

Fixed cost of a pull, two ways: (1) the whole pull minus the raw one-descriptor READ of its bytes (timed right
before it, so the load of a shared host moves both alike) minus the scatter's copies; (2) the sum of the parts that
move no bytes: the thread hand-off, the plan, the staging range, the layout / descriptors, the
scatter's set-up. (1) also counts posting the READ and anything else a pull adds to NIXL's own READ; on a loaded
host it is the noisier one. On the CPU the scatter's copies are memcpys that scale with the bytes (a device copy
on a GPU).

    python -m benchmarks.kv_pull                          # CPU, host memory, writes BENCHMARKS.md kv_pull
    python -m benchmarks.kv_pull --device cuda --tokens 8192 32768 --pulls 20   # both processes on GPU 0
    python -m benchmarks.kv_pull --device cuda:0 --source-device cuda:1 --tokens 8192 32768   # one GPU each

Then, unless `--ray-prompt-tokens 0`: one long prompt's hand-off through the Ray token path, streamed vs not
(benchmarks.kv_stream_ray: the transfer time not overlapped with the prefill, as a share of the prefill's time).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import sys
import time

import numpy as np
import torch

from benchmarks.kv_pull_report import section
from benchmarks.timing import median

SOURCE_NAME = "kvpull-src"
READER_NAME = "kvpull-dst"


def make_pool(device: str, max_tokens: int, layers: int):
    """A pool of the V4-Flash slice's cache geometry (fp8 formats), big enough for one request of max_tokens."""
    from benchmarks.slice.slice_model import flash_slice_config
    from engine.model.cache import CacheConfig, CachePool
    from engine.model.config import ModelConfig

    cfg = ModelConfig.from_dict(flash_slice_config(layers))
    cache = CacheConfig(max_requests=4, max_tokens=max_tokens, page_tokens=256, kv_cache_dtype="fp8")
    return CachePool(cfg, cache, torch.bfloat16, device)


def page_digest(pool, table: dict, num_tokens: int) -> dict[str, str]:
    """sha256 of each group's bytes of the pages that hold the request (request order), as the plan moves them."""
    from kv_transfer.plan import pages_needed

    out = {}
    for name, group in pool.groups.items():
        need = pages_needed(group.spec, num_tokens)
        if not need:
            continue
        ids = torch.tensor(table[name][:need], device=group.tensor.device)
        pages = group.tensor.view(torch.uint8).view(len(group.spec.layers), group.spec.num_pages, -1)
        out[name] = hashlib.sha256(pages.index_select(1, ids).cpu().numpy().tobytes()).hexdigest()
    return out


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


# ---- the source process ----------------------------------------------------------------------------------
def source_main(conn, device: str, max_tokens: int, layers: int) -> None:
    """Serve exports over `conn` until told to stop; free each request's pages in its release callback."""
    from kv_transfer.nixl_backend import NixlBackend

    torch.set_num_threads(1)
    torch.manual_seed(0)
    pool = make_pool(device, max_tokens, layers)
    for group in pool.groups.values():
        group.tensor.view(torch.uint8).random_()
    tables: dict[str, dict] = {}
    released: dict[str, float] = {}

    def on_release(rid: str, error: str | None) -> None:
        released[rid] = time.monotonic()
        pool.free(tables.pop(rid))

    backend = NixlBackend(pool, worker_name=SOURCE_NAME, on_release=on_release)
    conn.send(backend.metadata())
    while True:
        if not conn.poll(1e-4):
            backend.poll()  # the prefill worker polls on its engine thread; here between messages
            continue
        op, *args = conn.recv()
        if op == "stop":
            break
        if op == "export":
            rid, num_tokens, digest = args
            table: dict = {}
            pool.grow(table, num_tokens)
            tables[rid] = table
            t0 = time.monotonic()
            ticket = backend.export(rid, table, num_tokens)
            seconds = time.monotonic() - t0
            conn.send((ticket, seconds, page_digest(pool, table, num_tokens) if digest else None))
        elif op == "stream":  # chunk tickets of chunk_tokens positions each, then the final ticket
            rid, num_tokens, chunk_tokens, digest = args
            table = {}
            pool.grow(table, num_tokens)
            tables[rid] = table
            tickets, start = [], 0
            for end in range(chunk_tokens, num_tokens, chunk_tokens):  # as each prefill chunk ends
                ticket = backend.export_chunk(rid, table, end, start)
                if ticket is not None:
                    backend.chunk_ready(ticket, wait=True)  # on CUDA its staging copies are only queued
                    tickets.append(ticket)
                    start = end
            tickets.append(backend.export(rid, table, num_tokens, start_tokens=start))
            conn.send((tickets, page_digest(pool, table, num_tokens) if digest else None))
        elif op == "released":  # -> when the release callback ran (waits for it)
            (rid,) = args
            deadline = time.monotonic() + 10
            while rid not in released and time.monotonic() < deadline:
                backend.poll()
            conn.send(released.pop(rid, None))
    backend.close()
    conn.send("stopped")


# ---- the reader: service pulls ----------------------------------------------------------------------------
async def _pull_like_decode_worker(backend, ticket, table: dict, device: str):
    """DecodeWorker.decode's path: `pull_async` (NIXL: on this loop's thread, its READ polled between the loop's
    other work; a backend that blocks: on a worker thread), then the deferred scatter on this thread."""
    t0 = time.monotonic()
    stats, deferred = await backend.pull_async(ticket, table, 10.0)
    t1 = pulled = time.monotonic()
    parts = deferred.run() if deferred is not None else {}
    _sync(device)
    return stats, t0, pulled, t1, time.monotonic(), parts.get("copies", 0.0)


def service_pulls(conn, backend, pool, num_tokens: int, pulls: int, device: str, raw) -> tuple[list[dict], bool]:
    """`pulls` timed requests (after one untimed) of num_tokens, each right after a raw READ of the same bytes
    (`raw`: the load of a shared host moves both alike) -> per-pull parts (ms), bytes matched."""
    rows, ok = [], True
    loop = asyncio.new_event_loop()
    try:
        for i in range(pulls + 1):
            rid = f"r{num_tokens}-{i}"
            table: dict = {}
            pool.grow(table, num_tokens)
            conn.send(("export", rid, num_tokens, i == 0))
            ticket, export_s, digest = conn.recv()
            raw_ms = raw.time_ms()
            stats, t0, pulled, t1, t2, copies = loop.run_until_complete(
                _pull_like_decode_worker(backend, ticket, table, device)
            )
            conn.send(("released", rid))
            released_at = conn.recv()
            if digest is not None:
                ok = ok and digest == page_digest(pool, table, num_tokens)
            pool.free(table)
            if i == 0:
                continue
            parts = (stats.plan_seconds, stats.staging_wait_seconds, stats.wire_seconds)
            rows.append(
                {
                    "bytes": stats.bytes,
                    "descriptors": stats.descriptors,
                    "export_ms": export_s * 1e3,
                    "handoff_ms": (t1 - t0 - stats.seconds) * 1e3,
                    "plan_ms": stats.plan_seconds * 1e3,
                    "staging_wait_ms": stats.staging_wait_seconds * 1e3,
                    "read_ms": stats.wire_seconds * 1e3,
                    "pull_other_ms": (stats.seconds - sum(parts)) * 1e3,  # layout, descriptors (confirmation: after it)
                    "pull_ms": stats.seconds * 1e3,
                    "pull_cpu_ms": stats.cpu_seconds * 1e3,  # the pulling thread's CPU (the READ's cma copy in it)
                    "scatter_ms": (t2 - t1) * 1e3,
                    "scatter_copies_ms": copies * 1e3,  # the copy launches (on the CPU: the copies themselves)
                    "whole_ms": (t2 - t0) * 1e3,
                    "raw_ms": raw_ms,
                    # what the pull adds to NIXL moving its bytes, and to the scatter's copies (which scale with
                    # the bytes: a memcpy on the CPU, a device copy on a GPU)
                    "fixed_ms": ((t2 - t0) - copies) * 1e3 - raw_ms,
                    # the same from the parts that do not move bytes: hand-off, plan, staging range, layout /
                    # descriptors, the scatter's set-up (steadier on a loaded host than a difference)
                    "fixed_parts_ms": ((t1 - t0 - sum(parts)) + stats.plan_seconds + stats.staging_wait_seconds) * 1e3
                    + ((t2 - t1) - copies) * 1e3,
                    # from the end of the pull on its thread to the source's release callback (its poll)
                    "confirm_ms": None if released_at is None else (released_at - pulled) * 1e3,
                }
            )
    finally:
        loop.close()
    return rows, ok


def streamed_pulls(conn, backend, pool, num_tokens: int, chunk_tokens: int, pulls: int, device: str):
    """`pulls` requests (after one untimed) streamed in chunks of chunk_tokens: every chunk ticket pulled (while a
    prefill would run its later chunks), then the final one -> medians of the chunks' count, bytes and pull ms,
    and of the final pull's bytes and ms (the part a prefill cannot hide); bytes matched."""
    rows, ok = [], True
    loop = asyncio.new_event_loop()
    try:
        for i in range(pulls + 1):
            rid = f"s{num_tokens}-{i}"
            table: dict = {}
            pool.grow(table, num_tokens)
            conn.send(("stream", rid, num_tokens, chunk_tokens, i == 0))
            tickets, digest = conn.recv()
            chunk_ms, chunk_bytes = [], 0
            for ticket in tickets[:-1]:
                stats, t0, _, _, t2, _ = loop.run_until_complete(
                    _pull_like_decode_worker(backend, ticket, table, device)
                )
                chunk_ms.append((t2 - t0) * 1e3)
                chunk_bytes += stats.bytes
            stats, t0, _, _, t2, _ = loop.run_until_complete(
                _pull_like_decode_worker(backend, tickets[-1], table, device)
            )
            conn.send(("released", rid))
            conn.recv()
            if digest is not None:
                ok = ok and digest == page_digest(pool, table, num_tokens)
            pool.free(table)
            if i:
                rows.append(
                    {
                        "chunks": len(chunk_ms),
                        "chunk_bytes": chunk_bytes,
                        "chunk_pull_ms": max(chunk_ms, default=0.0),  # the slowest chunk's pull
                        "final_bytes": stats.bytes,
                        "final_ms": (t2 - t0) * 1e3,
                    }
                )
    finally:
        loop.close()
    return {k: median([r[k] for r in rows]) for k in rows[0]}, ok


# ---- the reader: raw READs of the same bytes -----------------------------------------------------------------
class RawRead:
    """One prepared NIXL READ of `nbytes` of the source's staging buffer into ours, in `descriptors` equal
    pieces: NIXL's own rate at that size and shape (no plan, no staging range, no scatter, no confirmation)."""

    def __init__(self, backend, nbytes: int, descriptors: int):
        peer = backend._peers[SOURCE_NAME]
        src_addr, src_nbytes, src_dev = peer["staging"]
        dst = backend.staging.tensor
        if nbytes > min(src_nbytes, dst.numel()):
            raise ValueError(f"{nbytes} bytes do not fit the staging buffers ({src_nbytes}, {dst.numel()})")
        dev = 0 if dst.device.type == "cpu" else dst.device.index or 0
        step = nbytes // descriptors
        lengths = np.full(descriptors, step, dtype=np.uint64)
        lengths[-1] = nbytes - step * (descriptors - 1)
        offsets = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.uint64)
        devs = np.full(descriptors, dev, np.uint64)
        local = np.stack([dst.data_ptr() + offsets, lengths, devs], 1).astype(np.uint64)
        remote = np.stack([src_addr + offsets, lengths, np.full(descriptors, src_dev, np.uint64)], 1)
        self.agent, self.what = backend.agent, f"raw READ of {nbytes} bytes in {descriptors} descriptors"
        self.handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, backend.mem_type),
            self.agent.get_xfer_descs(remote.astype(np.uint64), peer["mem"]),
            SOURCE_NAME,
        )
        self.time_ms()  # warm-up

    def time_ms(self) -> float:
        t0 = time.perf_counter()
        state = self.agent.transfer(self.handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(self.handle)
        if state != "DONE":
            raise RuntimeError(f"{self.what}: {state}")
        return (time.perf_counter() - t0) * 1e3

    def median_ms(self, iters: int) -> float:
        return median([self.time_ms() for _ in range(iters)])

    def close(self) -> None:
        self.handle.release()


def page_plan_descriptors(backend, pool, num_tokens: int) -> int:
    """Descriptors of the request's page plan (a pull without staging) for pages taken fresh from the pool."""
    from kv_transfer.plan import build_plan

    table: dict = {}
    pool.grow(table, num_tokens)
    try:
        return build_plan(backend.specs, table, table, num_tokens).num_descriptors
    finally:
        pool.free(table)


def run(args) -> dict:
    from kv_transfer.nixl_backend import NixlBackend
    from kv_transfer.plan import staged_nbytes

    torch.set_num_threads(1)
    load_at_start = os.getloadavg()[0]  # a shared host: what else ran shows here
    max_tokens = max(args.tokens) + 4096
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    source_device = getattr(args, "source_device", None) or args.device
    proc = ctx.Process(target=source_main, args=(child_conn, source_device, max_tokens, args.layers), daemon=True)
    proc.start()
    pool = make_pool(args.device, max_tokens, args.layers)
    backend = NixlBackend(pool, worker_name=READER_NAME)
    try:
        backend.add_peer(SOURCE_NAME, conn.recv())
        sizes = []
        for num_tokens in args.tokens:
            nbytes = staged_nbytes(backend.specs, num_tokens)
            page_descs = page_plan_descriptors(backend, pool, num_tokens)
            raw1, raw_n = RawRead(backend, nbytes, 1), RawRead(backend, nbytes, page_descs)
            try:
                rows, ok = service_pulls(conn, backend, pool, num_tokens, args.pulls, args.device, raw1)
                raw_n_ms = raw_n.median_ms(args.raw_iters)
            finally:
                raw1.close()
                raw_n.close()
            streamed, streamed_ok = streamed_pulls(
                conn, backend, pool, num_tokens, args.chunk_tokens, args.pulls, args.device
            )
            ok = ok and streamed_ok
            med = {k: median([r[k] for r in rows if r[k] is not None]) for k in rows[0]}
            best = {f"{k}_min": min(r[k] for r in rows if r[k] is not None) for k in rows[0] if k.endswith("_ms")}
            sizes.append(
                {
                    "tokens": num_tokens,
                    "bytes_match": ok,
                    "page_plan_descriptors": page_descs,
                    "raw_page_plan_ms": raw_n_ms,
                    "streamed": streamed,
                }
                | med
                | best
            )
            s = sizes[-1]
            print(
                f"{num_tokens} tokens, {s['bytes'] / 1e6:.2f} MB: pull {s['whole_ms']:.3f} ms in {s['descriptors']:.0f} "
                f"descriptor(s), raw READ {s['raw_ms']:.3f} ms in 1 ({raw_n_ms:.3f} ms in {page_descs}); fixed "
                f"{s['fixed_ms']:.3f} ms (min {s['fixed_ms_min']:.3f}); bytes match {ok}",
                flush=True,
            )
        conn.send(("stop",))
        conn.recv()
    finally:
        backend.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    ray_tokens = getattr(args, "ray_prompt_tokens", 0)
    ray_stream = None
    if ray_tokens:
        from benchmarks.kv_stream_ray import run as run_ray

        ray_stream = run_ray(ray_tokens, args.ray_chunk_tokens, args.ray_requests, args.ray_transfer)
        for mode in ("not streamed", "streamed"):
            r = ray_stream[mode]
            print(
                f"Ray path, {ray_tokens} tokens {mode}: prefill {r['prefill_ms']:.1f} ms, hand-off not overlapped "
                f"{r['exposed_ms']:.1f} ms ({r['exposed_share']:.1%}), {r['chunks']:.0f} chunks",
                flush=True,
            )
    return {
        "ray_stream": ray_stream,
        "device": args.device if source_device == args.device else f"{source_device} -> {args.device}",
        "layers": args.layers,
        "chunk_tokens": args.chunk_tokens,
        "pulls": args.pulls,
        "sizes": sizes,
        "load_average": (load_at_start, os.getloadavg()[0]),
        "machine": machine(args.device),
        "command": "python -m benchmarks.kv_pull " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def machine(device: str) -> str:
    from kv_transfer.nixl_backend import import_nixl

    _, _, mod = import_nixl()
    package = mod.__name__.split(".")[0]
    try:
        nixl = f"{package} {importlib.metadata.version(package.replace('_', '-'))}"
    except importlib.metadata.PackageNotFoundError:
        nixl = package
    dev = torch.cuda.get_device_name(0) if device != "cpu" else f"{os.cpu_count()} CPU cores ({platform.machine()})"
    return f"{dev}, torch {torch.__version__}, NIXL {nixl}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kv_pull", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="the reader's: cpu (host memory), cuda (GPU 0) or cuda:N")
    ap.add_argument(
        "--source-device",
        default=None,
        help="the source process's (default: --device; cuda:1 with --device cuda:0 is the two-GPU run)",
    )
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048, 8192, 32768], help="prompt lengths")
    ap.add_argument("--layers", type=int, default=4, help="layers of the V4-Flash slice (its cache geometry)")
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=2048,
        help="prefill chunk of the streamed pulls (the engine's max_batch_tokens)",
    )
    ap.add_argument("--pulls", type=int, default=15, help="timed pulls per prompt length (after one untimed)")
    ap.add_argument("--raw-iters", type=int, default=15)
    ap.add_argument(
        "--ray-prompt-tokens",
        type=int,
        default=2048,
        help="prompt of the hand-off through the Ray path, streamed vs not (0: skip it)",
    )
    ap.add_argument("--ray-chunk-tokens", type=int, default=256, help="the Ray workers' max_batch_tokens")
    ap.add_argument("--ray-requests", type=int, default=5, help="timed requests a mode on the Ray path")
    ap.add_argument("--ray-transfer", default="nixl", help="the Ray workers' transfer backend (nixl, tcp)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--no-write", action="store_true", help="do not write the BENCHMARKS.md section")
    args = ap.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # as `dsv4 serve` sets it on one node
    result = run(args)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=1)
    if not args.no_write:
        from service.benchmarks_md import write_section

        # a GPU run is its own section: the CPU run's (host memory, the fixed-cost A/B) stays beside it
        if args.device.startswith("cuda"):
            write_section("kv_pull_cuda", section(result))
        else:
            write_section("kv_pull", section(result))
    return 0 if all(s["bytes_match"] for s in result["sizes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
