"""Staged NIXL pulls (kv_transfer.staging): the byte-range arena, and real NIXL pulls on host memory with staging
on, off, too small on either side, and after failures; every pull is checked byte for byte against the source."""

import dataclasses
import random
import re
import sys
import threading

import pytest
import torch

from kv_transfer.outcomes import TransferError, TransferTimeout
from kv_transfer.plan import STAGING_ALIGN, build_plan, run_start, staged_layout, staged_nbytes
from kv_transfer.registry import make_backend
from kv_transfer.staging import ByteArena
from tests.kv_transfer.test_kv_transfer import (
    DST_CACHE,
    NUM_TOKENS,
    SRC_CACHE,
    as_bytes,
    assert_moved,
    dst_table,
    random_pool,
    src_table,
    wait_poll,
)
from tests.support.backends import needs_nixl


# ---- ByteArena -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [-1, 1.5, "4096", True, None])
def test_arena_rejects_bad_capacity_naming_it(capacity):
    with pytest.raises(ValueError, match="capacity.*got " + re.escape(repr(capacity))):
        ByteArena(capacity)


@pytest.mark.parametrize("align", [0, -256, 2.0, False])
def test_arena_rejects_bad_alignment_naming_it(align):
    with pytest.raises(ValueError, match="alignment.*got " + re.escape(repr(align))):
        ByteArena(4096, align)


@pytest.mark.parametrize("nbytes", [0, -5, 3.0, True])
def test_arena_rejects_bad_sizes_naming_them(nbytes):
    arena = ByteArena(4096)
    with pytest.raises(ValueError, match="size.*got " + re.escape(repr(nbytes))):
        arena.alloc(nbytes)
    assert arena.free_bytes == 4096  # nothing was taken


def test_arena_ranges_are_aligned_disjoint_and_inside():
    arena = ByteArena(10 * 256 + 100)  # the 100-byte tail is never handed out
    assert arena.capacity == 10 * 256 and arena.free_bytes == 10 * 256
    sizes = [1, 256, 257, 600, 255]
    offsets = [arena.alloc(n) for n in sizes]
    assert all(o is not None and o % STAGING_ALIGN == 0 for o in offsets)
    held = arena.allocated()
    assert sorted(held) == sorted(offsets)
    assert [held[o] for o in offsets] == [256, 256, 512, 768, 256]  # rounded up to the alignment
    spans = sorted((o, o + held[o]) for o in offsets)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= arena.capacity
    assert arena.free_bytes == arena.capacity - sum(held.values())


def test_arena_full_returns_none_and_bad_free_raises():
    arena = ByteArena(4 * 256)
    a = arena.alloc(3 * 256)
    assert arena.alloc(2 * 256) is None  # 256 left: too short, and nothing changed
    assert arena.free_bytes == 256 and arena.largest_free == 256
    b = arena.alloc(256)
    assert b is not None and arena.alloc(1) is None and arena.free_bytes == 0 and arena.largest_free == 0
    assert arena.alloc(10 * 256) is None  # larger than the arena: None as well
    with pytest.raises(ValueError, match="offset 12 is not an allocated range"):
        arena.free(12)
    arena.free(a)
    with pytest.raises(ValueError, match=f"offset {a} is not an allocated range"):
        arena.free(a)  # a double free is refused, not merged twice
    assert ByteArena(0).alloc(1) is None and ByteArena(100).capacity == 0


@pytest.mark.parametrize("order", ["forward", "backward", "middle_last", "shuffled"])
def test_arena_free_coalesces_neighbours(order):
    arena = ByteArena(8 * 256)
    offsets = [arena.alloc(256) for _ in range(8)]
    assert arena.alloc(1) is None
    frees = {
        "forward": offsets,
        "backward": offsets[::-1],
        "middle_last": [offsets[i] for i in (0, 2, 4, 6, 7, 5, 3, 1)],
        "shuffled": random.Random(3).sample(offsets, 8),
    }[order]
    for o in frees:
        arena.free(o)
    assert arena.allocated() == {} and arena.free_bytes == arena.capacity == arena.largest_free
    assert arena.alloc(8 * 256) == 0  # one run again: the whole arena in one range


def test_arena_reuses_a_freed_hole_first_fit():
    arena = ByteArena(8 * 256)
    a, b, c = arena.alloc(256), arena.alloc(2 * 256), arena.alloc(256)
    arena.free(b)
    assert arena.alloc(3 * 256) == c + 256  # the 2-unit hole is too short: the tail run
    assert arena.alloc(256) == b  # lowest fitting offset
    arena.free(a)
    assert arena.largest_free == 256  # free: a's unit, b's second unit, the last unit; none neighbours


