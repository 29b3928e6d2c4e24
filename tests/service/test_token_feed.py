"""Token feeds (service.token_feed, decode_worker.token_feed) on a real local Ray with the synthetic workers of
`dsv4 bench frontdoor` (no model: a step clock gives every running request one token a step), over both transports
(DSV4_TOKEN_FEED_TRANSPORT: a TCP connection the worker opens back to the replica, or a Ray stream): many concurrent
requests' tokens over one feed arrive complete and in order per request; aborting one stops only it; a killed decode
worker fails every request on its feed as WorkerDied and the next request opens a new feed to the restarted actor; a
request whose reader stops reading holds back no other, and overflowing its queue fails it alone; a dead replica's
feed leaves the worker (TCP: at once, as its connection closes). TCP only: a connection without the feed's HELLO (the
cluster token and the feed's key) is closed unanswered; a replica that stops reading overflows the worker's bounded
buffer for its feed, which ends that feed alone."""

from __future__ import annotations

import asyncio
import tempfile
import time

import pytest

from engine.execution.sampling_params import SamplingParams
from router.dispatch import DispatchRequest, WorkerDied
from router.migration import Code, RouterFailure
from tests.support import decode_load, placements

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
RATE = 100.0  # steps a second
LETTER = 70
TOKEN = "cluster-token-of-the-test"


@pytest.fixture(params=["tcp", "ray"])
def transport(request) -> str:
    return request.param


def _feeds(transport: str, **kw):
    from service.token_feed import TokenFeeds

    return TokenFeeds(transport=transport, token=TOKEN, **kw)


@pytest.fixture(scope="module")
def pool():
    from service.frontdoor_workers import SyntheticDecode, SyntheticPrefill

    started = not ray.is_initialized()
    if started:
        from service.ray_cluster import init_ray

        init_ray(tempfile.mkdtemp(prefix="dsv4-test-metrics-"))  # retries a start that misses Ray's deadline
    actor = ray.remote(num_cpus=0, max_concurrency=1000, max_restarts=-1)
    threaded = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=-1)  # a thread each: see bench_frontdoor.start
    prefill = threaded(SyntheticPrefill).remote("p0", RATE, LETTER)
    decode = actor(SyntheticDecode).remote("d0", RATE, LETTER, TOKEN)
    ray.get([prefill.ping.remote(), decode.ping.remote()])
    yield prefill, decode
    if started:
        ray.shutdown()


def _workers(pool):
    from service.ray_stream import Workers

    return Workers("p0", pool[0], "d0", pool[1])


def _request(rid: str, n: int) -> DispatchRequest:
    return DispatchRequest(rid, (1, 2, hash(rid) % 1000), SamplingParams(max_new_tokens=n, ignore_eos=True))


def _expected(n: int) -> list[int]:
    from service.frontdoor_workers import token_for

    return [token_for(k, LETTER) for k in range(n)]


def test_many_requests_share_one_feed_in_order(pool, transport):
    from service.ray_stream import RayStreamer

    async def run():
        feeds = _feeds(transport)
        streamer = RayStreamer(feeds=feeds)
        lengths = [5 + (i % 7) * 3 for i in range(24)]
        got = await asyncio.gather(
            *(placements.tokens(streamer, _request(f"many-{i}", n), _workers(pool)) for i, n in enumerate(lengths))
        )
        opened = len(feeds)
        await feeds.close()
        return lengths, got, opened

    lengths, got, opened = asyncio.run(run())
    assert opened == 1  # one feed to the one decode worker carried all of them
    for n, tokens in zip(lengths, got):
        assert tokens == _expected(n)
    assert decode_load.wait_idle(pool[1]) == 0


def test_abort_of_one_request_stops_only_it(pool, transport):
    from service.ray_stream import RayStreamer

    async def run():
        feeds = _feeds(transport)
        streamer = RayStreamer(feeds=feeds)
        stay = [streamer.run_placement(_request(f"stay-{i}", 100_000), _workers(pool)) for i in range(4)]
        leaving = streamer.run_placement(_request("leaves", 100_000), _workers(pool))
        for events in (*stay, leaving):
            await anext(events)
        for _ in range(5):
            await anext(leaving)
        await leaving.aclose()  # the client left: the streamer aborts it on both workers (fire-and-forget)
        deadline = time.monotonic() + 30
        while (running := (await pool[1].stats.remote()).load.running) > 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        got = [[(await anext(events)).token_id for _ in range(20)] for events in stay]  # they go on
        for events in stay:
            await events.aclose()
        await feeds.close()
        return running, got

    running_after_abort, got = asyncio.run(run())
    assert running_after_abort == 4  # the one that left is off the step clock, the others are not
    assert all(tokens == _expected(21)[1:] for tokens in got)  # tokens 1..20, after the first one read above
    assert decode_load.wait_idle(pool[1]) == 0


