"""Router admission: requests queue (bounded, with a timeout) when no decode worker has a slot and pages, wait
for a pool's only worker to come back, and come out as RESOURCE_EXHAUSTED / UNAVAILABLE saying "retry later".

The real gRPC router and client; the dispatcher is a scripted one (one prefill, one decode worker reporting
`max_slots`), so the test decides when a request finishes and when a worker is up. The same paths run end to
end on Ray in tests/service/test_service_faults.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from engine.execution.request import TokenEvent
from router.client import RouterClient, RouterError
from router.dispatch import WorkerInfo
from router.policy import PolicyConfig, RoutingPolicy
from router.server import RouterServer


class ScriptedDispatcher:
    """Requests produce one token, then wait until `finish()` lets them end."""

    def __init__(self, slots: int):
        self.slots, self.decode_up = slots, True
        self.gate: asyncio.Event | None = None
        self.running = 0
        self.reported = 0  # requests d0 reports holding (what Place's admission counts: placements run elsewhere)

    def workers(self):
        return [
            WorkerInfo("p0", "prefill", True, incarnation="1"),
            WorkerInfo(
                "d0",
                "decode",
                self.decode_up,
                running=self.reported,
                kv_free_tokens=1 << 20,
                incarnation="1",
                max_slots=self.slots,
                kv_capacity_tokens=1 << 20,
            ),
        ]

    async def generate(self, request, prefill_id, decode_id):
        if self.gate is None:
            self.gate = asyncio.Event()
        gate = self.gate  # this request's gate: finish_all may replace self.gate while we are suspended at the yield
        self.running += 1
        try:
            yield TokenEvent(request.request_id, 7, -0.5, False, None, ())
            await gate.wait()
            yield TokenEvent(request.request_id, 8, -0.5, True, "length", ())
        finally:
            self.running -= 1

    async def health_check(self):
        return {"p0": True, "d0": self.decode_up}


class Harness:
    def __init__(self, policy: PolicyConfig | None = None, **server_kw):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.dispatcher = ScriptedDispatcher(slots=2)
        self.server = RouterServer(
            self.dispatcher, RoutingPolicy(policy or PolicyConfig("least_loaded")), health_interval_s=0.05, **server_kw
        )
        self.addr = f"127.0.0.1:{self.run(self.server.start('127.0.0.1', 0))}"

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def finish_all(self):
        async def go():
            self.dispatcher.gate.set()
            self.dispatcher.gate = None

        self.run(go())

    def close(self):
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)

    def held(self) -> set[str]:
        """Ids of the placements the router holds (not yet settled)."""
        return set(self.server.holds._holds)


def wait_until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


async def wait_until_async(cond, timeout: float = 10.0) -> None:
    """wait_until on a running event loop (the loop keeps serving while it waits)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


@pytest.fixture
def harness():
    h = Harness(max_queued=2, queue_timeout_s=30.0)
    yield h
    h.close()


def test_full_decode_queues_then_turns_away_then_drains(harness):
    h = harness
    clients = [RouterClient(h.addr, timeout_s=30) for _ in range(4)]
    streams = [c.generate([5, 6, 7], request_id=f"r{i}") for i, c in enumerate(clients)]
    out = [None] * 4

    def consume(i):
        try:
            out[i] = [ev.token_id for ev in streams[i]]
        except RouterError as e:
            out[i] = e

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: h.dispatcher.running == 2 and h.server._queued == 2)  # 2 slots busy, 2 waiting
    with RouterClient(h.addr, timeout_s=30) as c, pytest.raises(RouterError) as info:
        c.generate_full([5, 6, 7])
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in info.value.message
    h.finish_all()  # the first two end; the queued two take their slots
    wait_until(lambda: h.dispatcher.running == 2 and h.server._queued == 0)
    h.finish_all()
    for t in threads:
        t.join(20)
    assert out == [[7, 8]] * 4
    for c in clients:
        c.close()


def test_queue_timeout_is_unavailable():
    h = Harness(max_queued=4, queue_timeout_s=0.3)
    try:
        c = RouterClient(h.addr, timeout_s=30)
        held = [c.generate([5, 6], request_id=f"h{i}") for i in range(2)]
        for s in held:
            assert next(s).token_id == 7
        with pytest.raises(RouterError) as info:
            c.generate_full([5, 6, 7])
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no decode capacity" in info.value.message
        h.finish_all()
        for s in held:
            assert [ev.token_id for ev in s] == [8]
    finally:
        h.close()