def test_arena_is_thread_safe():
    """Threads alloc / free in a loop, each marking its range in an owner map: an overlap, a lost range or a
    broken free list shows as a foreign owner, a missing byte at the end, or an exception. (With its lock
    removed the arena failed this test in about half the runs on a 2-core machine; with it, in none tried.)"""
    arena = ByteArena(64 * 256)
    owner = [0] * arena.capacity
    errors = []

    def work(tid):
        rng = random.Random(tid)
        held = []
        try:
            for _ in range(1500):
                if held and (rng.random() < 0.5 or len(held) > 4):
                    off, n = held.pop(rng.randrange(len(held)))
                    if any(x != tid for x in owner[off : off + n]):
                        errors.append(f"thread {tid}: range {off}+{n} was overwritten")
                    owner[off : off + n] = [0] * n
                    arena.free(off)
                    continue
                n = rng.randint(1, 6 * 256)
                off = arena.alloc(n)
                if off is None:
                    continue
                n = arena.allocated().get(off, -1)  # rounded length
                if n < 0 or any(owner[off : off + n]):
                    errors.append(f"thread {tid}: range at {off} handed out twice")
                    continue
                owner[off : off + n] = [tid] * n
                held.append((off, n))
            for off, n in held:
                owner[off : off + n] = [0] * n
                arena.free(off)
        except Exception as e:  # noqa: BLE001 - reported below with the thread id
            errors.append(f"thread {tid}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(1, 7)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads every few bytecodes: an unlocked arena then fails this test
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert arena.allocated() == {} and arena.free_bytes == arena.capacity
    assert arena.alloc(arena.capacity) == 0


# ---- staged layout -----------------------------------------------------------------------------------------
def test_staged_layout_size_matches_staged_nbytes():
    pool = random_pool(SRC_CACHE, 0)
    specs = [g.spec for g in pool.groups.values()]
    table = src_table(pool)
    layout = staged_layout(build_plan(specs, table, table, NUM_TOKENS))
    assert layout.nbytes == staged_nbytes(specs, NUM_TOKENS) >= layout.payload_bytes > 0
    assert all(g.offset % STAGING_ALIGN == 0 for g in layout.groups)


def test_run_start_only_for_consecutive_increasing_ids():
    assert run_start([7]) == 7 and run_start([3, 4, 5]) == 3
    assert run_start([3, 5, 6]) is None and run_start([5, 4, 3]) is None and run_start([4, 3, 5]) is None


def test_staged_layout_marks_each_sides_runs():
    """Source pages allocated in one piece are runs (copied as slices); the scattered destination's growing
    groups are not (copied by page-id index); a fixed group's one page is a run on both sides."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    specs = [g.spec for g in src_pool.groups.values()]
    src, dst = src_table(src_pool), dst_table(dst_pool)
    plan = build_plan(specs, src, dst, NUM_TOKENS, dst_specs=[g.spec for g in dst_pool.groups.values()])
    for g in staged_layout(plan).groups:
        assert g.runs[0] == src[g.name][0], g.name
        if len(g.pages) == 1:
            assert g.runs[1] == dst[g.name][0], g.name
        else:
            assert g.runs[1] is None, g.name


def test_staged_layout_of_a_plan_without_runs_finds_them():
    """A GroupPlan built without its runs (runs=None) gets the same layout as build_plan's, which notes them."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    plan = build_plan(
        [g.spec for g in src_pool.groups.values()],
        src_table(src_pool),
        dst_table(dst_pool),
        NUM_TOKENS,
        dst_specs=[g.spec for g in dst_pool.groups.values()],
    )
    bare = dataclasses.replace(plan, groups=tuple(dataclasses.replace(g, runs=None) for g in plan.groups))
    assert staged_layout(bare) == staged_layout(plan)
    assert any(g.runs[1] is None for g in staged_layout(plan).groups)  # scattered pages: some group is indexed


# ---- NIXL pulls ------------------------------------------------------------------------------------------
def request_bytes():
    return staged_nbytes([g.spec for g in random_pool(SRC_CACHE, 0).groups.values()], NUM_TOKENS)


