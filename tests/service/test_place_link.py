"""Place over a router's place link (DSV4_PLACE_LINK: a PLACE frame on a TCP connection the router opened to the
ingress replica's token feed listener instead of the gRPC call; router.place_link, service.place_link), real
sockets: the replica's side is the real FeedListener + PlaceLinks + RouterSet in this process, each router a real
RouterServer (`tests.router`'s harness: its own loop and thread, a scripted dispatcher) whose Ray actor handle is
stood in for by an object answering `address` and `open_place_link` as RouterActor does.

Once the link is up every Place takes it (none the gRPC call) and its answer is the gRPC one's; a settle rides on
the next PLACE or goes in one SETTLE frame; a refusal comes back with gRPC's code and message; a caller that leaves
(or whose deadline passes) while its request waits in the router's queue takes it out of that queue; a link lost
while a Place waits on it (its router died) fails that Place over to the other router replica, which places it; a
router that names no PLACE (an older release) keeps gRPC. The router killed as a Ray actor while streams run is
tests/service/test_service_faults.py's (the whole service, links on by default)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.execution.sampling_params import SamplingParams
from router import place_link
from router.client import AsyncRouterClient, RouterError, place_request
from router.dispatch import DispatchRequest
from service import direct_path
from service.direct_path import RouterSet
from service.place_link import PlaceLinks
from service.tcp_feed import FeedListener
from tests.router.test_router_admission import Harness, wait_until_async

TOKEN = "cluster-token-of-the-test"


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class RouterHandle:
    """What RouterSet and PlaceLinks ask of a router's Ray actor: its address, and to open a place link (run on the
    router's own loop, as the actor runs it; `takes`: what its reply names)."""

    def __init__(self, h: Harness, takes: tuple = place_link.TAKES):
        self.h = h
        self.opened = 0

        async def address():
            return h.addr

        async def open_link(link_id, host, port, key):
            coro = place_link.connect(link_id, host, port, TOKEN, key, h.server)
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, h.loop))
            self.opened += 1
            return takes

        self.address = _Remote(address)
        self.open_place_link = _Remote(open_link)


@pytest.fixture
def routers():
    hs = [Harness(max_queued=4, queue_timeout_s=30.0) for _ in range(2)]
    for h in hs:
        h.dispatcher.slots = 16
    yield hs
    for h in hs:
        h.close()


def _req(rid: str, prompt=(5, 6, 7)) -> DispatchRequest:
    return DispatchRequest(rid, prompt, SamplingParams())


async def _router_set(handles, **kw) -> tuple[RouterSet, PlaceLinks]:
    links = PlaceLinks(FeedListener(TOKEN, "127.0.0.1"))
    return RouterSet(handles, token=None, timeout_s=10.0, links=links, **kw), links


async def _link_up(links: PlaceLinks, i: int, handle) -> None:
    links.ready(i, handle)
    await wait_until_async(lambda: links.up(i) is not None)


def _counting_grpc_places(monkeypatch) -> list[str]:
    calls: list[str] = []
    place = AsyncRouterClient.place

    async def counting(self, prompt_ids, params=None, request_id="", *args, **kwargs):
        calls.append(request_id)
        return await place(self, prompt_ids, params, request_id, *args, **kwargs)

    monkeypatch.setattr(AsyncRouterClient, "place", counting)
    return calls


def test_places_take_the_link_with_the_grpc_answer(routers, monkeypatch):
    """The first Place goes over gRPC while the link opens; from then on every one is a PLACE frame, answered as
    over gRPC; settles ride on the next PLACE or go in one SETTLE frame (no gRPC Settle)."""
    monkeypatch.setattr(direct_path, "SETTLE_WAIT_S", 0.2)
    h = routers[0]
    grpc_places = _counting_grpc_places(monkeypatch)
    settle_calls: list = []

    async def no_grpc_settle(self, request_ids):
        settle_calls.append(request_ids)
        return True

    monkeypatch.setattr(AsyncRouterClient, "settle_many", no_grpc_settle)

    async def go():
        handle = RouterHandle(h)
        rs, links = await _router_set([handle])
        _, first = await rs.place(_req("a"), {}, None)
        assert grpc_places == ["a"] and links.calls_sent() == 0
        await wait_until_async(lambda: links.up(0) is not None)
        for rid in ("b", "c", "d"):
            _, where = await rs.place(_req(rid), {}, None)
            assert (where.request_id, where.prefill_worker, where.decode_worker) == (rid, "p0", "d0")
            assert (where.decode_incarnation, where.hash_scheme) == (first.decode_incarnation, first.hash_scheme)
        assert grpc_places == ["a"] and links.calls_sent() == 3 and handle.opened == 1
        assert {"a", "b", "c", "d"} <= h.held()
        rs.settle(0, "a")
        await rs.place(_req("e"), {}, None)  # carries a's settle: the next probe releases it
        await wait_until_async(lambda: "a" not in h.held())
        for rid in ("b", "c"):
            rs.settle(0, rid)  # no Place follows: one SETTLE frame once SETTLE_WAIT_S has passed
        await wait_until_async(lambda: not h.held() & {"b", "c"})
        assert not settle_calls and links.calls_sent() == 4
        await rs.close()

    asyncio.run(go())


