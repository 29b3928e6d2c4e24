"""A staged pull's scatter left to the caller (TransferBackend.pull_deferred, kv_transfer.staging.DeferredScatter),
as the decode worker runs it on its engine thread: the same bytes land in the same pages as with `pull`; the
staging range is held until the scatter runs or is cancelled; exactly one of run / cancel takes effect; the
scatter's timings; and the decode worker end to end (same tokens as one engine, ranges and pages back when a
stream closes before its request joined)."""

import asyncio
import threading

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.loading.load import load_engine
from engine.model.cache import CachePool
from kv_transfer.plan import STAGING_ALIGN, build_plan, staged_layout
from kv_transfer.registry import make_backend
from kv_transfer.staging import DeferredScatter, StagingBuffer
from tests.kv_transfer.test_kv_transfer import (
    CFG,
    DST_CACHE,
    NUM_TOKENS,
    SRC_CACHE,
    assert_moved,
    dst_table,
    random_pool,
    src_table,
    wait_poll,
)
from tests.kv_transfer.test_staging import assert_arenas_idle, nixl_pair
from tests.support.backends import BACKEND_NAMES, needs_nixl

SCATTER_PARTS = {"index", "views", "copies", "record", "cpu"}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: the scatter on a CUDA stream"),
        ],
    ),
]


# ---- StagingBuffer.scatter / DeferredScatter ----------------------------------------------------------------
def staged_setup(device, seed=5):
    """A pool, a layout over scattered pages, a buffer with the layout's range filled with random bytes."""
    pool = CachePool(CFG, DST_CACHE, torch.bfloat16, device)
    specs = [g.spec for g in pool.groups.values()]
    table = dst_table(pool, seed)
    layout = staged_layout(build_plan(specs, table, table, NUM_TOKENS))
    buf = StagingBuffer(pool, 3 * layout.nbytes + STAGING_ALIGN)
    offset = buf.alloc(layout.nbytes)
    g = torch.Generator().manual_seed(seed)
    buf.tensor[offset : offset + layout.nbytes].copy_(
        torch.randint(0, 256, (layout.nbytes,), generator=g, dtype=torch.uint8)
    )
    return pool, layout, buf, offset


def expected_pages(pool, layout, buf, offset):
    """What each group's tensor must hold after the scatter, computed page by page on the host."""
    want = {n: g.tensor.view(-1).view(torch.uint8).clone().cpu() for n, g in pool.groups.items()}
    staged = buf.tensor.cpu()
    for grp in layout.groups:
        spec = pool.groups[grp.name].spec
        per_layer = want[grp.name].view(grp.layers, spec.num_pages, grp.page_bytes)
        lo = offset + grp.offset
        src = staged[lo : lo + grp.nbytes].view(grp.layers, len(grp.pages), grp.page_bytes)
        for i, (_, dst_page) in enumerate(grp.pages):
            per_layer[:, dst_page] = src[:, i]
    return want