def test_request_waits_for_the_only_decode_worker_to_come_back():
    h = Harness(restart_wait_s=30.0)
    try:
        h.dispatcher.decode_up = False
        wait_until(lambda: not RouterClient(h.addr, timeout_s=5).health().serving)
        result = {}

        def call():
            with RouterClient(h.addr, timeout_s=30) as c:
                events = c.generate([5, 6, 7])
                result["first"] = next(events).token_id

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)
        assert "first" not in result  # waiting, not failed
        h.dispatcher.decode_up = True  # "Ray restarted it": the health loop adds it back
        t.join(20)
        assert result == {"first": 7}
        h.finish_all()
    finally:
        h.close()


def test_policy_admits_by_slots_and_whole_pages():
    pol = RoutingPolicy(PolicyConfig("least_loaded"))
    d = WorkerInfo("d0", "decode", True, kv_free_tokens=0, max_slots=2, kv_capacity_tokens=1024, kv_page_tokens=256)
    p = WorkerInfo("p0", "prefill", True)
    assert pol.fits(d, 1024) and not pol.fits(d, 1025)  # a stale report (0 free) does not matter
    pol.place([5, 6, 7], 10, [p, d])
    pol.acquire("d0", 10)  # 10 tokens reserve a whole 256-token page
    assert pol.effective_free_tokens(d) == 768 and pol.effective_free_slots(d) == 1
    assert pol.fits(d, 768) and not pol.fits(d, 769)
    pol.acquire("d0", 10)
    assert pol.effective_free_slots(d) == 0 and not pol.can_admit(10, [p, d])
    assert pol.can_admit(4096, [p, d])  # can never fit anywhere: let the engine reject it with a clear error
    pol.release("d0", 10)
    assert pol.can_admit(10, [p, d]) and pol.effective_free_tokens(d) == 768
    colocated = WorkerInfo("c0", "colocated", True)
    assert pol.can_admit(10**9, [colocated])  # no decode pool: the engine queues itself


def _local_router(**server_kw):
    """The real router over two in-process engines (LocalDispatcher), on its own loop thread."""
    from router.local_dispatch import LocalDispatcher

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    dispatcher = LocalDispatcher(2)
    server = RouterServer(
        dispatcher,
        RoutingPolicy(PolicyConfig("least_loaded")),
        health_interval_s=3600.0,
        restart_wait_s=0.5,
        **server_kw,
    )
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(30)

    def close():
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        dispatcher.close()

    return dispatcher, f"127.0.0.1:{port}", close


@pytest.mark.parametrize("max_migrations", [2, 0])
def test_worker_death_mid_stream_migrates_or_fails_cleanly(max_migrations):
    from engine.execution.sampling_params import SamplingParams
    from engine.llm import LLM

    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    prompt = [(5 * i + 1) % 400 + 2 for i in range(20)]
    want = LLM().generate([prompt], params)[0].token_ids
    dispatcher, addr, close = _local_router(max_migrations=max_migrations)
    try:
        with RouterClient(addr, timeout_s=60) as c:
            events = c.generate(prompt, params, request_id="mig")
            first = [next(events) for _ in range(3)]  # in flight: three tokens streamed
            dispatcher.kill(first[0].decode_worker)
            if max_migrations == 0:
                with pytest.raises(RouterError) as info:
                    list(events)
                assert info.value.code == grpc.StatusCode.UNAVAILABLE
                assert f"worker {first[0].decode_worker} died" in info.value.message and "retry" in info.value.message
                return
            rest = list(events)
        got = [e.token_id for e in first + rest if e.token_id is not None]
        assert got == want  # the continuation (prompt + streamed tokens, on the other engine) changes nothing
        assert rest[-1].finished and rest[-1].finish_reason == "length"
    finally:
        close()