def test_a_refusal_over_the_link_is_grpcs(routers):
    """The router's own verdicts come back with the gRPC call's code and message."""
    h = routers[0]

    async def go():
        handle = RouterHandle(h)
        _, links = await _router_set([handle])
        await _link_up(links, 0, handle)
        link = links.up(0)
        client = AsyncRouterClient(h.addr, timeout_s=10.0)
        bad = ((), SamplingParams(), "empty")  # INVALID_ARGUMENT: an empty prompt
        draining = ((5, 6), SamplingParams(), "late")  # UNAVAILABLE: the router is shutting down
        for args, setup in ((bad, None), (draining, "drain")):
            if setup == "drain":
                h.server.draining = True
            with pytest.raises(RouterError) as over_grpc:
                await client.place(*args)
            with pytest.raises(RouterError) as over_link:
                await link.place(place_request(*args), 10.0)
            assert over_link.value.code == over_grpc.value.code != grpc.StatusCode.OK
            assert over_link.value.message == over_grpc.value.message
        await client.close()
        await links.close()

    asyncio.run(go())


def test_a_caller_leaving_takes_its_request_out_of_the_queue(routers):
    """A Place waiting in the router's queue (no decode slot) is cancelled there when its caller leaves or its
    deadline passes (a CANCEL frame), as a cancelled gRPC call is."""
    h = routers[0]
    h.dispatcher.slots = 1

    async def go():
        handle = RouterHandle(h)
        _, links = await _router_set([handle])
        await _link_up(links, 0, handle)
        link = links.up(0)
        await link.place(place_request((5, 6), SamplingParams(), "holds-the-slot"), 10.0)
        waiting = asyncio.ensure_future(link.place(place_request((5, 6), SamplingParams(), "waits"), 10.0))
        await wait_until_async(lambda: h.server._queued == 1)
        waiting.cancel()
        await wait_until_async(lambda: h.server._queued == 0)
        with pytest.raises(RouterError) as late:
            await link.place(place_request((5, 6), SamplingParams(), "expires"), 0.5)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until_async(lambda: h.server._queued == 0)
        assert link.usable()  # the link carries on
        await links.close()

    asyncio.run(go())


def test_a_lost_link_fails_its_place_over_to_another_router(routers):
    """Router 0's link goes away while a Place waits in its queue (its process died): that Place is placed by router
    1, the caller sees no error; the next ones go to router 1 while router 0 cools down."""
    h0, h1 = routers
    h0.dispatcher.slots = 1  # router 0 queues every request after its first

    async def go():
        handles = [RouterHandle(h0), RouterHandle(h1)]
        rs, links = await _router_set(handles)
        for i, handle in enumerate(handles):
            await _link_up(links, i, handle)
        await links.up(0).place(place_request((5, 6), SamplingParams(), "holds-the-slot"), 10.0)
        rs._next = 0  # the next Place tries router 0 first
        placing = asyncio.ensure_future(rs.place(_req("x"), {}, None))
        await wait_until_async(lambda: h0.server._queued == 1)
        link0 = links.up(0)
        assert link0 is not None and link0._conn is not None
        link0._conn.abort()  # what the router's death does to the replica's end
        index, where = await asyncio.wait_for(placing, 10.0)
        assert (index, where.request_id) == (1, "x")
        await wait_until_async(lambda: h0.server._queued == 0)  # the router's end cancelled what it held
        for rid in ("y", "z"):
            assert (await rs.place(_req(rid), {}, None))[0] == 1
        await rs.close()

    asyncio.run(go())


def test_a_router_naming_no_place_keeps_grpc(routers, monkeypatch):
    h = routers[0]
    grpc_places = _counting_grpc_places(monkeypatch)

    async def go():
        handle = RouterHandle(h, takes=())  # an older router: its reply names no PLACE
        rs, links = await _router_set([handle])
        for rid in ("a", "b", "c"):
            await rs.place(_req(rid), {}, None)
            await asyncio.sleep(0.1)
        assert grpc_places == ["a", "b", "c"] and links.calls_sent() == 0 and links.up(0) is None
        await rs.close()

    asyncio.run(go())