def nixl_pair(src_pool, dst_pool, src_staging=None, dst_staging=None, **src_kw):
    released = []
    src = make_backend(
        "nixl", src_pool, on_release=lambda rid, err: released.append((rid, err)), staging_bytes=src_staging, **src_kw
    )
    dst = make_backend("nixl", dst_pool, staging_bytes=dst_staging)
    dst.add_peer(src.worker_name, src.metadata())
    return src, dst, released


def assert_arenas_idle(*backends):
    for b in backends:
        if b.staging is not None:
            arena = b.staging.arena
            assert arena.allocated() == {} and arena.free_bytes == arena.capacity, b.worker_name


def dst_tables(pool, requests):
    """Disjoint, scattered destination pages for `requests` requests (one random permutation per group)."""
    g = torch.Generator().manual_seed(1)
    out = [{} for _ in range(requests)]
    for name, group in pool.groups.items():
        k = group.spec.pages_for_tokens(NUM_TOKENS)
        perm = torch.randperm(group.spec.num_pages, generator=g)[: k * requests].tolist()
        for i in range(requests):
            out[i][name] = perm[i * k : (i + 1) * k]
    return out


def merged(tables):
    """One table of several requests' pages, in request order (assert_moved pairs them up by position)."""
    return {n: sum((t.get(n, []) for t in tables), []) for n in tables[0]}


def pull_once(src_staging, dst_staging, requests=1):
    """Export `requests` requests (all held at once), pull each into scattered pages of a fresh destination
    pool; returns (destination pool bytes per group, per-pull stats, both backends' staging_counts)."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst, released = nixl_pair(src_pool, dst_pool, src_staging, dst_staging)
    try:
        tickets = [src.export(f"r{i}", src_table(src_pool), NUM_TOKENS) for i in range(requests)]
        dtabs = dst_tables(dst_pool, requests)
        stats = [dst.pull(t, d, timeout_s=10) for t, d in zip(tickets, dtabs)]
        assert_moved(src_pool, dst_pool, merged([t.page_table() for t in tickets]), merged(dtabs), before)
        got = []
        while len(got) < requests:
            more = wait_poll(src)
            assert more, f"confirmations missing: {got}"
            got += more
        assert sorted(got) == [(f"r{i}", None) for i in range(requests)] and sorted(released) == sorted(got)
        assert src.exported() == []
        assert_arenas_idle(src, dst)  # staged ranges came back with the confirmations
        return (
            {n: as_bytes(g.tensor).clone() for n, g in dst_pool.groups.items()},
            stats,
            (dict(src.staging_counts), dict(dst.staging_counts)),
        )
    finally:
        src.close()
        dst.close()


@pytest.fixture(scope="module")
def unstaged():
    """Staging off on both sides: the page-descriptor pull every staged result must equal."""
    return pull_once(0, 0)


def assert_same_pools(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@needs_nixl
@pytest.mark.nixl
def test_staged_pull_moves_the_same_bytes_as_page_descriptors(unstaged):
    pools, stats, counts = pull_once(None, None)  # default staging size on both sides
    assert_same_pools(pools, unstaged[0])
    assert stats[0].descriptors == 1 < unstaged[1][0].descriptors
    assert stats[0].bytes == unstaged[1][0].bytes > 0
    assert counts == (
        {"staged": 0, "fallback_source": 0, "fallback_destination": 0},
        {"staged": 1, "fallback_source": 0, "fallback_destination": 0},
    )
    assert unstaged[2][1]["staged"] == 0  # staging off: nothing staged, nothing counted as a fallback
    assert sum(unstaged[2][0].values()) == 0


@needs_nixl
@pytest.mark.nixl
def test_staged_pull_into_consecutive_pages_copies_slices_byte_for_byte():
    """Both sides' pages are runs: the gather and the scatter are slice copies (no page-id index at all)."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst, released = nixl_pair(src_pool, dst_pool)
    try:
        ticket = src.export("r0", src_table(src_pool), NUM_TOKENS)
        dst_pool.grow({}, 900)  # a longer spacer than the source's: the runs start elsewhere there
        table = src_table(dst_pool)
        assert table["kv4"][0] != ticket.page_table()["kv4"][0]
        layout = staged_layout(dst.plan_for(ticket, table))
        assert all(None not in g.runs for g in layout.groups) and dst.staging._index(layout, 1) is None
        assert dst.pull(ticket, table, timeout_s=10).descriptors == 1
        assert_moved(src_pool, dst_pool, ticket.page_table(), table, before)
        assert wait_poll(src) == [("r0", None)] and released == [("r0", None)]
        assert_arenas_idle(src, dst)
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
def test_source_arena_too_small_falls_back_counted_same_bytes(unstaged):
    pools, stats, counts = pull_once(request_bytes() - STAGING_ALIGN, None)
    assert_same_pools(pools, unstaged[0])
    assert stats[0].descriptors == unstaged[1][0].descriptors > 1
    assert counts[0]["fallback_source"] == 1 and counts[1]["staged"] == 0
    assert counts[1]["fallback_destination"] == 0  # the ticket said "not staged": no destination fallback


