"""Helpers of the token-path tests that run placements under a local Ray (test_token_feed, test_feed_open,
test_prefill_link): the Ray cluster for a module, and one placement's tokens."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator


def local_ray() -> Iterator[None]:
    """A module fixture's body: a local Ray started for the module (and shut down after it) unless one runs."""
    import ray

    started = not ray.is_initialized()
    if started:
        from service.ray_cluster import init_ray

        init_ray(tempfile.mkdtemp(prefix="dsv4-test-metrics-"))
    yield
    if started:
        ray.shutdown()


async def tokens(streamer, request, workers) -> list[int]:
    """The token ids of one placement (service.ray_stream.RayStreamer.run_placement) to its finish."""
    got = []
    async with contextlib.aclosing(streamer.run_placement(request, workers)) as events:
        async for ev in events:
            got.append(ev.token_id)
            if ev.finished:
                break
    return got


def real_pair(token: str, decode_options: dict | None = None, prefill_options: dict | None = None) -> Iterator[tuple]:
    """A module fixture's body: a real PrefillWorker "rp0" and DecodeWorker "rd0" (the tiny built-in model, tcp KV
    transfer, `token` their cluster token), introduced; -> (prefill, decode) handles, killed after the module."""
    import ray

    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    prefill = ray.remote(num_cpus=0, max_concurrency=16)(PrefillWorker).remote(
        "rp0", None, prefill_options, transfer="tcp", cluster_token=token
    )
    decode = ray.remote(num_cpus=0, max_concurrency=1000)(DecodeWorker).remote(
        "rd0", None, decode_options, transfer="tcp", cluster_token=token
    )
    ray.get(decode.add_peer.remote("rp0", ray.get(prefill.transfer_metadata.remote())))
    yield prefill, decode
    ray.kill(decode, no_restart=True)
    ray.kill(prefill, no_restart=True)


def real_workers(pair: tuple):
    """real_pair's handles as one placement's Workers."""
    from service.ray_stream import Workers

    return Workers("rp0", pair[0], "rd0", pair[1])
