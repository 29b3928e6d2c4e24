"""Requests opened over the TCP token feed's connection (DSV4_TOKEN_FEED_OPEN: an OPEN frame instead of the decode
worker's `decode` Ray call; decode_worker.feed_opens, service.tcp_feed) on a real local Ray: the replica's side is the
real TokenFeeds + RayStreamer in this process, the workers real actors.

With the synthetic workers of `dsv4 bench frontdoor`: many requests open over the feed and stream complete and in order
(no Ray `decode` call: the feed counts its OPEN frames); with the switch off they take the Ray call and get the same
tokens; a decode worker killed while an open is in flight fails it as WorkerDied naming that worker, as the Ray call
does (so migration retries it); a client that leaves while its open is in flight leaves nothing on the worker.
With the real PrefillWorker and DecodeWorker (tiny model, tcp KV transfer): the tokens are the Ray call's, and a full
decode worker's refusal (DecodeOverloaded, retried then Overloaded) is the same error over both paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engine.execution.sampling_params import SamplingParams
from router.dispatch import DispatchRequest, Overloaded, WorkerDied
from tests.support import decode_load, placements

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
RATE = 100.0
LETTER = 70
TOKEN = "cluster-token-of-the-test"
SLOW_OPEN_S = 1.5  # how long the slow decode worker's opens take before Transferred (its "pull")


@pytest.fixture(scope="module")
def cluster():
    yield from placements.local_ray()


def _actor(**kw):
    return ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=-1, **kw)


@pytest.fixture(scope="module")
def pool(cluster):
    from service.frontdoor_workers import SyntheticDecode, SyntheticPrefill

    prefill = ray.remote(num_cpus=0, max_concurrency=16)(SyntheticPrefill).remote("p0", RATE, LETTER)
    decode = _actor()(SyntheticDecode).remote("d0", RATE, LETTER, TOKEN)
    ray.get([prefill.ping.remote(), decode.ping.remote()])
    yield prefill, decode


def _slow_decode_class():
    from service.frontdoor_workers import SyntheticDecode

    class SlowDecode(SyntheticDecode):
        """The synthetic decode worker whose `decode` takes SLOW_OPEN_S before its Transferred (a slow pull), and
        counts the opens cancelled in that wait (what a Ray-cancelled or CANCELled `decode` call sees)."""

        cancelled = 0

        async def decode(self, result, prompt, params, batch=False, feed=None):
            try:
                await asyncio.sleep(SLOW_OPEN_S)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            async for item in super().decode(result, prompt, params, batch, feed):
                yield item

        def cancelled_opens(self) -> int:
            return self.cancelled

    return SlowDecode


@pytest.fixture
def slow(pool):
    decode = _actor()(_slow_decode_class()).remote("d-slow", RATE, LETTER, TOKEN)
    ray.get(decode.ping.remote())
    yield pool[0], decode
    ray.kill(decode, no_restart=True)


def _request(rid: str, n: int, prompt=None) -> DispatchRequest:
    return DispatchRequest(rid, prompt or (1, 2, hash(rid) % 1000), SamplingParams(max_new_tokens=n, ignore_eos=True))


def _feeds(**kw):
    from service.token_feed import TokenFeeds

    return TokenFeeds(transport="tcp", token=TOKEN, **kw)


@pytest.mark.parametrize("switch", ["1", "0"], ids=["over-the-feed", "switch-off"])
def test_requests_open_over_the_feed_and_stream_in_order(pool, switch, monkeypatch):
    """DSV4_TOKEN_FEED_OPEN=1: every request after the feed is up opens with an OPEN frame (none with the Ray call);
    =0: every one with the Ray call; the tokens are the same."""
    from service.frontdoor_workers import token_for
    from service.ray_stream import RayStreamer, Workers

    monkeypatch.setenv("DSV4_TOKEN_FEED_OPEN", switch)

    async def run():
        feeds = _feeds()
        streamer = RayStreamer(feeds=feeds)
        lengths = [4 + (i % 5) * 3 for i in range(16)]
        got = await asyncio.gather(
            *(
                placements.tokens(streamer, _request(f"open-{switch}-{i}", n), Workers("p0", pool[0], "d0", pool[1]))
                for i, n in enumerate(lengths)
            )
        )
        sent = feeds._feeds["d0"].opens_sent
        await feeds.close()
        return lengths, got, sent

    lengths, got, sent = asyncio.run(run())
    for n, tokens in zip(lengths, got):
        assert tokens == [token_for(k, LETTER) for k in range(n)]
    assert sent == (16 if switch == "1" else 0)
    assert decode_load.wait_idle(pool[1]) == 0


def test_a_worker_of_an_older_release_keeps_the_ray_call(cluster):
    """A decode worker whose open_tcp_feed returns None (a release before OPEN frames: feed_wire's "Versions") gets no
    OPEN frame, which it would take for a broken stream; its requests open with the Ray call and stream as before."""
    from service.frontdoor_workers import SyntheticDecode, SyntheticPrefill, token_for
    from service.ray_stream import RayStreamer, Workers

    class OlderDecode(SyntheticDecode):
        async def open_tcp_feed(self, feed_id, host, port, key, lease_s=None):
            await super().open_tcp_feed(feed_id, host, port, key, lease_s)  # connected, as an older worker replies

    prefill = ray.remote(num_cpus=0, max_concurrency=16)(SyntheticPrefill).remote("p-old", RATE, LETTER)
    decode = _actor()(OlderDecode).remote("d-old", RATE, LETTER, TOKEN)

    async def run():
        feeds = _feeds(open_requests=True)
        streamer = RayStreamer(feeds=feeds)
        await feeds.subscribe("d-old", decode, "warm")  # the feed is connected before the requests
        got = await asyncio.gather(
            *(
                placements.tokens(streamer, _request(f"old-{i}", 6), Workers("p-old", prefill, "d-old", decode))
                for i in range(4)
            )
        )
        sent = feeds._feeds["d-old"].opens_sent
        await feeds.close()
        return got, sent

    try:
        got, sent = asyncio.run(run())
        assert all(tokens == [token_for(k, LETTER) for k in range(6)] for tokens in got)
        assert sent == 0
    finally:
        ray.kill(decode, no_restart=True)
        ray.kill(prefill, no_restart=True)


@pytest.mark.parametrize("switch", ["1", "0"], ids=["over-the-feed", "switch-off"])
def test_a_worker_killed_mid_open_is_its_death_as_over_ray(slow, switch, monkeypatch):
    """The decode worker's process dies while the open waits for its Transferred: over the feed the connection's end
    answers the open, over Ray the dead actor's call; both are WorkerDied naming the decode worker (what the router's
    migration retries or moves), and neither waits out the open."""
    from service.ray_stream import RayStreamer, Workers

    monkeypatch.setenv("DSV4_TOKEN_FEED_OPEN", switch)
    prefill, decode = slow

    async def run():
        feeds = _feeds()
        streamer = RayStreamer(feeds=feeds)
        await feeds.subscribe("d-slow", decode, "warm")  # the feed is up (connected) before the request
        task = asyncio.ensure_future(
            placements.tokens(streamer, _request("doomed", 50), Workers("p0", prefill, "d-slow", decode))
        )
        await asyncio.sleep(0.5)  # prefilled; its open waits in the worker's decode
        sent = feeds._feeds["d-slow"].opens_sent
        killed = time.monotonic()
        ray.kill(decode, no_restart=False)
        with pytest.raises(WorkerDied) as died:
            await asyncio.wait_for(task, 30)
        took = time.monotonic() - killed
        await feeds.close()
        return died.value, sent, took

    died, sent, took = asyncio.run(run())
    assert died.worker_id == "d-slow"
    assert sent == (1 if switch == "1" else 0)
    assert took < 10.0


def test_a_client_that_leaves_mid_open_leaves_nothing_on_the_worker(slow):
    """The request's task is cancelled (its HTTP client left) while its open waits in the worker's decode: the CANCEL
    frame behind the OPEN cancels that decode there (its reservation freed), so the request never joins the batch,
    even though the Ray abort the placement also sends reached the worker before the request existed."""
    from service.ray_stream import RayStreamer, Workers

    prefill, decode = slow

    async def run():
        feeds = _feeds(open_requests=True)
        streamer = RayStreamer(feeds=feeds)
        task = asyncio.ensure_future(
            placements.tokens(streamer, _request("leaves", 500), Workers("p0", prefill, "d-slow", decode))
        )
        await asyncio.sleep(0.5)
        sent = feeds._feeds["d-slow"].opens_sent
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(SLOW_OPEN_S + 0.5)  # past the moment the open would have joined
        running = (await decode.stats.remote()).load.running
        cancelled = await decode.cancelled_opens.remote()
        await feeds.close()
        return sent, running, cancelled

    sent, running, cancelled = asyncio.run(run())
    assert sent == 1
    assert cancelled == 1  # the worker's decode was cancelled in its wait, as a cancelled Ray call's would be
    assert running == 0


# ---- the real workers -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(cluster):
    """A real PrefillWorker and a DecodeWorker of one batch slot (tiny built-in model, tcp KV transfer), introduced."""
    yield from placements.real_pair(TOKEN, {"max_num_seqs": 1})


def _real_request(rid: str, n: int) -> DispatchRequest:
    return DispatchRequest(rid, (5, 6, 7, 8, 9), SamplingParams(max_new_tokens=n, ignore_eos=True))


def test_real_workers_give_the_same_tokens_over_the_feed_as_over_ray(real):
    from service.ray_stream import RayStreamer

    async def run(open_requests: bool):
        feeds = _feeds(open_requests=open_requests)
        streamer = RayStreamer(feeds=feeds)
        tokens = await placements.tokens(
            streamer, _real_request(f"real-{open_requests}", 12), placements.real_workers(real)
        )
        sent = feeds._feeds["rd0"].opens_sent
        await feeds.close()
        return tokens, sent

    over_feed, sent_feed = asyncio.run(run(True))
    over_ray, sent_ray = asyncio.run(run(False))
    assert len(over_feed) == 12 and over_feed == over_ray
    assert (sent_feed, sent_ray) == (1, 0)
    stats = ray.get(real[1].stats.remote())
    assert stats.load.running == 0 and stats.load.kv_usage == 0.0


@pytest.mark.parametrize("open_requests", [True, False], ids=["over-the-feed", "over-ray"])
def test_a_full_real_decode_worker_refuses_the_same_over_both_paths(real, open_requests):
    """The decode worker's one batch slot is taken: the second request's open is refused with DecodeOverloaded
    (retried for overload_retry_s, then the router's Overloaded: HTTP 429), the same over the feed as over Ray; the
    first request is untouched and, once both are over, the worker holds nothing."""
    from service.ray_stream import RayStreamer

    async def run():
        feeds = _feeds(open_requests=open_requests)
        streamer = RayStreamer(overload_retry_s=0.3, feeds=feeds)
        first = streamer.run_placement(_real_request("holds-the-slot", 400), placements.real_workers(real))
        await anext(first)
        await anext(first)  # a decode token: it holds the slot
        with pytest.raises(Overloaded) as refused:
            await placements.tokens(streamer, _real_request("no-room", 4), placements.real_workers(real))
        sent = feeds._feeds["rd0"].opens_sent
        await first.aclose()
        await feeds.close()
        return refused.value, sent

    refused, sent = asyncio.run(run())
    assert "no batch slot" in str(refused) or "no room" in str(refused)
    assert sent >= (2 if open_requests else 0)  # the first open and at least one refused one went as frames
    if not open_requests:
        assert sent == 0
    assert decode_load.wait_idle(real[1]) == 0
    assert ray.get(real[1].stats.remote()).load.kv_usage == 0.0