@needs_nixl
@pytest.mark.nixl
def test_destination_arena_too_small_falls_back_counted_same_bytes(unstaged):
    pools, stats, counts = pull_once(None, request_bytes() - STAGING_ALIGN)
    assert_same_pools(pools, unstaged[0])
    assert stats[0].descriptors == unstaged[1][0].descriptors > 1
    assert counts[0]["fallback_source"] == 0 and counts[1] == {
        "staged": 0,
        "fallback_source": 0,
        "fallback_destination": 1,
    }


@needs_nixl
@pytest.mark.nixl
def test_room_for_one_request_stages_one_and_falls_back_for_the_next():
    """Two exports held at once in a source arena with room for one: the first is staged, the second falls
    back; both land byte for byte and both ranges (and the destination's) are free afterwards."""
    one = request_bytes()
    _, stats, counts = pull_once(one, None, requests=2)
    assert [s.descriptors == 1 for s in stats] == [True, False]
    assert counts[0]["fallback_source"] == 1 and counts[1]["staged"] == 1
    _, stats, counts = pull_once(2 * one, None, requests=2)
    assert [s.descriptors for s in stats] == [1, 1] and counts[1]["staged"] == 2


@needs_nixl
@pytest.mark.nixl
def test_staged_ranges_freed_on_abort_and_lease_expiry():
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = nixl_pair(src_pool, dst_pool, lease_s=0.3)
    try:
        arena = src.staging.arena
        ticket = src.export("aborted", src_table(src_pool), NUM_TOKENS)
        assert ticket.staging is not None and arena.allocated() == {ticket.staging[0]: ticket.staging[1]}
        assert src.release("aborted", "aborted") and released == [("aborted", "aborted")]
        assert_arenas_idle(src)
        ticket = src.export("expired", src_table(src_pool), NUM_TOKENS)
        assert arena.free_bytes == arena.capacity - ticket.staging[1]
        got = wait_poll(src)  # nobody pulls: the lease runs out
        assert [r for r, _ in got] == ["expired"] and "lease" in got[0][1]
        assert_arenas_idle(src)
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
def test_staged_ranges_freed_on_both_sides_after_a_failed_pull(monkeypatch):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = nixl_pair(src_pool, dst_pool)
    try:
        monkeypatch.setattr(dst.agent, "transfer", lambda h, notif_msg=b"": "PROC")  # a READ that never ends
        monkeypatch.setattr(dst.agent, "check_xfer_state", lambda h: "PROC")
        ticket = src.export("slow", src_table(src_pool), NUM_TOKENS)
        assert ticket.staging is not None
        with pytest.raises(TransferTimeout, match="'slow'.*timed out.*1 descriptors"):  # the staged READ
            dst.pull(ticket, dst_table(dst_pool), timeout_s=0.3)
        assert_arenas_idle(dst)  # the READ was cancelled: the destination range is reusable
        got = wait_poll(src)
        assert [r for r, _ in got] == ["slow"] and "failed the transfer" in got[0][1] and released == got
        assert_arenas_idle(src)
        monkeypatch.undo()
        dtab = dst_table(dst_pool, seed=5)
        before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
        ticket = src.export("again", src_table(src_pool), NUM_TOKENS)  # the arenas still work
        assert dst.pull(ticket, dtab, timeout_s=10).descriptors == 1
        assert_moved(src_pool, dst_pool, ticket.page_table(), dtab, before)
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
@pytest.mark.parametrize("value", [-1, 1, 255, "lots", 1.5])
def test_bad_staging_bytes_fail_with_the_value(value, monkeypatch):
    pool = random_pool(SRC_CACHE, 0)
    with pytest.raises(ValueError, match="staging_bytes.*got " + re.escape(repr(value))):
        make_backend("nixl", pool, staging_bytes=value)
    monkeypatch.setenv("DSV4_NIXL_STAGING_BYTES", str(value))
    with pytest.raises(ValueError, match="staging_bytes"):
        make_backend("nixl", pool)


