"""Prefill calls over a prefill worker's link (DSV4_PREFILL_FEED: a PREFILL frame on a TCP connection the worker
opened to the replica's token feed listener instead of the `prefill` Ray call; prefill_worker.prefill_link,
service.prefill_link) on a real local Ray: the replica's side is the real TokenFeeds + PrefillLinks + RayStreamer in
this process, the workers real actors.

With the synthetic workers of `dsv4 bench frontdoor`: once the link is up every request's prefill takes it (none the
Ray call: the link counts its PREFILL frames) and the streams are complete and in order, as without links; a worker
that names no PREFILL in its reply (an older release) keeps the Ray call; a prefill worker killed mid-prefill fails
the request at once as WorkerDied naming it, over the link as over Ray; a client that leaves mid-prefill cancels the
call on the worker (its request dropped there), over the link as over Ray.
With the real PrefillWorker and DecodeWorker (tiny model, tcp KV transfer): the tokens over the link are the Ray
call's, and the worker's refusal of a request it can never hold (the engine's ValueError, the client's 400) is the
same error over both paths; a long prompt's streamed hand-off (`prefill_streamed`: STREAM / CHUNK frames) gives the
Ray stream's tokens with the same chunks pulled, and a client leaving mid-stream leaves both workers idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from engine.execution.sampling_params import SamplingParams
from router.dispatch import DispatchRequest, WorkerDied
from tests.support import decode_load, placements

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
RATE = 100.0
LETTER = 70
TOKEN = "cluster-token-of-the-test"
SLOW_PREFILL_S = 2.0  # how long the slow prefill worker's calls take


@pytest.fixture(scope="module")
def cluster():
    yield from placements.local_ray()


def _actor(**kw):
    return ray.remote(num_cpus=0, max_concurrency=1000, **kw)


@pytest.fixture(scope="module")
def decode(cluster):
    from service.frontdoor_workers import SyntheticDecode

    handle = _actor()(SyntheticDecode).remote("d0", RATE, LETTER, TOKEN)
    ray.get(handle.ping.remote())
    yield handle
    ray.kill(handle, no_restart=True)


def _slow_prefill_class():
    from service.frontdoor_workers import SyntheticPrefill

    class SlowPrefill(SyntheticPrefill):
        """The synthetic prefill worker whose `prefill` takes SLOW_PREFILL_S, counting the calls cancelled in it."""

        cancelled = 0

        async def prefill(self, request_id, prompt, params, seed=None):
            try:
                await asyncio.sleep(SLOW_PREFILL_S)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return super().prefill(request_id, prompt, params, seed)

        def cancelled_calls(self) -> int:
            return self.cancelled

        def aborted_ids(self) -> list[str]:
            return sorted(self.aborted)

    return SlowPrefill


def _request(rid: str, n: int, prompt=None) -> DispatchRequest:
    return DispatchRequest(rid, prompt or (1, 2, hash(rid) % 1000), SamplingParams(max_new_tokens=n, ignore_eos=True))


async def _streamer(links: bool):
    """The replica's side: TCP token feeds and, with `links`, prefill links on the same listener."""
    from service.prefill_link import PrefillLinks
    from service.ray_stream import RayStreamer
    from service.token_feed import TokenFeeds

    feeds = TokenFeeds(transport="tcp", token=TOKEN)
    assert feeds.listener is not None
    prefill_links = PrefillLinks(feeds.listener) if links else None
    return RayStreamer(feeds=feeds, prefill_links=prefill_links), feeds, prefill_links


