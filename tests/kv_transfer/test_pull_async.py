"""TransferBackend.pull_async, the decode worker's pull: NIXL runs it on the caller's event loop thread (plan, post,
the READ polled between the loop's other work: no worker thread), any other backend on a worker thread; the same
bytes land as with `pull_deferred`; pulls that interleave on one loop keep their own stats; a cancelled pull
frees its staging range and tells the source (its pages are released with the error)."""

import asyncio
import threading
import time

import pytest

from kv_transfer.registry import make_backend
from tests.kv_transfer.test_kv_transfer import (
    DST_CACHE,
    NUM_TOKENS,
    SRC_CACHE,
    assert_moved,
    dst_table,
    random_pool,
    src_table,
    wait_poll,
)
from tests.kv_transfer.test_staging import assert_arenas_idle, dst_tables, nixl_pair
from tests.support.backends import BACKEND_NAMES, needs_nixl


def pulling_threads(backend, monkeypatch) -> set[int]:
    """The threads that run the backend's `_read_steps` (where a pull moves its bytes), collected as it runs."""
    seen: set[int] = set()
    steps = backend._read_steps

    def spy(*args):
        seen.add(threading.get_ident())
        return (yield from steps(*args))

    monkeypatch.setattr(backend, "_read_steps", spy)
    return seen


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_pull_async_moves_the_same_bytes_on_the_thread_its_backend_waits_on(kind, monkeypatch):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst = make_backend(kind, src_pool), make_backend(kind, dst_pool)
    try:
        dst.add_peer(src.worker_name, src.metadata())
        table, dtab = src_table(src_pool), dst_table(dst_pool)
        ticket = src.export("req", table, NUM_TOKENS)
        threads = pulling_threads(dst, monkeypatch)

        async def pull():
            stats, deferred = await dst.pull_async(ticket, dtab, timeout_s=10)
            if deferred is not None:
                deferred.run()
            return stats, threading.get_ident()

        stats, loop_thread = asyncio.run(pull())
        assert len(threads) == 1 and (loop_thread in threads) == (kind == "nixl")  # NIXL: no worker thread
        assert stats.bytes == dst.plan_for(ticket, dtab).total_bytes > 0 and stats.cpu_seconds > 0
        assert_moved(src_pool, dst_pool, ticket.page_table(), dtab, before)
        assert wait_poll(src) == [("req", None)]
        assert_arenas_idle(*(b for b in (src, dst) if kind == "nixl"))
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
def test_pulls_interleaved_on_one_loop_keep_their_own_stats_and_bytes(monkeypatch):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst, released = nixl_pair(src_pool, dst_pool)
    try:
        post, order = dst.agent.transfer, []

        def post_and_wait(handle, notif_msg=b""):  # every READ waits at least once: the two pulls interleave
            order.append("post")
            post(handle, notif_msg)
            return "PROC"

        check = dst.agent.check_xfer_state
        monkeypatch.setattr(dst.agent, "transfer", post_and_wait)
        monkeypatch.setattr(dst.agent, "check_xfer_state", lambda h: order.append("check") or check(h))
        tables = [src_table(src_pool), src_table(src_pool)]
        tickets = [src.export(f"r{i}", t, NUM_TOKENS - 40 * i) for i, t in enumerate(tables)]
        dtabs = dst_tables(dst_pool, 2)

        async def both():
            return await asyncio.gather(*(dst.pull_async(t, d, timeout_s=10) for t, d in zip(tickets, dtabs)))

        src_pages: dict[str, list[int]] = {}
        dst_pages: dict[str, list[int]] = {}
        for ticket, dtab, (stats, deferred) in zip(tickets, dtabs, asyncio.run(both())):
            assert stats.bytes == dst.plan_for(ticket, dtab).total_bytes and stats.descriptors == 1
            deferred.run()
            for name, pages in ticket.page_table().items():  # both requests' pages, checked together
                src_pages.setdefault(name, []).extend(pages)
                dst_pages.setdefault(name, []).extend(dtab[name][: len(pages)])
        assert order[:2] == ["post", "post"]  # the second READ was posted while the first waited
        assert_moved(src_pool, dst_pool, src_pages, dst_pages, before)
        deadline = time.monotonic() + 5
        while len(released) < 2 and time.monotonic() < deadline:
            src.poll()
        assert sorted(released) == [("r0", None), ("r1", None)]
        assert_arenas_idle(src, dst)
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
def test_a_cancelled_pull_async_frees_its_range_and_tells_the_source(monkeypatch):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = nixl_pair(src_pool, dst_pool)
    try:
        monkeypatch.setattr(dst.agent, "transfer", lambda h, notif_msg=b"": "PROC")  # a READ that never ends
        monkeypatch.setattr(dst.agent, "check_xfer_state", lambda h: "PROC")
        ticket = src.export("slow", src_table(src_pool), NUM_TOKENS)

        async def cancel_midway():
            task = asyncio.ensure_future(dst.pull_async(ticket, dst_table(dst_pool), timeout_s=10))
            await asyncio.sleep(0.05)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_midway())
        assert_arenas_idle(dst)
        (rid, error), *_ = wait_poll(src)
        assert rid == "slow" and "cancelled" in error and released == [("slow", error)]
        assert_arenas_idle(src)
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
def test_pull_async_confirms_to_the_source_after_handing_back_and_pull_before_returning(monkeypatch):
    """The source's confirmation is not on the pull's path: a pull_async sends it on the loop once the caller's
    step that awaited the pull has ended (its scatter first); a pull on its thread sends it before returning.
    Either way the source releases the request without error and the bytes are the source's."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst, released = nixl_pair(src_pool, dst_pool)
    events: list[str] = []
    confirm = dst._confirm
    monkeypatch.setattr(dst, "_confirm", lambda *a: (events.append("confirmed"), confirm(*a)))
    try:
        table, (dtab, dtab2) = src_table(src_pool), dst_tables(dst_pool, 2)
        ticket = src.export("a", table, NUM_TOKENS)

        async def pull():
            stats, deferred = await dst.pull_async(ticket, dtab, timeout_s=10)
            events.append("returned")
            deferred.run()
            events.append("scattered")
            await asyncio.sleep(0)
            events.append("next step")

        asyncio.run(pull())
        assert events == ["returned", "scattered", "confirmed", "next step"]
        assert_moved(src_pool, dst_pool, ticket.page_table(), dtab, before)
        assert wait_poll(src) == [("a", None)]

        events.clear()
        before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}  # the first pull's pages written
        ticket = src.export("b", table, NUM_TOKENS)
        dst.pull(ticket, dtab2, timeout_s=10)
        events.append("returned")
        assert events == ["confirmed", "returned"]
        assert_moved(src_pool, dst_pool, ticket.page_table(), dtab2, before)
        assert wait_poll(src) == [("b", None)]
        assert released == [("a", None), ("b", None)]
        assert_arenas_idle(src, dst)
    finally:
        src.close()
        dst.close()