def test_slow_reader_holds_back_no_other_and_overflow_fails_it_alone(pool, transport):
    from service.ray_stream import RayStreamer

    async def run():
        feeds = _feeds(transport, queue_limit=8)
        streamer = RayStreamer(feeds=feeds)
        slow = streamer.run_placement(_request("slow", 60), _workers(pool))
        await anext(slow)  # its first token, then nobody reads it
        # a reader that waited on the unread request would never finish this one (the timeout turns that into a fail)
        fast = await asyncio.wait_for(placements.tokens(streamer, _request("fast", 30), _workers(pool)), 60)
        with pytest.raises(RouterFailure) as failed:
            while True:
                await anext(slow)
        await slow.aclose()
        await feeds.close()
        return fast, failed.value

    fast, failure = asyncio.run(run())
    assert fast == _expected(30)
    assert failure.code == Code.RESOURCE_EXHAUSTED
    assert decode_load.wait_idle(pool[1]) == 0  # the overflowed request was aborted on the worker


def test_killed_decode_worker_fails_its_feed_then_a_new_feed_opens(pool, transport):
    from service.ray_stream import RayStreamer

    async def run():
        feeds = _feeds(transport)
        streamer = RayStreamer(feeds=feeds)
        streams = [streamer.run_placement(_request(f"doomed-{i}", 500), _workers(pool)) for i in range(3)]
        for s in streams:
            await anext(s)
            await anext(s)  # a decode token: it is on the feed
        ray.kill(pool[1], no_restart=False)
        errors = []
        for s in streams:
            with pytest.raises(WorkerDied) as died:
                while True:
                    await asyncio.wait_for(anext(s), 30)
            errors.append(died.value)
            await s.aclose()
        deadline = time.monotonic() + 60
        while True:  # the restarted actor answers: a new request opens a new feed there
            try:
                after = await placements.tokens(streamer, _request("after-restart", 6), _workers(pool))
                break
            except WorkerDied:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        await feeds.close()
        return errors, after

    errors, after = asyncio.run(run())
    assert [e.worker_id for e in errors] == ["d0"] * 3
    assert after == _expected(6)


def test_a_feed_the_worker_lacks_is_a_typed_error(pool):
    """`decode(feed=...)` naming a feed the worker process does not have (it restarted since the feed opened) fails
    before anything is reserved, and the error crosses Ray as itself (the ingress maps it to the worker's death)."""
    from decode_worker.token_feed import FeedUnknown
    from service.ray_items import cause, next_item

    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    result = ray.get(pool[0].prefill.remote("unknown-feed", [1, 2, 3], params))

    async def run():
        call = pool[1].decode.options(num_returns="streaming")
        stream = call.remote(result, [1, 2, 3], params, batch=True, feed="no-such-feed")
        with pytest.raises(ray.exceptions.RayTaskError) as failed:
            await next_item(stream)
        return cause(failed.value)

    error = asyncio.run(run())
    assert isinstance(error, FeedUnknown) and error.feed_id == "no-such-feed" and error.worker_id == "d0"


def test_a_lost_feed_fails_its_requests_and_the_next_opens_anew(pool, transport):
    """When a worker says it lacks a feed (FeedUnknown: its process restarted), the replica drops that feed at once:
    the requests on it get WorkerDied and the next request opens a new feed rather than the stale one again."""

    async def run():
        feeds = _feeds(transport)
        waiting = await feeds.subscribe("d0", pool[1], "on-the-lost-feed")
        lost_id = waiting.feed_id
        feeds.lost("d0", lost_id)
        with pytest.raises(WorkerDied) as died:
            await asyncio.wait_for(waiting.get(), 30)
        fresh = await feeds.subscribe("d0", pool[1], "after-the-loss")
        fresh.close()
        await feeds.close()
        return died.value, lost_id, fresh.feed_id

    died, lost_id, fresh_id = asyncio.run(run())
    assert died.worker_id == "d0" and fresh_id != lost_id


