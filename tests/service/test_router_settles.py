"""service.direct_path.RouterSet's settles against a real gRPC router: a settle rides on the next Place to the same
router, or goes with the others due in one Settle call after SETTLE_WAIT_S, or at close; none is lost when the Place
that carried it fails to reach the router. The router replica is `tests.router`'s harness (a real RouterServer on a
scripted dispatcher); its Ray actor handle is stood in for by an object that answers `address.remote()`."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.execution.sampling_params import SamplingParams
from router.client import AsyncRouterClient, RouterError
from router.dispatch import DispatchRequest
from service import direct_path
from service.direct_path import RouterSet
from tests.router.test_router_admission import Harness, wait_until_async


class _Address:
    def __init__(self, addr: str):
        self.addr = addr

    def remote(self):
        async def answer():
            return self.addr

        return answer()


class RouterHandle:
    """What RouterSet asks of a router's Ray actor: its address."""

    def __init__(self, addr: str):
        self.address = _Address(addr)


@pytest.fixture
def router():
    h = Harness(max_queued=4, queue_timeout_s=30.0)
    h.dispatcher.slots = 16
    yield h
    h.close()


def test_settles_ride_on_places_then_go_together(router, monkeypatch):
    monkeypatch.setattr(direct_path, "SETTLE_WAIT_S", 0.3)
    settle_calls = []
    settle_many = AsyncRouterClient.settle_many

    async def counting_settle_many(self, request_ids):
        settle_calls.append(list(request_ids))
        return await settle_many(self, request_ids)

    monkeypatch.setattr(AsyncRouterClient, "settle_many", counting_settle_many)

    async def go():
        rs = RouterSet([RouterHandle(router.addr)], token=None, timeout_s=10.0)
        place = lambda rid: rs.place(DispatchRequest(rid, (5, 6, 7), SamplingParams()), {}, None)  # noqa: E731
        for rid in ("a", "b"):
            assert (await place(rid))[0] == 0
        assert router.held() >= {"a", "b"}
        rs.settle(0, "a")
        await place("c")  # carries a's settle: the next probe releases it, no Settle call made
        await wait_until_async(lambda: "a" not in router.held())
        assert {"b", "c"} <= router.held() and not settle_calls
        rs.settle(0, "b")
        rs.settle(0, "c")  # no Place follows: both go in one Settle call once SETTLE_WAIT_S has passed
        await asyncio.sleep(0.1)
        assert {"b", "c"} <= router.held() and not settle_calls
        await wait_until_async(lambda: not router.held() & {"b", "c"})
        assert settle_calls == [["b", "c"]]
        await place("d")
        rs.settle(0, "d")
        await rs.close()  # what is due goes at close
        assert settle_calls[-1] == ["d"]
        await wait_until_async(lambda: "d" not in router.held())

    asyncio.run(go())


def test_a_failed_place_keeps_its_settles_due(router, monkeypatch):
    """A Place that does not reach the router (here: a channel that fails) puts its settles back: they go later."""
    monkeypatch.setattr(direct_path, "SETTLE_WAIT_S", 0.2)

    async def go():
        rs = RouterSet([RouterHandle(router.addr)], token=None, timeout_s=10.0, failover_wait_s=0.0)
        req = DispatchRequest("x", (5, 6, 7), SamplingParams())
        await rs.place(req, {}, None)
        client = await rs._client(0)
        real_place = client.place

        async def unreachable_place(*args, **kwargs):
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "connection refused")

        client.place = unreachable_place
        rs.settle(0, "x")
        with pytest.raises(Exception, match="no router replica is reachable"):
            await rs.place(DispatchRequest("y", (5, 6, 7), SamplingParams()), {}, None)
        client.place = real_place
        assert rs._unsettled.get(0) == ["x"]  # due again, not lost with the failed call
        # the router was dropped for the failure: its next client settles it at the next Place
        await rs.place(DispatchRequest("z", (5, 6, 7), SamplingParams()), {}, None)
        await wait_until_async(lambda: "x" not in router.held())
        await rs.close()

    asyncio.run(go())
