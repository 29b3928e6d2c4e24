"""Streaming through real prefill and decode workers (in process, tcp and NIXL): the decode worker reserves the
request before its prefill ends, pulls each chunk ticket `prefill_streamed` yields while later chunks are still
being prefilled, then `decode` pulls only the rest; the tokens equal one engine doing both phases, and an abort
or an out-of-order chunk leaves both workers holding nothing."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.worker import DecodeWorker
from engine.execution.sampling_params import SamplingParams
from engine.handoff import PrefillResult, Transferred, TransferTicket
from engine.loading.load import load_engine
from kv_transfer.outcomes import TransferError
from prefill_worker.worker import PrefillWorker
from tests.support.backends import BACKEND_NAMES
from tests.support.handoff import run_colocated

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)
PROMPT = list(range(3, 303))  # 300 positions: several 64-token pages, prefilled 32 at a time


def prompt(seed: int) -> list[int]:
    """Another prompt of PROMPT's length: no prefix-cache hit on an earlier test's prompt (a hit would compute,
    and stream, its cached positions in one step)."""
    return [(i * 7 + seed) % 500 + 2 for i in range(len(PROMPT))]


OPTIONS = {"page_tokens": 64}


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def workers(request):
    prefill = PrefillWorker("p0", None, {**OPTIONS, "max_batch_tokens": 32}, transfer=request.param)
    decode = DecodeWorker("d0", None, OPTIONS, transfer=request.param)
    decode.add_peer("p0", prefill.transfer_metadata())
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def assert_idle(prefill, decode):
    assert prefill.backend.exported() == []
    for worker in (prefill, decode):
        pool = worker.engine.pool
        assert worker.loop.call(lambda e: e.pool.num_free_pages()).result(10) == pool.idle_free_pages()
        staging = getattr(worker.backend, "staging", None)
        if staging is not None:
            assert staging.arena.allocated() == {}, worker.worker_id


async def wait_released(prefill, timeout=5.0):
    for _ in range(int(timeout / 0.02)):  # the prefill side frees on the decode side's confirmation (polled)
        if not prefill.backend.exported() and not prefill.loop.call(lambda e: bool(e.held)).result(10):
            return
        await asyncio.sleep(0.02)


def test_streamed_workers_equal_colocated(workers):
    prefill, decode = workers
    want = run_colocated(load_engine(**OPTIONS, warmup=False), [PROMPT], PARAMS)[0]

    async def scenario():
        await decode.reserve_streamed("a", PROMPT, PARAMS)
        chunks, result = [], None
        async for item in prefill.prefill_streamed("a", PROMPT, PARAMS, seed=100):
            if isinstance(item, TransferTicket):
                chunks.append(await decode.pull_chunk("a", item))
            else:
                result = item
        assert (
            isinstance(result, PrefillResult) and result.ticket.start_tokens == 256
        )  # the last chunk end that filled a page
        stream = decode.decode(result, PROMPT, PARAMS)
        final = await anext(stream)
        assert isinstance(final, Transferred)
        tokens = [ev.token_id async for ev in stream]
        await wait_released(prefill)
        return chunks, final, [result.first_token, *tokens]

    chunks, final, tokens = asyncio.run(scenario())
    assert tokens == want.output
    assert len(chunks) >= 4 and all(c.num_bytes > 0 for c in chunks)
    assert final.num_bytes < sum(c.num_bytes for c in chunks) + final.num_bytes
    assert_idle(prefill, decode)


def test_abort_mid_stream_frees_both_sides(workers):
    prefill, decode = workers

    async def scenario():
        await decode.reserve_streamed("b", prompt(1), PARAMS)
        stream = prefill.prefill_streamed("b", prompt(1), PARAMS)
        ticket = await anext(stream)
        assert isinstance(ticket, TransferTicket) and not ticket.final
        await decode.pull_chunk("b", ticket)
        assert not (await anext(stream)).final  # a second chunk, exported and never pulled
        await stream.aclose()  # the dispatcher stopped (client gone): the request and its chunks are dropped
        await decode.abort("b")

    asyncio.run(scenario())
    assert_idle(prefill, decode)


def test_a_chunk_out_of_order_fails_and_frees_the_reservation(workers):
    prefill, decode = workers

    async def scenario():
        await decode.reserve_streamed("c", prompt(2), PARAMS)
        stream = prefill.prefill_streamed("c", prompt(2), PARAMS)
        await anext(stream)  # the first chunk, skipped
        second = await anext(stream)
        with pytest.raises(TransferError, match="its chunks reached 0 here"):
            await decode.pull_chunk("c", second)
        with pytest.raises(TransferError, match="no streamed reservation"):
            await decode.pull_chunk("c", second)
        await prefill.abort("c")
        await stream.aclose()

    asyncio.run(scenario())
    assert_idle(prefill, decode)


def test_an_abandoned_streamed_reservation_expires(workers, monkeypatch):
    """No chunk for STREAM_IDLE_S (the dispatcher that reserved it is gone): the reservation is aborted."""
    prefill, decode = workers
    monkeypatch.setattr("decode_worker.worker.STREAM_IDLE_S", 0.05)

    async def scenario():
        await decode.reserve_streamed("d", prompt(3), PARAMS)
        assert decode.stats().running == 1
        for _ in range(100):
            await asyncio.sleep(0.02)
            if decode.stats().running == 0:
                break
        stream = prefill.prefill_streamed("d", prompt(3), PARAMS)
        with pytest.raises(TransferError, match="no streamed reservation"):
            await decode.pull_chunk("d", await anext(stream))
        await stream.aclose()

    asyncio.run(scenario())
    assert_idle(prefill, decode)


def test_chunks_wait_until_their_bytes_are_written(workers, monkeypatch):
    """On CUDA a chunk's ticket leaves only once the device work writing its bytes completed
    (`TransferBackend.chunk_ready`). Never ready before the prefill's end here: every chunk is handed over at the
    end, in order and before the result, and the tokens are still the colocated engine's."""
    prefill, decode = workers
    asked = []

    def not_yet(ticket, wait=False):
        asked.append(wait)
        return wait

    monkeypatch.setattr(prefill.backend, "chunk_ready", not_yet)
    want = run_colocated(load_engine(**OPTIONS, warmup=False), [prompt(4)], PARAMS)[0]

    async def scenario():
        await decode.reserve_streamed("e", prompt(4), PARAMS)
        items = [item async for item in prefill.prefill_streamed("e", prompt(4), PARAMS, seed=100)]
        *chunks, result = items
        assert len(chunks) >= 4 and [c.start_tokens for c in chunks] == sorted(c.start_tokens for c in chunks)
        for chunk in chunks:
            await decode.pull_chunk("e", chunk)
        stream = decode.decode(result, prompt(4), PARAMS)
        assert isinstance(await anext(stream), Transferred)
        tokens = [ev.token_id async for ev in stream]
        await wait_released(prefill)
        return [result.first_token, *tokens]

    assert asyncio.run(scenario()) == want.output
    assert False in asked and True in asked  # held at the steps, waited for at the end
    assert_idle(prefill, decode)