@ray.remote(num_cpus=0)
class _Replica:
    """An ingress replica's stand-in in its own process: a TokenFeeds with a short lease reading endless requests."""

    async def start(self, prefill, decode, n: int, lease_s: float, transport: str) -> str:
        from service.ray_stream import RayStreamer, Workers
        from service.token_feed import TokenFeeds

        self.feeds = TokenFeeds(lease_s=lease_s, transport=transport, token=TOKEN)
        streamer = RayStreamer(feeds=self.feeds)
        self.tokens = 0

        async def read(i: int) -> None:
            async for _ in streamer.run_placement(
                _request(f"orphan-{i}", 100_000), Workers("p0", prefill, "d0", decode)
            ):
                self.tokens += 1

        self.readers = [asyncio.get_running_loop().create_task(read(i)) for i in range(n)]
        while self.tokens < 5 * n:  # every request is on the feed
            await asyncio.sleep(0.02)
        return self.feeds.feed_id("d0")


def test_a_dead_replicas_feed_expires_and_frees_its_requests(pool, transport):
    """Ray does not end a streaming call whose caller died: the feed's lease does. The replica's process is killed;
    within the lease (5 s, renewed every 5/3 s while alive: over Ray, or as frames on the TCP feed itself; 3.3 s of
    slack for a loaded CI machine) the worker ends the feed and drops its requests."""
    replica = _Replica.remote()
    feed_id = ray.get(replica.start.remote(pool[0], pool[1], 3, 5.0, transport))
    time.sleep(6.5)  # past the lease: renewals kept it open
    alive_after_lease = ray.get(pool[1].renew_feed.remote(feed_id)), decode_load.running(pool[1])
    ray.kill(replica)
    assert alive_after_lease == (True, 3)
    assert decode_load.wait_idle(pool[1], 20.0) == 0  # its requests were dropped, not run for their 100 000 tokens
    assert ray.get(pool[1].renew_feed.remote(feed_id)) is False


def test_a_dead_replicas_tcp_feed_ends_with_its_connection(pool):
    """Over TCP the worker does not wait for the lease: the killed replica's connection closes, and the feed ends
    and drops its requests at once (the lease here, 600 s, could not be what ended it)."""
    replica = _Replica.remote()
    feed_id = ray.get(replica.start.remote(pool[0], pool[1], 3, 600.0, "tcp"))
    assert decode_load.running(pool[1]) == 3
    killed = time.monotonic()
    ray.kill(replica)
    assert decode_load.wait_idle(pool[1], 20.0) == 0
    freed_s = time.monotonic() - killed
    assert ray.get(pool[1].renew_feed.remote(feed_id)) is False
    assert freed_s < 20.0


