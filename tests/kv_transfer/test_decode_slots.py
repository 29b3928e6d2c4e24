"""A decode slot is reserved together with the pages when a transfer is accepted: real prefill and decode workers
(in process, tcp transfer), a decode worker of one batch slot. A second hand-off while the slot is taken is
answered with the retryable DecodeOverloaded before any byte moves (the prefill side keeps its pages for the
retry); a request waiting in the decode engine's own queue cannot take a slot an arriving import holds."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.worker import DecodeWorker
from engine.execution.sampling_params import SamplingParams
from engine.handoff import DecodeOverloaded, Transferred
from engine.loading.load import load_engine
from prefill_worker.worker import PrefillWorker

PARAMS = SamplingParams(max_new_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def workers():
    prefill = PrefillWorker("p0", None, transfer="tcp")
    decode = DecodeWorker("d0", None, {"max_num_seqs": 1}, transfer="tcp")
    decode.add_peer("p0", prefill.transfer_metadata())
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def test_full_decode_worker_is_overloaded_before_any_byte_moves(workers):
    prefill, decode = workers

    async def scenario():
        a = await prefill.prefill("a", [5, 6, 7, 8], PARAMS)
        b = await prefill.prefill("b", [9, 10, 11], PARAMS)
        first = decode.decode(a, [5, 6, 7, 8], PARAMS)
        assert isinstance(await anext(first), Transferred)
        moved = decode.transfer_summary()
        with pytest.raises(DecodeOverloaded, match="no batch slot for b"):
            await anext(decode.decode(b, [9, 10, 11], PARAMS))
        after = decode.transfer_summary()
        assert after["count"] == moved["count"] == 1 and after["bytes"] == moved["bytes"]
        assert after["failures"] == 0
        assert prefill.loop.call(lambda e: "b" in e.held).result(10)  # b's caches are still held for the retry
        tokens = [ev.token_id async for ev in first]
        assert len(tokens) == PARAMS.max_new_tokens - 1
        second = decode.decode(b, [9, 10, 11], PARAMS)  # the slot is free again: the retry goes through
        assert isinstance(await anext(second), Transferred)
        assert len([ev async for ev in second]) == PARAMS.max_new_tokens - 1
        await asyncio.sleep(0.2)  # the prefill side frees on the decode side's confirmation (polled)

    asyncio.run(scenario())
    assert decode.stats().running == 0 and decode.stats().kv_usage == 0.0


def test_arriving_import_keeps_its_slot_from_the_waiting_queue():
    engine = load_engine(max_num_seqs=1, warmup=False)
    engine.reserve_import([5, 6, 7], PARAMS, "imp", seed=0, first_token=3, first_logprob=0.0)
    local = engine.add_request([8, 9], PARAMS, "local")
    engine.step()
    assert engine.scheduler.running == [] and [r.request_id for r in engine.scheduler.waiting] == [local]
    with pytest.raises(DecodeOverloaded):
        engine.reserve_import([1, 2], PARAMS, "imp2", seed=0, first_token=3, first_logprob=0.0)
    free = engine.pool.free_tokens()
    engine.abort("imp")  # the slot returns with the pages: the queued request runs
    assert engine.pool.free_tokens() > free
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == [local]


@pytest.mark.parametrize("cls", [PrefillWorker, DecodeWorker], ids=["prefill", "decode"])
def test_abort_on_a_worker_whose_loop_ended_is_a_no_op(cls):
    """The dispatcher aborts fire-and-forget; a worker whose engine loop has ended holds nothing to abort, and an
    error there would only be an unread one in the dispatcher's log."""
    worker = cls("w-ended", None, transfer="tcp")
    worker.shutdown()
    assert not worker.loop.alive
    asyncio.run(worker.abort("gone"))
