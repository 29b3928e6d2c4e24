"""A long prompt's KV hand-off through the Ray token path, streamed vs not: the transfer time the prefill does not hide.

One prefill and one decode actor (the service's actor classes, the built-in tiny model on the CPU), driven by
`service.ray_stream.RayStreamer` exactly as an ingress replica drives the workers a router named (no router here:
the placement is fixed). For each request the streamer reports a `HandoffTiming`: the prefill call to its
PrefillResult's arrival (`prefill_s`), and that arrival to the decode worker's `Transferred` (`exposed_s`: the
hand-off time not overlapped with the prefill, which TTFT pays on top of it). Streamed (`stream_min_chunks=1`): the
decode pages are reserved first and every chunk ticket is pulled while later chunks are prefilled, so only the
final pull (last pages, SWA ring, compressor state) and the decode open are exposed; not streamed: the whole pull
and the open. The two modes alternate request by request (a shared host's load moves both alike), each on prompts
of its own (no prefix-cache hit on the prefill worker), after one untimed request each.

Run by `python -m benchmarks.kv_pull` (its `--ray-*` options; the kv_pull section of BENCHMARKS.md shows it);
`measure` runs on any pair of worker handles (tests/service/test_service_ray.py runs it on the service's).
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile

from benchmarks.timing import median
from engine.execution.sampling_params import SamplingParams
from router.dispatch import DispatchRequest
from service.ray_cluster import init_ray
from service.ray_stream import HandoffTiming, RayStreamer, Workers

MODES = (("not streamed", 0), ("streamed", 1))  # (name, stream_min_chunks)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """n random prompts of `length` tokens of the tiny vocabulary (distinct: no prefix-cache hits among them)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(length)] for _ in range(n)]


async def run_one(streamer: RayStreamer, workers: Workers, request_id: str, prompt: list[int], params) -> list[int]:
    """One request through the streamer -> its token ids."""
    request = DispatchRequest(request_id, tuple(prompt), params)
    tokens = []
    async with contextlib.aclosing(streamer.run_placement(request, workers)) as events:
        async for ev in events:
            if ev.token_id is not None:
                tokens.append(ev.token_id)
    return tokens


async def measure(workers: Workers, prompt_tokens: int, requests: int, seed: int = 0) -> dict:
    """`requests` timed requests (after one untimed) of prompt_tokens in each mode -> per mode the medians of
    prefill ms, exposed hand-off ms, their ratio and the chunks pulled; plus every request's token count."""
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    timings: dict[str, list[HandoffTiming]] = {name: [] for name, _ in MODES}
    streamers = {
        name: RayStreamer(stream_min_chunks=min_chunks, on_handoff=timings[name].append) for name, min_chunks in MODES
    }
    ps = {name: prompts(requests + 1, prompt_tokens, seed + k) for k, (name, _) in enumerate(MODES)}
    generated: list[int] = []  # tokens of every request
    moved: dict[str, list[int]] = {name: [] for name, _ in MODES}  # bytes pulled a request
    decode = workers.decode
    for i in range(requests + 1):
        for name, _ in MODES:
            rid = f"kvstream-{seed}-{name.replace(' ', '-')}-{i}"
            before = (await decode.transfer_summary.remote())["bytes"]  # type: ignore[attr-defined]
            generated.append(len(await run_one(streamers[name], workers, rid, ps[name][i], params)))
            moved[name].append((await decode.transfer_summary.remote())["bytes"] - before)  # type: ignore[attr-defined]
    out: dict = {"prompt_tokens": prompt_tokens, "requests": requests, "generated": generated}
    for name, _ in MODES:
        rows = timings[name][1:]  # the first warms both workers up
        out[name] = {
            "streamed": [t.streamed for t in rows],
            "chunks": median([t.chunks for t in rows]),
            "bytes": median(moved[name][1:]),
            "prefill_ms": median([t.prefill_s * 1e3 for t in rows]),
            "exposed_ms": median([t.exposed_s * 1e3 for t in rows]),
            "exposed_share": median([t.exposed_s / t.prefill_s for t in rows]),
        }
    return out


def start_workers(chunk_tokens: int, transfer: str) -> Workers:
    """A prefill and a decode actor of the service's classes (tiny model, CPU) on the connected Ray cluster,
    introduced to each other."""
    import ray

    from engine.loading.make_model import default_model_dir
    from service.actor_pools import worker_classes
    from service.service_config import ServiceConfig

    model_dir = default_model_dir()
    prefill_cls, decode_cls = worker_classes(ServiceConfig(model_dir=model_dir, worker_num_cpus=0.5))
    env = {"runtime_env": {"env_vars": {"UCX_NET_DEVICES": "lo", "OMP_NUM_THREADS": "1"}}}
    options = {"max_batch_tokens": chunk_tokens}
    prefill = prefill_cls.options(**env).remote("prefill-0", model_dir, options, transfer=transfer)
    decode = decode_cls.options(**env).remote("decode-0", model_dir, options, transfer=transfer)
    ray.get([prefill.ping.remote(), decode.ping.remote()], timeout=600)
    ray.get(decode.add_peer.remote("prefill-0", ray.get(prefill.transfer_metadata.remote())))
    return Workers("prefill-0", prefill, "decode-0", decode)


def run(prompt_tokens: int, chunk_tokens: int, requests: int, transfer: str) -> dict:
    """Start a local Ray cluster with the two workers, measure, stop it -> `measure`'s result and the setup."""
    import asyncio

    import ray

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    init_ray(tempfile.mkdtemp(prefix="dsv4-bench-metrics-"))  # retries a start that misses Ray's deadline
    try:
        workers = start_workers(chunk_tokens, transfer)
        result = asyncio.run(measure(workers, prompt_tokens, requests))
    finally:
        ray.shutdown()
    return result | {"chunk_tokens": chunk_tokens, "transfer": transfer}