def test_an_idle_feed_closes_and_the_next_request_opens_one(pool, transport):
    from service.ray_stream import RayStreamer

    async def run():
        feeds = _feeds(transport, idle_s=0.5)
        streamer = RayStreamer(feeds=feeds)
        first = await placements.tokens(streamer, _request("before-idle", 4), _workers(pool))
        first_id = feeds.feed_id("d0")
        deadline = time.monotonic() + 20
        while len(feeds) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        closed = len(feeds) == 0
        while (await pool[1].renew_feed.remote(first_id)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the cancelled call's end reaches the worker
        gone_on_worker = not await pool[1].renew_feed.remote(first_id)
        again = await placements.tokens(streamer, _request("after-idle", 4), _workers(pool))
        again_id = feeds.feed_id("d0")
        await feeds.close()
        return first, closed, gone_on_worker, again, first_id != again_id

    first, closed, gone_on_worker, again, new_feed = asyncio.run(run())
    assert first == again == _expected(4)
    assert closed and gone_on_worker and new_feed


def _listener_of(feeds):
    listener = feeds.listener
    assert listener is not None and listener.port
    return listener.host, listener.port


def _refused(addr, payload: bytes | None, timeout_s: float = 10.0) -> bool:
    """Connect, send `payload` (None: nothing), -> whether the listener closed the connection without a byte."""
    import socket

    with socket.create_connection(addr, timeout=timeout_s) as sock:
        if payload is not None:
            sock.sendall(payload)
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True


def test_tcp_listener_refuses_connections_without_the_feeds_hello(pool, monkeypatch):
    """Garbage, an oversized frame, a HELLO with a wrong token or a wrong key, a HELLO for a feed already claimed, and
    silence past the HELLO deadline are each closed unanswered; the feed expected keeps waiting for its own worker,
    and the one open goes on delivering."""
    from decode_worker import feed_wire
    from service import tcp_feed
    from service.ray_stream import RayStreamer

    monkeypatch.setattr(tcp_feed, "HELLO_TIMEOUT_S", 0.5)

    class Expected:  # what the listener knows of a feed it waits for: its id and key
        feed_id, key = "expected-feed", "the-right-key"

    async def run():
        feeds = _feeds("tcp")
        streamer = RayStreamer(feeds=feeds)
        events = streamer.run_placement(_request("alongside", 100_000), _workers(pool))
        await anext(events)
        addr = _listener_of(feeds)
        feeds.listener.expect(Expected)
        open_feed = feeds._feeds["d0"]  # its id and key, to replay the HELLO its worker sent
        attempts = {
            "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            "oversized": (1 << 20).to_bytes(4, "big") + b"x" * 64,
            "wrong token": feed_wire.hello("expected-feed", "not-the-token", "the-right-key"),
            "wrong key": feed_wire.hello("expected-feed", TOKEN, "not-the-key"),
            "claimed already": feed_wire.hello(open_feed.feed_id, TOKEN, open_feed.key),
            "silent": None,
        }
        refused = {}
        for name, payload in attempts.items():
            refused[name] = await asyncio.to_thread(_refused, addr, payload)
        still_expected = feeds.listener.claim("expected-feed", TOKEN, "the-right-key") is Expected
        got = [(await anext(events)).token_id for _ in range(5)]
        await events.aclose()
        await feeds.close()
        return refused, still_expected, got

    refused, still_expected, got = asyncio.run(run())
    assert refused == dict.fromkeys(refused, True)
    assert still_expected
    assert got == _expected(6)[1:]  # after the first token read above


@pytest.fixture(scope="module")
def small_buffer_decode():
    """A decode worker whose TCP feeds overflow after 64 KiB unsent (DSV4_TOKEN_FEED_BUFFER_BYTES)."""
    from dsv4_kernels.settings import TOKEN_FEED_BUFFER_BYTES
    from service.frontdoor_workers import SyntheticDecode

    env = {"env_vars": {TOKEN_FEED_BUFFER_BYTES: str(64 << 10)}}
    actor = ray.remote(num_cpus=0, max_concurrency=1000, runtime_env=env)(SyntheticDecode)
    decode = actor.remote("d1", 200.0, LETTER, TOKEN)
    ray.get(decode.ping.remote())
    yield decode
    ray.kill(decode)


def test_tcp_replica_that_stops_reading_overflows_only_its_feed(pool, small_buffer_decode):
    """A 'replica' that accepts the worker's call and never reads (a small receive buffer): the worker never waits on
    it; once its feed's unsent bytes pass the bound the feed ends and its requests are dropped, while a real replica's
    feed on the same worker streams every token in order."""
    import socket

    from decode_worker.token_feed import FeedUnknown
    from service.ray_items import next_item
    from service.ray_stream import RayStreamer, Workers

    decode = small_buffer_decode
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # accepted sockets inherit it
    stuck.bind(("127.0.0.1", 0))
    stuck.listen()
    params = SamplingParams(max_new_tokens=100_000, ignore_eos=True)

    async def run():
        await decode.open_tcp_feed.remote("stuck-feed", "127.0.0.1", stuck.getsockname()[1], "any-key", None)
        streams = []
        for i in range(150):
            rid, prompt = f"stuck-{i}", [1, 2, i]
            result = await pool[0].prefill.remote(rid, prompt, params)
            call = decode.decode.options(num_returns="streaming")
            stream = call.remote(result, prompt, params, batch=True, feed="stuck-feed")
            try:
                await next_item(stream)  # Transferred: it is on the stuck feed
            except FeedUnknown:  # it overflowed already: the earlier requests' tokens filled it while these opened
                break
            streams.append(stream)
        feeds = _feeds("tcp")
        streamer = RayStreamer(feeds=feeds)
        live = streamer.run_placement(_request("live", 100_000), Workers("p0", pool[0], "d1", decode))
        got = [(await anext(live)).token_id]
        deadline = time.monotonic() + 60
        while (await decode.renew_feed.remote("stuck-feed")) and time.monotonic() < deadline:
            got.append((await asyncio.wait_for(anext(live), 10)).token_id)
        overflowed = not await decode.renew_feed.remote("stuck-feed")
        running = (await decode.stats.remote()).load.running
        got += [(await asyncio.wait_for(anext(live), 10)).token_id for _ in range(20)]
        await live.aclose()
        await feeds.close()
        return overflowed, running, got

    try:
        overflowed, running, got = asyncio.run(run())
    finally:
        stuck.close()
    assert overflowed  # the stuck feed ended on the worker
    assert running == 1  # its 150 requests were dropped; the live one runs on
    assert got == _expected(len(got))  # every token of the live request, in order, through the overflow
    assert decode_load.wait_idle(decode) == 0
