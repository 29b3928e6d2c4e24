"""NIXL's raw READ rate between two processes of one machine: the ceiling for the service's KV transfer.

A source process registers one buffer (VRAM on `--device cuda`, DRAM on cpu) and ships its NIXL agent metadata
and the buffer's address to a reader process over a pipe; the reader registers its own buffer, loads the peer and
READs the whole buffer, as one descriptor and as `--descs` equal descriptors (the KV transfer's shape: many page
runs), `--iters` timed times after one warm-up, and checks the bytes it got. Both processes on the same GPU is the
setting of `tools/gpu/service_run.sh` (UCX moves VRAM with cuda_ipc there). Prints one line per case; `--json-out`.

    dsv4 bench kernels nixl-raw --device cuda --sizes-mib 16 256 1024
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

from benchmarks.timing import median


def _agent(name: str):
    from kv_transfer.nixl_backend import enable_cuda_ipc_get, import_nixl

    enable_cuda_ipc_get()  # as the engine's backend does (a no-op for host memory)
    nixl_agent, nixl_agent_config, _ = import_nixl()
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend("UCX", {})
    return agent


def _buffer(nbytes: int, device: str, fill: int | None):
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if fill is not None:  # a pattern the reader checks: byte i = (i * 7 + fill) % 251
        t.copy_((torch.arange(nbytes, device=device, dtype=torch.int64) * 7 + fill).remainder_(251).to(torch.uint8))
    return t


def _mem(t) -> tuple[str, int]:
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)


def source(conn, nbytes: int, device: str) -> None:
    buf = _buffer(nbytes, device, fill=3)  # CUDA initialised before the agent, as in a worker (engine first)
    agent = _agent("raw-src")
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), *_mem(buf)))
    conn.recv()  # the reader is done
    conn.close()


def reader(conn, nbytes: int, device: str, descs: list[int], iters: int, out) -> None:
    import numpy as np
    import torch

    buf = _buffer(nbytes, device, fill=None)
    agent = _agent("raw-dst")
    agent.register_memory(buf)
    meta, src_addr, src_mem, src_dev = conn.recv()
    peer = agent.add_remote_agent(meta)
    mem, dev = _mem(buf)
    results = []
    for n in descs:
        step = nbytes // n
        lengths = [step] * (n - 1) + [nbytes - step * (n - 1)]
        offsets = np.cumsum([0] + lengths[:-1])
        local = np.array([(buf.data_ptr() + o, ln, dev) for o, ln in zip(offsets, lengths)], dtype=np.uint64)
        remote = np.array([(src_addr + o, ln, src_dev) for o, ln in zip(offsets, lengths)], dtype=np.uint64)
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, src_mem), peer
        )
        times = []
        for i in range(iters + 1):  # the first is a warm-up (connection, IPC handle mapping)
            if device != "cpu":
                buf.zero_()
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            dt = time.perf_counter() - t0
            if state != "DONE":
                raise RuntimeError(f"NIXL READ of {nbytes} bytes in {n} descriptors ended in state {state}")
            if i:
                times.append(dt)
        expect = (torch.arange(nbytes, device=device, dtype=torch.int64) * 7 + 3).remainder_(251).to(torch.uint8)
        ok = bool(torch.equal(buf, expect))
        handle.release()
        best, mid = min(times), median(times)
        results.append(
            {
                "bytes": nbytes,
                "descriptors": n,
                "iters": iters,
                "best_s": best,
                "median_s": mid,
                "gb_per_s_best": nbytes / best / 1e9,
                "gb_per_s_median": nbytes / mid / 1e9,
                "bytes_match": ok,
            }
        )
    out.put(results)
    conn.send("done")
    conn.close()


def run_size(nbytes: int, device: str, descs: list[int], iters: int) -> list[dict]:
    ctx = mp.get_context("spawn")  # CUDA in both: no fork after CUDA init
    a, b = ctx.Pipe()
    out = ctx.Queue()
    src = ctx.Process(target=source, args=(a, nbytes, device))
    dst = ctx.Process(target=reader, args=(b, nbytes, device, descs, iters, out))
    src.start()
    dst.start()
    try:
        results = out.get(timeout=300)
    finally:
        for p in (dst, src):
            p.join(60)
            if p.is_alive():
                p.kill()
    if dst.exitcode or src.exitcode:
        raise RuntimeError(f"bench processes exited with {dst.exitcode}, {src.exitcode}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4 bench kernels nixl-raw", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (DRAM) or cuda (VRAM; both processes on GPU 0)")
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[16, 64])
    ap.add_argument(
        "--descs",
        type=int,
        nargs="+",
        default=[1, 1024],
        help="descriptor counts per READ (the service's READs carry one per page run)",
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # as `dsv4 serve` sets it on one node
    rows = []
    for mib in args.sizes_mib:
        for r in run_size(int(mib * (1 << 20)), args.device, args.descs, args.iters):
            rows.append({**r, "device": args.device})
            print(
                f"nixl raw READ {args.device}: {r['bytes'] / (1 << 20):.0f} MiB in {r['descriptors']} descriptor(s): "
                f"{r['gb_per_s_median']:.2f} GB/s median, {r['gb_per_s_best']:.2f} best over {r['iters']} "
                f"(bytes match: {r['bytes_match']})",
                flush=True,
            )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"rows": rows, "ucx_tls": os.environ.get("UCX_TLS", "(default)")}, fh, indent=1)
    return 0 if all(r["bytes_match"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