def pool_bytes(pool):
    return {n: g.tensor.view(-1).view(torch.uint8).cpu() for n, g in pool.groups.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_writes_each_staged_page_to_its_page_and_reports_its_parts(device):
    pool, layout, buf, offset = staged_setup(device)
    want = expected_pages(pool, layout, buf, offset)
    timings = {}
    event = buf.scatter(offset, layout, timings)
    assert (event is None) == (device == "cpu")
    if event is not None:
        event.synchronize()
    got = pool_bytes(pool)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert set(timings) == SCATTER_PARTS and all(v >= 0 for v in timings.values())
    again = dict(timings)
    buf.scatter(offset, layout, timings)  # adds to the same dict
    assert all(timings[k] >= again[k] for k in SCATTER_PARTS)
    if device == "cuda":
        torch.cuda.synchronize()


def shaped_table(pool, shape: str, seed: int = 7) -> dict:
    """Pages for NUM_TOKENS in every group, each growing group's as `shape` says: "up" (a run of consecutive
    pages), "down" (the same run handed back last-in first-out), "scattered" (a random permutation), "mixed" (one
    of each, group by group)."""
    g = torch.Generator().manual_seed(seed)
    out, kinds = {}, ["up", "down", "scattered"]
    for i, (name, group) in enumerate(pool.groups.items()):
        k, n = group.spec.pages_for_tokens(NUM_TOKENS), group.spec.num_pages
        kind = kinds[i % 3] if shape == "mixed" else shape
        first = int(torch.randint(0, n - k + 1, (), generator=g))
        ids = list(range(first, first + k))
        out[name] = (
            ids[::-1] if kind == "down" else torch.randperm(n, generator=g)[:k].tolist() if kind == "scattered" else ids
        )
    return out


@pytest.mark.parametrize("shape", ["up", "down", "scattered", "mixed"])
def test_gather_then_scatter_moves_each_page_for_every_table_shape(shape):
    """Fresh random pools: a source's pages gathered into a staging range, scattered into the destination's pages
    (slices for runs, one packed page-id index for the rest), land byte for byte where the plan says."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 11), random_pool(DST_CACHE, 12)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst = shaped_table(src_pool, shape, 1), shaped_table(dst_pool, shape, 2)
    plan = build_plan(
        [g.spec for g in src_pool.groups.values()],
        src,
        dst,
        NUM_TOKENS,
        dst_specs=[g.spec for g in dst_pool.groups.values()],
    )
    layout = staged_layout(plan)
    src_buf, dst_buf = (
        StagingBuffer(src_pool, layout.nbytes + STAGING_ALIGN),
        StagingBuffer(dst_pool, 2 * layout.nbytes),
    )
    src_buf.gather(0, layout)
    offset = dst_buf.alloc(layout.nbytes)
    dst_buf.tensor[offset : offset + layout.nbytes].copy_(src_buf.tensor[: layout.nbytes])  # the READ
    assert dst_buf.scatter(offset, layout) is None
    assert_moved(src_pool, dst_pool, src, dst, before)


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_scatter_run_writes_pages_and_holds_range_until_done(device):
    pool, layout, buf, offset = staged_setup(device)
    want = expected_pages(pool, layout, buf, offset)
    before = pool_bytes(pool)
    deferred = DeferredScatter(buf, offset, layout, "r1")
    for name, b in pool_bytes(pool).items():  # nothing written before run
        assert torch.equal(b, before[name]), name
    assert buf.arena.allocated() == {offset: buf.arena.allocated()[offset]}
    parts = deferred.run()
    assert deferred.state == "queued" and set(parts) == SCATTER_PARTS | {"seconds"}
    if device == "cuda":
        torch.cuda.synchronize()
    assert buf.reclaim() >= 0 and buf.arena.allocated() == {}  # freed (CPU: at once; CUDA: once its event ran)
    for name, b in pool_bytes(pool).items():
        assert torch.equal(b, want[name]), name
    assert deferred.cancel() is False  # already run: nothing to cancel, nothing freed twice
    with pytest.raises(RuntimeError, match="'r1' was queued"):
        deferred.run()


def test_deferred_scatter_cancel_frees_its_range_and_writes_nothing():
    pool, layout, buf, offset = staged_setup("cpu")
    before = pool_bytes(pool)
    deferred = DeferredScatter(buf, offset, layout, "r2")
    assert deferred.cancel() is True and deferred.state == "cancelled"
    assert buf.arena.allocated() == {}
    assert deferred.cancel() is False  # a second cancel frees nothing (the arena would raise on a double free)
    with pytest.raises(RuntimeError, match="'r2' was cancelled"):
        deferred.run()
    for name, b in pool_bytes(pool).items():
        assert torch.equal(b, before[name]), name


def race_run_and_cancel(deferred):
    """run() and cancel() from two threads at once -> {"run": whether run took effect, "cancel": cancel's answer}."""
    results, barrier = {}, threading.Barrier(2)

    def run():
        barrier.wait()
        try:
            deferred.run()
            results["run"] = True
        except RuntimeError:
            results["run"] = False

    def cancel():
        barrier.wait()
        results["cancel"] = deferred.cancel()

    threads = [threading.Thread(target=run), threading.Thread(target=cancel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_deferred_scatter_run_and_cancel_race_exactly_one_wins():
    for trial in range(30):
        _, layout, buf, offset = staged_setup("cpu", seed=trial)
        results = race_run_and_cancel(DeferredScatter(buf, offset, layout, f"r{trial}"))
        assert results["run"] != results["cancel"], results
        assert buf.arena.allocated() == {}  # freed once, by whichever won


# ---- pull_deferred -------------------------------------------------------------------------------------------
@needs_nixl
@pytest.mark.nixl
def test_pull_deferred_leaves_the_scatter_and_moves_the_same_bytes_once_run():
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst, released = nixl_pair(src_pool, dst_pool)
    try:
        table, dtab = src_table(src_pool), dst_table(dst_pool)
        ticket = src.export("req", table, NUM_TOKENS)
        stats, deferred = dst.pull_deferred(ticket, dtab, timeout_s=10)
        assert isinstance(deferred, DeferredScatter) and deferred.state == "pending"
        assert stats.descriptors == 1 and stats.scatter_seconds == 0 and stats.scatter_parts == {}
        assert stats.bytes == dst.plan_for(ticket, dtab).total_bytes > 0
        assert 0 < stats.plan_seconds <= stats.seconds and stats.cpu_seconds > 0 and stats.staging_wait_seconds > 0
        for name, g in dst_pool.groups.items():  # pages untouched until the scatter runs
            assert torch.equal(g.tensor, before[name]), name
        assert len(dst.staging.arena.allocated()) == 1  # the pulled bytes wait in their range
        assert wait_poll(src) == [("req", None)] and released == [("req", None)]  # the READ is confirmed anyway
        parts = deferred.run()
        assert set(parts) == SCATTER_PARTS | {"seconds"}
        assert_moved(src_pool, dst_pool, ticket.page_table(), dtab, before)
        assert_arenas_idle(src, dst)
        assert dst.staging_counts["staged"] == 1
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_pull_deferred_without_a_staged_pull_scatters_nothing_later(kind):
    """TCP, or NIXL with staging off: nothing is left to run; the pages hold the bytes on return."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    kw = {} if kind == "tcp" else {"staging_bytes": 0}
    src = make_backend(kind, src_pool, **kw)
    dst = make_backend(kind, dst_pool, **kw)
    try:
        dst.add_peer(src.worker_name, src.metadata())
        table, dtab = src_table(src_pool), dst_table(dst_pool)
        ticket = src.export("req", table, NUM_TOKENS)
        stats, deferred = dst.pull_deferred(ticket, dtab, timeout_s=10)
        assert deferred is None and stats.bytes > 0 and stats.scatter_seconds == 0
        assert_moved(src_pool, dst_pool, ticket.page_table(), dtab, before)
        assert not dst._defers_scatter()  # the next plain pull scatters itself again
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
def test_plain_pull_after_pull_deferred_still_scatters_itself_and_reports_parts():
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst, _ = nixl_pair(src_pool, dst_pool)
    try:
        first = src.export("a", src_table(src_pool), NUM_TOKENS)
        _, deferred = dst.pull_deferred(first, dst_table(dst_pool, seed=3), timeout_s=10)
        deferred.cancel()
        dtab = dst_table(dst_pool, seed=4)
        ticket = src.export("b", src_table(src_pool), NUM_TOKENS)
        stats = dst.pull(ticket, dtab, timeout_s=10)
        assert stats.scatter_seconds > 0 and set(stats.scatter_parts) == SCATTER_PARTS
        assert stats.wire_seconds + stats.scatter_seconds <= stats.seconds
        assert_moved(src_pool, dst_pool, ticket.page_table(), dtab, before)
        assert_arenas_idle(dst)
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
def test_a_failed_pull_deferred_leaves_nothing_held(monkeypatch):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, _ = nixl_pair(src_pool, dst_pool)
    try:
        monkeypatch.setattr(dst.agent, "transfer", lambda h, notif_msg=b"": "PROC")  # a READ that never ends
        monkeypatch.setattr(dst.agent, "check_xfer_state", lambda h: "PROC")
        ticket = src.export("slow", src_table(src_pool), NUM_TOKENS)
        with pytest.raises(Exception, match="timed out"):
            dst.pull_deferred(ticket, dst_table(dst_pool), timeout_s=0.3)
        assert_arenas_idle(dst)
        assert not dst._defers_scatter()
    finally:
        src.close()
        dst.close()


# ---- the decode worker -----------------------------------------------------------------------------------------
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 41, 140)]


@pytest.fixture(scope="module")
def workers():
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

    prefill = PrefillWorker("p0", None, {"page_tokens": 64}, transfer="nixl")
    decode = DecodeWorker("d0", None, {"page_tokens": 64}, transfer="nixl")
    decode.add_peer("p0", prefill.transfer_metadata())
    yield prefill, decode
    decode.shutdown()
    prefill.shutdown()


def wait_idle(prefill, decode):
    """Both pools back to idle and every staging range free (confirmations arrive in-band, polled on the
    prefill engine's thread)."""
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        prefill.loop.call(lambda e: prefill.backend.poll()).result()
        pools = [w.engine.pool for w in (prefill, decode)]
        if (
            all(p.num_free_pages() == p.idle_free_pages() for p in pools)
            and not prefill.backend.exported()
            and not decode.engine.imports
        ):
            break
        time.sleep(0.01)
    for w in (prefill, decode):
        assert w.engine.pool.num_free_pages() == w.engine.pool.idle_free_pages(), w.worker_id
    decode.backend.staging.reclaim(wait=True)
    assert_arenas_idle(prefill.backend, decode.backend)


@needs_nixl
@pytest.mark.nixl
def test_decode_worker_scatters_on_its_engine_thread_and_generates_the_one_engine_tokens(workers):
    prefill, decode = workers
    colocated = load_engine(max_batch_tokens=2048)
    ids = [colocated.add_request(p, PARAMS, seed=100 + i) for i, p in enumerate(PROMPTS)]
    while colocated.has_work:
        colocated.step()
    want = [colocated.pop_finished(r).output for r in ids]
    engine_threads = []
    run = DeferredScatter.run

    def spy(self):
        engine_threads.append(threading.current_thread().name)
        return run(self)

    before = dict(decode.transfer_totals)

    async def one(i, prompt):
        result = await prefill.prefill(f"r{i}", prompt, PARAMS, 100 + i)
        tokens = [result.first_token]
        async for ev in decode.decode(result, prompt, PARAMS):
            if getattr(ev, "token_id", None) is not None:
                tokens.append(ev.token_id)
        return tokens

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    DeferredScatter.run = spy
    try:
        got = asyncio.run(main())
    finally:
        DeferredScatter.run = run
    assert got == want
    assert engine_threads == [decode.loop._thread.name] * len(PROMPTS)  # every scatter ran on the engine thread
    totals = decode.transfer_totals
    assert totals["count"] - before["count"] == len(PROMPTS)
    assert totals["scatters_on_engine"] - before["scatters_on_engine"] == len(PROMPTS)
    for key in (
        "scatter_seconds",
        "scatter_index_seconds",
        "scatter_copies_seconds",
        "scatter_cpu_seconds",
        "plan_seconds",
        "pull_cpu_seconds",
        "join_seconds",
    ):
        assert totals[key] > before[key], key
    assert decode.backend.staging_counts["staged"] >= len(PROMPTS)
    wait_idle(prefill, decode)


@needs_nixl
@pytest.mark.nixl
def test_decode_stream_closed_before_its_request_joined_frees_pages_and_staging(workers):
    prefill, decode = workers

    async def main():
        result = await prefill.prefill("closed", PROMPTS[1], PARAMS, 7)
        stream = decode.decode(result, PROMPTS[1], PARAMS)
        first = await stream.__anext__()  # Transferred: the pull is done, the scatter not yet run
        assert type(first).__name__ == "Transferred"
        assert len(decode.backend.staging.arena.allocated()) == 1
        await stream.aclose()

    asyncio.run(main())
    assert "closed" not in decode.engine.requests
    wait_idle(prefill, decode)