async def _link_up(links, worker_id: str, handle, timeout_s: float = 20.0):
    """Ask for the worker's link until it is up -> it (None if it never came: the worker takes none)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        link = links.ready(worker_id, handle)
        if link is not None:
            return link
        await asyncio.sleep(0.05)
    return None


async def _close(feeds, links) -> None:
    if links is not None:
        await links.close()
    await feeds.close()


@pytest.mark.parametrize("links", [True, False], ids=["over-the-link", "over-ray"])
def test_prefills_take_the_link_and_streams_stay_in_order(decode, links):
    """Once the link is up, every request's prefill is a PREFILL frame (none a Ray call); without links every one
    is the Ray call; the tokens are the same."""
    from service.frontdoor_workers import SyntheticPrefill, token_for
    from service.ray_stream import Workers

    prefill = _actor()(SyntheticPrefill).remote("p0", RATE, LETTER, TOKEN)

    async def run():
        streamer, feeds, prefill_links = await _streamer(links)
        if prefill_links is not None:
            assert await _link_up(prefill_links, "p0", prefill) is not None
        lengths = [4 + (i % 5) * 3 for i in range(16)]
        got = await asyncio.gather(
            *(
                placements.tokens(streamer, _request(f"link-{links}-{i}", n), Workers("p0", prefill, "d0", decode))
                for i, n in enumerate(lengths)
            )
        )
        sent = prefill_links.calls_sent() if prefill_links is not None else 0
        await _close(feeds, prefill_links)
        return lengths, got, sent

    try:
        lengths, got, sent = asyncio.run(run())
    finally:
        ray.kill(prefill, no_restart=True)
    for n, tokens in zip(lengths, got):
        assert tokens == [token_for(k, LETTER) for k in range(n)]
    assert sent == (16 if links else 0)
    assert decode_load.wait_idle(decode) == 0


def test_a_worker_of_an_older_release_keeps_the_ray_call(decode):
    """A prefill worker whose open_prefill_link names no PREFILL (a release before them: prefill_wire's "Versions")
    gets no PREFILL frame; its requests' prefills go through Ray and stream as before."""
    from service.frontdoor_workers import SyntheticPrefill, token_for
    from service.ray_stream import Workers

    class OlderPrefill(SyntheticPrefill):
        async def open_prefill_link(self, link_id, host, port, key):
            return None

    prefill = _actor()(OlderPrefill).remote("p-old", RATE, LETTER, TOKEN)

    async def run():
        streamer, feeds, prefill_links = await _streamer(True)
        assert await _link_up(prefill_links, "p-old", prefill, timeout_s=3.0) is None
        got = await asyncio.gather(
            *(
                placements.tokens(streamer, _request(f"old-{i}", 6), Workers("p-old", prefill, "d0", decode))
                for i in range(4)
            )
        )
        sent = prefill_links.calls_sent()
        await _close(feeds, prefill_links)
        return got, sent

    try:
        got, sent = asyncio.run(run())
    finally:
        ray.kill(prefill, no_restart=True)
    assert all(tokens == [token_for(k, LETTER) for k in range(6)] for tokens in got)
    assert sent == 0


@pytest.mark.parametrize("links", [True, False], ids=["over-the-link", "over-ray"])
def test_a_prefill_worker_killed_mid_prefill_is_its_death_at_once(decode, links):
    """The prefill worker's process dies while the request's prefill runs: over the link the connection's end answers
    the call, over Ray the dead actor's; both are WorkerDied naming the prefill worker (what the router's migration
    retries), and neither waits out the prefill."""
    from service.ray_stream import Workers

    prefill = _actor()(_slow_prefill_class()).remote("p-slow", RATE, LETTER, TOKEN)

    async def run():
        streamer, feeds, prefill_links = await _streamer(links)
        if prefill_links is not None:
            assert await _link_up(prefill_links, "p-slow", prefill) is not None
        task = asyncio.ensure_future(
            placements.tokens(streamer, _request("doomed", 50), Workers("p-slow", prefill, "d0", decode))
        )
        await asyncio.sleep(0.5)  # its prefill waits in the worker
        sent = prefill_links.calls_sent() if prefill_links is not None else 0
        killed = time.monotonic()
        ray.kill(prefill)
        with pytest.raises(WorkerDied) as died:
            await asyncio.wait_for(task, 30)
        took = time.monotonic() - killed
        await _close(feeds, prefill_links)
        return died.value, sent, took

    try:
        died, sent, took = asyncio.run(run())
    finally:
        ray.kill(prefill, no_restart=True)
    assert died.worker_id == "p-slow"
    assert sent == (1 if links else 0)
    assert took < SLOW_PREFILL_S  # seen before the prefill would have answered


@pytest.mark.parametrize("links", [True, False], ids=["over-the-link", "over-ray"])
def test_a_client_that_leaves_mid_prefill_cancels_it_on_the_worker(decode, links):
    """The request's task is cancelled (its HTTP client left) while its prefill runs: over the link the CANCEL frame
    cancels the worker's prefill where it waits; over Ray the call runs on (cancelling the awaited reply does not
    reach the actor) and only the placement's fire-and-forget abort does. Both abort the request on the worker, and
    nothing reaches the decode worker."""
    from service.ray_stream import Workers

    prefill = _actor()(_slow_prefill_class()).remote("p-leave", RATE, LETTER, TOKEN)

    async def run():
        streamer, feeds, prefill_links = await _streamer(links)
        if prefill_links is not None:
            assert await _link_up(prefill_links, "p-leave", prefill) is not None
        task = asyncio.ensure_future(
            placements.tokens(streamer, _request("leaves", 500), Workers("p-leave", prefill, "d0", decode))
        )
        await asyncio.sleep(0.5)
        sent = prefill_links.calls_sent() if prefill_links is not None else 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(SLOW_PREFILL_S)  # past the moment the prefill would have answered
        cancelled = await prefill.cancelled_calls.remote()
        aborted = await prefill.aborted_ids.remote()
        await _close(feeds, prefill_links)
        return sent, cancelled, aborted

    try:
        sent, cancelled, aborted = asyncio.run(run())
    finally:
        ray.kill(prefill, no_restart=True)
    assert sent == (1 if links else 0)
    assert cancelled == (1 if links else 0)  # the worker's prefill was cancelled in its wait (link only)
    assert "leaves" in aborted
    assert decode_load.running(decode) == 0


# ---- the real workers -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(cluster):
    """A real PrefillWorker and DecodeWorker (tiny built-in model, tcp KV transfer), introduced."""
    yield from placements.real_pair(TOKEN)


def test_real_workers_give_the_same_tokens_over_the_link_as_over_ray(real):
    async def run(links: bool):
        streamer, feeds, prefill_links = await _streamer(links)
        if prefill_links is not None:
            assert await _link_up(prefill_links, "rp0", real[0]) is not None
        request = DispatchRequest(f"real-{links}", (5, 6, 7, 8, 9), SamplingParams(max_new_tokens=12, ignore_eos=True))
        tokens = await placements.tokens(streamer, request, placements.real_workers(real))
        sent = prefill_links.calls_sent() if prefill_links is not None else 0
        await _close(feeds, prefill_links)
        return tokens, sent

    over_link, sent_link = asyncio.run(run(True))
    over_ray, sent_ray = asyncio.run(run(False))
    assert len(over_link) == 12 and over_link == over_ray
    assert (sent_link, sent_ray) == (1, 0)
    assert decode_load.wait_idle(real[1]) == 0
    assert ray.get(real[0].stats.remote()).load.kv_usage == 0.0


def test_a_real_prefill_worker_refuses_the_same_over_both_paths(real):
    """A request the prefill worker can never hold (more positions than the model has): the engine's ValueError (the
    client's 400), the same class and message over the link as over Ray; nothing is left on the worker. (A prefill
    worker queues what it cannot run yet: it has no overload refusal, unlike a decode worker.)"""

    async def run(links: bool):
        streamer, feeds, prefill_links = await _streamer(links)
        if prefill_links is not None:
            assert await _link_up(prefill_links, "rp0", real[0]) is not None
        request = DispatchRequest(f"huge-{links}", tuple(range(5, 25)), SamplingParams(max_new_tokens=5000))
        with pytest.raises(ValueError) as refused:
            await placements.tokens(streamer, request, placements.real_workers(real))
        sent = prefill_links.calls_sent() if prefill_links is not None else 0
        await _close(feeds, prefill_links)
        return refused.value, sent

    over_link, sent_link = asyncio.run(run(True))
    over_ray, sent_ray = asyncio.run(run(False))
    assert type(over_link) is type(over_ray) is ValueError
    assert str(over_link) == str(over_ray).replace("huge-False", "huge-True")
    assert "exceeds the model's maximum" in str(over_link)
    assert (sent_link, sent_ray) == (1, 0)
    assert ray.get(real[0].stats.remote()).load.kv_usage == 0.0


# ---- the streamed hand-off over the link ------------------------------------------------------------------------
STREAM_PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def stepping(cluster):
    """Real workers whose prefill steps 64 tokens (a chunk: one 256-token page), so a long prompt streams."""
    yield from placements.real_pair(TOKEN, {"max_batch_tokens": 64}, {"max_batch_tokens": 64})


def _long_prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple((13 * j + 5 * seed) % 499 + 2 for j in range(n))


def test_a_streamed_handoff_over_the_link_gives_the_ray_streams_tokens(stepping):
    """A 1024-token prompt streams its hand-off (stream_min_chunks 2): over the link its chunk tickets come as CHUNK
    frames, over Ray as the streaming call's items; the tokens and logprobs are the same. (The link's run goes first,
    on a cold prefix cache: several chunks; the Ray run's prompt is mostly cached by then: fewer.)"""

    async def run(links: bool):
        streamer, feeds, prefill_links = await _streamer(links)
        handoffs: list = []
        streamer.stream_min_chunks, streamer.on_handoff = 2, handoffs.append
        if prefill_links is not None:
            assert await _link_up(prefill_links, "rp0", stepping[0]) is not None
        request = DispatchRequest(f"long-{links}", _long_prompt(1, 1024), STREAM_PARAMS)
        got = []
        async with contextlib.aclosing(streamer.run_placement(request, placements.real_workers(stepping))) as events:
            async for ev in events:
                got.append((ev.token_id, ev.logprob))
                if ev.finished:
                    break
        sent = prefill_links.calls_sent() if prefill_links is not None else 0
        await _close(feeds, prefill_links)
        return got, handoffs, sent

    over_link, handoffs_link, sent_link = asyncio.run(run(True))
    over_ray, handoffs_ray, sent_ray = asyncio.run(run(False))
    assert len(over_link) == 6 and over_link == over_ray
    assert [h.streamed for h in handoffs_link] == [True] and handoffs_link[0].chunks >= 2
    assert [h.streamed for h in handoffs_ray] == [True]
    assert (sent_link, sent_ray) == (1, 0)
    stats = ray.get([h.stats.remote() for h in stepping])
    assert all(s.load.kv_usage == 0.0 for s in stats)


def test_a_client_leaving_mid_streamed_handoff_over_the_link_frees_both_workers(stepping):
    """The client leaves after the first chunk landed on the decode worker, while later chunks are prefilled: the
    link's CANCEL stops the streamed prefill (its worker drops the request and its chunks), both workers are aborted,
    and every page comes back."""

    prefill, decode = stepping

    async def run():
        streamer, feeds, prefill_links = await _streamer(True)
        streamer.stream_min_chunks = 2
        assert await _link_up(prefill_links, "rp0", prefill) is not None
        pulls = (await decode.transfer_summary.remote())["count"]
        request = DispatchRequest("long-leaves", _long_prompt(2, 1024), STREAM_PARAMS)
        events = streamer.run_placement(request, placements.real_workers(stepping))
        first = asyncio.ensure_future(anext(events))
        while (await decode.transfer_summary.remote())["count"] == pulls:  # until a chunk is in the decode pages
            assert not first.done(), first
            await asyncio.sleep(0.005)
        running = (await prefill.stats.remote()).load.running
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await events.aclose()
        sent = prefill_links.calls_sent()
        await _close(feeds, prefill_links)
        return running, sent

    running, sent = asyncio.run(run())
    assert running == 1 and sent == 1  # the prefill was still running, over the link, when the client left
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = ray.get([h.stats.remote() for h in stepping])
        if all(s.load.running == 0 and s.load.waiting == 0 and s.load.kv_usage == 0.0 for s in stats):
            break
        time.sleep(0.2)
    assert all(s.load.running == 0 and s.load.waiting == 0 and s.load.kv_usage == 0.0 for s in stats), stats