def test_place_admits_by_reports_and_held_placements():
    """Place (the service's path: the caller streams, the router never sees a stream end): a placement counts as
    in flight until the caller settles it (it reached its decode worker) and a later probe's report shows it; a
    request that fits neither waits in the queue, a full queue is RESOURCE_EXHAUSTED, bad input INVALID_ARGUMENT,
    and a retry after a death excludes that incarnation of the worker (here the only one: UNAVAILABLE once
    restart_wait_s passes)."""
    h = Harness(
        PolicyConfig("least_loaded", reported_load=True),
        max_queued=1,
        queue_timeout_s=30.0,
        restart_wait_s=0.5,
    )
    c = RouterClient(h.addr, timeout_s=30)
    try:
        first = [c.place([5, 6, 7], request_id=f"p{i}") for i in range(2)]  # both slots, held by the router
        assert [(p.prefill_worker, p.decode_worker, p.decode_incarnation) for p in first] == [("p0", "d0", "1")] * 2
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(c.place([5, 6, 7], request_id="p2")))
        waiter.start()
        wait_until(lambda: h.server._queued == 1)
        with pytest.raises(RouterError) as info:  # the queue (1) is full
            c.place([5, 6, 7], request_id="p3")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in info.value.message
        time.sleep(0.5)  # many probes: the worker reports nothing yet, the unsettled holds still count
        assert h.server._queued == 1 and not got and len(h.server.holds) == 2
        h.dispatcher.reported = 2  # both reached the decode worker, which reports them ...
        assert c.settle("p0") and c.settle("p1")  # ... and the caller says so: the next probe releases the holds
        wait_until(lambda: len(h.server.holds) == 0)
        assert h.server._queued == 1 and not got  # the report still shows both slots taken
        h.dispatcher.reported = 1  # one stream ended: the next probe's report frees a slot
        waiter.join(10)
        assert got and got[0].decode_worker == "d0"
        assert c.settle("p2") and not c.settle("unknown")
        with pytest.raises(RouterError) as info:
            c.place([], request_id="empty")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in info.value.message
        h.dispatcher.reported = 0
        wait_until(lambda: len(h.server.holds) == 0)
        retries = h.server.metrics.retries
        with pytest.raises(RouterError) as info:  # d0's incarnation "1" died on it: nowhere else to go
            c.place([5, 6, 7], request_id="p4", excluded={"d0": "1"}, retry=True)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no healthy worker" in info.value.message
        assert h.server.metrics.retries == retries + 1
        assert c.place([5, 6, 7], request_id="p5").decode_worker == "d0"  # the probe found d0 up again
    finally:
        c.close()
        h.close()


def test_settles_ride_on_the_next_place_or_go_together():
    """A caller's settles carried on its next Place are settled whatever that Place's answer (here a full queue's
    RESOURCE_EXHAUSTED); one Settle call settles several; a batch naming an unknown placement says not all held."""
    h = Harness(PolicyConfig("least_loaded", reported_load=True), max_queued=0, queue_timeout_s=30.0)
    c = RouterClient(h.addr, timeout_s=30)
    try:
        for i in range(2):
            c.place([5, 6, 7], request_id=f"s{i}")  # both slots, held until settled and reported
        assert set(h.server.holds._holds) == {"s0", "s1"}
        with pytest.raises(RouterError) as info:  # no slot, no queue: refused, but its settles still count
            c.place([5, 6, 7], request_id="s2", settled=["s0"])
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        h.dispatcher.reported = 2
        wait_until(lambda: set(h.server.holds._holds) == {"s1"})  # s0 settled by the refused Place, s1 not
        assert c.settle_many(["s1"]) and not c.settle_many(["s1", "never-placed"])
        wait_until(lambda: len(h.server.holds) == 0)
    finally:
        c.close()
        h.close()


def test_placement_holds_release_once_covered_or_too_old():
    from router.placement_holds import PlacementHolds

    released: list[str] = []
    holds = PlacementHolds(max_hold_s=10.0)
    for rid in ("a", "b", "c"):
        holds.add(rid, lambda rid=rid: released.append(rid), now=0.0)
    assert holds.settle("a", now=1.0) and holds.settle("b", now=3.0) and not holds.settle("x", now=1.0)
    assert holds.release_covered(probe_started=0.5, now=1.5) == 0  # that probe began before either settle
    assert holds.release_covered(probe_started=2.0, now=2.5) == 1 and released == ["a"]
    assert holds.release_covered(probe_started=4.0, now=4.5) == 1 and released == ["a", "b"]
    assert holds.release_covered(probe_started=9.0, now=9.5) == 0  # "c" never settled: held ...
    assert holds.release_covered(probe_started=11.0, now=11.5) == 1 and released == ["a", "b", "c"]  # ... till max
    with pytest.raises(ValueError, match="max_hold_s"):
        PlacementHolds(0)
