"""A NIXL READ that could not be cancelled keeps its destination out of use until the READ is known to be over, or
its peer is gone, on both transfer paths. Real NIXL agents on host memory; only the agent's answers are forced at
its boundary (a READ that stays in flight, a handle that refuses to release while it is), as the timeout tests do.
- page descriptors: the pull raises ReadInFlight; `receive`'s pages stay allocated, `settled()` names the request
  (and frees them) only once the READ has left PROC and its handle released;
- staged: the READ lands in the staging range, not the pages (a plain TransferError: the caller frees the pages);
  the range stays allocated until `settled()` sees the READ over;
- a removed peer ends the quarantine (its connection is torn down: nothing lands any more).
"""

from __future__ import annotations

import pytest

from kv_transfer.base import ReadInFlight, TransferError
from kv_transfer.registry import make_backend
from tests.kv_transfer.test_kv_transfer import DST_CACHE, NUM_TOKENS, SRC_CACHE, dst_table, random_pool, src_table
from tests.support.backends import needs_nixl

pytestmark = [needs_nixl, pytest.mark.nixl]


class StuckReads:
    """Forces the destination agent's READs to stay in flight, and their handles to refuse release meanwhile."""

    def __init__(self, monkeypatch, agent):
        self.state = "PROC"
        self.refused = 0
        real_init = agent.initialize_xfer

        def initialize_xfer(*args, **kw):
            return _Handle(real_init(*args, **kw), self)

        monkeypatch.setattr(agent, "initialize_xfer", initialize_xfer)
        monkeypatch.setattr(agent, "transfer", lambda h, notif_msg=b"": "PROC")
        monkeypatch.setattr(agent, "check_xfer_state", lambda h: self.state)


class _Handle:
    def __init__(self, real, ctl: StuckReads):
        self.real, self.ctl = real, ctl

    def release(self):
        if self.ctl.state == "PROC":
            self.ctl.refused += 1
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: transfer still in progress")
        self.real.release()


def pair(dst_staging=0, src_staging=0):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src = make_backend("nixl", src_pool, staging_bytes=src_staging)
    dst = make_backend("nixl", dst_pool, staging_bytes=dst_staging)
    dst.add_peer(src.worker_name, src.metadata())
    return src, dst, src_pool, dst_pool


def test_page_descriptor_read_keeps_its_pages_until_it_is_over(monkeypatch):
    src, dst, src_pool, dst_pool = pair()
    try:
        ctl = StuckReads(monkeypatch, dst.agent)
        free = dst_pool.free_tokens()
        ticket = src.export("stuck", src_table(src_pool), NUM_TOKENS)
        with pytest.raises(ReadInFlight, match="could not cancel the READ") as info:
            dst.receive(ticket, timeout_s=0.2)
        assert info.value.request_id == "stuck" and ctl.refused == 1
        assert dst_pool.free_tokens() < free  # the pages it may still write are not handed out again
        assert dst.settled() == [] and dst.settled() == []  # still in flight: still held
        ctl.state = "DONE"
        assert dst.settled() == ["stuck"] and dst_pool.free_tokens() == free
        assert dst.settled() == []
    finally:
        src.close()
        dst.close()


def test_pull_into_callers_pages_raises_read_in_flight(monkeypatch):
    src, dst, src_pool, dst_pool = pair()
    try:
        StuckReads(monkeypatch, dst.agent)
        ticket = src.export("mine", src_table(src_pool), NUM_TOKENS)
        with pytest.raises(ReadInFlight):
            dst.pull(ticket, dst_table(dst_pool), timeout_s=0.2)
        dst.remove_peer(src.worker_name)  # the source is gone: nothing can land any more
        assert dst.settled() == ["mine"]
    finally:
        src.close()
        dst.close()


def test_staged_read_keeps_its_range_until_it_is_over(monkeypatch):
    src, dst, src_pool, dst_pool = pair(dst_staging=None, src_staging=None)  # default staging buffers
    try:
        ctl = StuckReads(monkeypatch, dst.agent)
        ticket = src.export("staged", src_table(src_pool), NUM_TOKENS)
        assert ticket.staging is not None
        with pytest.raises(TransferError, match="could not cancel the READ") as info:
            dst.pull(ticket, dst_table(dst_pool), timeout_s=0.2)
        assert not isinstance(info.value, ReadInFlight)  # the pages were not its destination: free to go
        arena = dst.staging.arena
        assert arena.allocated() and arena.free_bytes < arena.capacity
        assert dst.settled() == [] and arena.allocated()
        ctl.state = "ERR"  # over (failed): the handle releases now
        assert dst.settled() == []  # nothing for the caller: the backend freed its own range
        assert arena.allocated() == {} and arena.free_bytes == arena.capacity
    finally:
        src.close()
        dst.close()


def test_decode_worker_keeps_quarantined_pages_through_an_abort(monkeypatch):
    """The decode worker's side: after a ReadInFlight the import leaves the engine (the dispatcher's abort cannot
    free it) and its pages return to the pool only once the backend says the READ is over."""
    import asyncio
    import time

    from decode_worker.worker import DecodeWorker
    from engine.execution.sampling_params import SamplingParams
    from prefill_worker.worker import PrefillWorker

    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prefill = PrefillWorker("q-p", None, transfer="nixl")
    decode = DecodeWorker("q-d", None, transfer="nixl", transfer_timeout_s=0.3)
    for w in (prefill, decode):  # page-descriptor pulls: no staging buffers
        w.backend.close()
        w.attach_backend(make_backend("nixl", w.engine.pool, worker_name=w.worker_id, staging_bytes=0))
    prefill.backend.add_release_callback(prefill._on_release)
    decode.add_peer("q-p", prefill.transfer_metadata())
    ctl = StuckReads(monkeypatch, decode.backend.agent)
    pool = decode.engine.pool
    idle = pool.free_tokens()
    try:

        async def scenario():
            res = await prefill.prefill("q", [5, 6, 7, 8], params)
            with pytest.raises(ReadInFlight):
                await anext(decode.decode(res, [5, 6, 7, 8], params))
            await decode.abort("q")  # what the dispatcher sends after a failure
            await asyncio.sleep(1.2)  # sweeps come and go: the READ is still in flight
            assert "q" in decode.quarantined and pool.free_tokens() < idle
            ctl.state = "DONE"
            deadline = time.monotonic() + 10
            while decode.quarantined and time.monotonic() < deadline:
                await asyncio.sleep(0.1)

        asyncio.run(scenario())
        assert not decode.quarantined
        assert decode.loop.call(lambda e: e.pool.free_tokens()).result(10) == idle
    finally:
        decode.shutdown()
        prefill.shutdown()