class _Done:
    """Stands in for a CUDA event on the CPU (StagingBuffer only calls query and synchronize)."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_a_released_range_is_held_until_its_scatter_has_run():
    """release(offset, event) holds the range until the event completes; alloc reclaims finished ones first, and
    waits for held ones rather than fail when nothing else is free."""
    from engine.model.cache import CachePool
    from kv_transfer.staging import StagingBuffer
    from tests.kv_transfer.test_kv_transfer import CFG

    buf = StagingBuffer(CachePool(CFG, DST_CACHE, torch.bfloat16, "cpu"), 4 * STAGING_ALIGN)
    whole = buf.arena.capacity
    a = buf.alloc(whole)
    ev = _Done()
    buf.release(a, ev)
    assert buf.arena.allocated() == {a: whole} and buf.reclaim() == 0  # still queued: held
    ev.done = True
    assert buf.reclaim() == 1 and buf.arena.allocated() == {}
    b = buf.alloc(whole)
    ev = _Done()
    buf.release(b, ev)
    assert buf.alloc(whole) == b and ev.waited == 1  # full: waited for the held scatter instead of failing
    buf.release(b)  # no event (the CPU's scatter is done on return): freed now
    assert buf.arena.allocated() == {} and buf.arena.free_bytes == whole


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: the scatter queued on the engine's stream")
def test_scatter_is_queued_without_waiting_and_holds_its_range_until_it_ran():
    """The decode side's scatter is queued on the current stream (the decode engine's) and not waited for: a
    busy stream (the engine's queued steps) does not hold up the pulling thread; its staging range stays held
    until the scatter has run; the pages get the staged bytes (read back by a gather)."""
    import time

    from engine.model.cache import CachePool
    from kv_transfer.staging import StagingBuffer
    from tests.kv_transfer.test_kv_transfer import CFG

    pool = CachePool(CFG, DST_CACHE, torch.bfloat16, "cuda")
    specs = [g.spec for g in pool.groups.values()]
    table = dst_tables(pool, 1)[0]
    layout = staged_layout(build_plan(specs, table, table, NUM_TOKENS))
    buf = StagingBuffer(pool, 2 * layout.nbytes + 2 * STAGING_ALIGN)
    src, back = buf.alloc(layout.nbytes), buf.alloc(layout.nbytes)
    g = torch.Generator(device="cuda").manual_seed(5)
    buf.tensor[src : src + layout.nbytes].copy_(
        torch.randint(0, 256, (layout.nbytes,), generator=g, device="cuda", dtype=torch.uint8)
    )
    staged = buf.tensor[src : src + layout.nbytes].clone()
    # One scatter first: a kernel's first launch loads its module (CUDA's lazy loading), which waits for the
    # device's queued work (seen on the H200: 1.5 s here); the steady state, every later pull, does not.
    buf.scatter(src, layout)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # ~1.5 s of work queued on the stream
    t = time.perf_counter()
    event = buf.scatter(src, layout)
    took = time.perf_counter() - t
    buf.release(src, event)
    assert took < 0.5, f"the scatter waited {took:.2f} s for the stream's queued work"
    assert not event.query() and src in buf.arena.allocated() and buf.reclaim() == 0  # queued: range held
    torch.cuda.synchronize()
    assert buf.reclaim() == 1 and src not in buf.arena.allocated()
    buf.gather(back, layout)
    for grp in layout.groups:
        b = back + grp.offset
        assert torch.equal(staged[grp.offset : grp.offset + grp.nbytes], buf.tensor[b : b + grp.nbytes]), grp.name


@needs_nixl
@pytest.mark.nixl
def test_page_descriptors_beyond_the_peers_registered_tensor_are_refused():
    """A peer whose metadata registers less than its pages span (a corrupt or lying peer): the page-descriptor pull
    names the group and posts no READ; the source learns of the failure and frees the request."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = nixl_pair(src_pool, dst_pool, 0, 0)
    try:
        table = src_table(src_pool)
        ticket = src.export("r0", table, NUM_TOKENS)
        addr, _, dev = dst._peers[src.worker_name]["groups"]["kv4"]
        dst._peers[src.worker_name]["groups"]["kv4"] = (addr, 256, dev)
        with pytest.raises(TransferError, match="group 'kv4': range .* beyond source tensor \\(256 bytes\\)"):
            dst.pull(ticket, dst_table(dst_pool), timeout_s=10)
        assert wait_poll(src)[0][0] == "r0" and released[0][0] == "r0" and released[0][1] is not None
    finally:
        src.close()
        dst.close()
