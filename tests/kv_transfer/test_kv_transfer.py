"""KV transfer: the page plan (pure Python) and both backends (tcp, nixl) moving real pool tensors byte for byte."""

import dataclasses
import multiprocessing as mp
import pickle
import time

import pytest
import torch

from engine.loading.make_model import PRESETS
from engine.model.cache import CacheConfig, CacheGroupSpec, CachePool, group_specs
from engine.model.config import ModelConfig
from kv_transfer.base import ABORTED, READ_LEASE_MARGIN_S, pack_metadata, unpack_metadata
from kv_transfer.outcomes import TransferError, TransferTimeout
from kv_transfer.plan import build_plan, layout_fingerprint, page_bytes
from kv_transfer.registry import make_backend, resolve_name
from tests.support.backends import BACKEND_NAMES, NIXL_SKIP, needs_nixl

CFG = ModelConfig.from_dict(PRESETS["tiny"])
SRC_CACHE = CacheConfig(max_requests=4, max_tokens=2048, page_tokens=64)
DST_CACHE = CacheConfig(max_requests=6, max_tokens=4096, page_tokens=64)  # other pool size: other layer strides
NUM_TOKENS = 300  # kv4 / index: 75 entries = 5 pages of 16 (last partial); kv128: 2 entries = 2 pages of 1


def specs(cache=SRC_CACHE, dtype=torch.bfloat16):
    return group_specs(CFG, cache, dtype)


def by_name(ss):
    return {s.name: s for s in ss}


# ---- plan ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_tokens,expect",
    [
        (0, {"kv4": 0, "kv128": 0, "index": 0}),
        (3, {"kv4": 0, "kv128": 0, "index": 0}),
        (127, {"kv4": 2, "kv128": 0, "index": 2}),  # 31 entries; kv128 window still open (state only)
        (128, {"kv4": 2, "kv128": 1, "index": 2}),
        (NUM_TOKENS, {"kv4": 5, "kv128": 2, "index": 5}),
    ],
)
def test_plan_pages_for_num_tokens(num_tokens, expect):
    ss = specs()
    table = {s.name: list(range(s.num_pages)) for s in ss}
    plan = build_plan(ss, table, table, num_tokens)
    for name in ("swa", "state4", "state128", "index_state"):  # SWA ring / open-window state: always one page
        assert plan.group(name).pages == ((0, 0),)
    for name, n in expect.items():
        assert len(plan.group(name).pages) == n, name
    want = sum(len(g.pages) * len(s.layers) * page_bytes(s) for g, s in zip(plan.groups, ss))
    assert plan.total_bytes == want


def test_plan_pages_needed_may_be_absent_and_extras_ignored():
    ss = specs()
    table = {"swa": [1], "state4": [2], "state128": [0], "index_state": [3]}  # no growing groups at 3 tokens
    plan = build_plan(ss, table, table, 3)
    assert plan.group("kv4").pages == () and plan.group("state4").pages == ((2, 2),)
    big = {s.name: [0, 1, 2, 3] for s in ss}
    assert build_plan(ss, big, big, 3).group("swa").pages == ((0, 0),)


def test_plan_coalesces_runs_per_layer_with_each_side_stride():
    src = by_name(specs())["kv4"]
    dst = by_name(specs(DST_CACHE))["kv4"]
    pb = page_bytes(src)
    assert pb == 16 * 32 * 2 and src.num_pages != dst.num_pages
    plan = build_plan([src], {"kv4": [2, 3, 4, 7, 8]}, {"kv4": [10, 11, 12, 13, 5]}, NUM_TOKENS, dst_specs=[dst])
    g = plan.group("kv4")
    assert g.pages == ((2, 10), (3, 11), (4, 12), (7, 13), (8, 5))
    runs = [(2, 10, 3), (7, 13, 1), (8, 5, 1)]  # 7->13 / 8->5 break the run on the destination side
    want = [
        (l * src.num_pages * pb + s * pb, l * dst.num_pages * pb + d * pb, n * pb)
        for l in range(len(src.layers))
        for s, d, n in runs
    ]
    assert [(r.src_offset, r.dst_offset, r.length) for r in g.ranges] == want
    assert plan.num_descriptors == 6 and plan.total_bytes == 2 * 5 * pb


def test_plan_merges_across_layers_when_whole_layers_move():
    spec = CacheGroupSpec("kv4", (1, 3), 16, 32, torch.bfloat16, 4, 5)
    table = {"kv4": [0, 1, 2, 3, 4]}
    plan = build_plan([spec], table, table, 5 * 64)  # every page of both layers, same pool geometry
    assert plan.num_descriptors == 1 and plan.total_bytes == 2 * 5 * page_bytes(spec)


def test_plan_checks_downward_runs_and_notes_each_sides_runs():
    """A table handed back last-in first-out (a downward run) is checked like any other; build_plan notes per side
    the first page of a run of consecutive pages (None otherwise), as run_start finds it."""
    spec = CacheGroupSpec("kv4", (1, 3), 16, 32, torch.bfloat16, 4, 6)
    tables = {"up": [1, 2, 3, 4, 5], "down": [5, 4, 3, 2, 1], "scattered": [3, 1, 5, 0, 2]}
    for src_kind, src in tables.items():
        for dst_kind, dst in tables.items():
            g = build_plan([spec], {"kv4": src}, {"kv4": dst}, 5 * 64).group("kv4")
            assert g.src_ids == tuple(src) and g.dst_ids == tuple(dst)
            assert g.runs == ((1 if src_kind == "up" else None), (1 if dst_kind == "up" else None))
    for bad, what in (
        ([6, 5, 4, 3, 2], "out of range"),
        ([3, 2, 1, 0, -1], "out of range"),
        ([4, 3, 3, 2, 1], "repeats"),
    ):
        with pytest.raises(ValueError, match=f"group 'kv4'.*{what}"):
            build_plan([spec], {"kv4": tables["up"]}, {"kv4": bad}, 5 * 64)


def test_plan_validation_names_the_group():
    ss = specs()
    full = {s.name: [0, 1, 2, 3, 4] for s in ss}
    with pytest.raises(ValueError, match="source page table has no group 'kv4'"):
        build_plan(ss, {k: v for k, v in full.items() if k != "kv4"}, full, NUM_TOKENS)
    with pytest.raises(ValueError, match="destination page table of group 'kv128' has 1 page"):
        build_plan(ss, full, {**full, "kv128": [0]}, NUM_TOKENS)
    with pytest.raises(ValueError, match="group 'swa'.*out of range"):
        build_plan(ss, {**full, "swa": [99]}, full, NUM_TOKENS)
    with pytest.raises(ValueError, match="group 'index' repeats"):
        build_plan(ss, full, {**full, "index": [1, 1, 2, 3, 4]}, NUM_TOKENS)
    with pytest.raises(ValueError, match="group 'kv4': page layouts differ"):
        build_plan(
            ss,
            full,
            full,
            NUM_TOKENS,
            dst_specs=[dataclasses.replace(s, width=s.width * 2) if s.name == "kv4" else s for s in ss],
        )
    with pytest.raises(ValueError, match="num_tokens"):
        build_plan(ss, full, full, -1)
    assert layout_fingerprint(ss) == layout_fingerprint(specs(DST_CACHE))  # pool size is not layout
    assert layout_fingerprint(ss) != layout_fingerprint(specs(dtype=torch.float32))


# ---- backends --------------------------------------------------------------------------------------------
def random_pool(cache, seed):
    """A pool whose every byte is random (never zeros), so a missed or misplaced page shows."""
    pool = CachePool(CFG, cache, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(seed)
    for group in pool.groups.values():
        group.tensor.copy_(torch.randn(group.tensor.shape, generator=g) * 3 + 1)
    return pool


def src_table(pool):
    """Pages of one request in the source pool: consecutive runs after some other request's pages."""
    spacer = {}
    pool.grow(spacer, 200)
    table = {}
    pool.grow(table, NUM_TOKENS)
    return table


def dst_table(pool, seed=1):
    """Scattered destination pages (random permutation), so ranges do not coalesce the same way."""
    g = torch.Generator().manual_seed(seed)
    need = {s.name: s.pages_for_tokens(NUM_TOKENS) for s in (grp.spec for grp in pool.groups.values())}
    return {n: torch.randperm(pool.groups[n].spec.num_pages, generator=g)[:k].tolist() for n, k in need.items()}


def as_bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def assert_moved(src_pool, dst_pool, src_pages, dst_pages, before):
    for name, group in dst_pool.groups.items():
        rows = group.spec.page_rows
        s_pages, d_pages = src_pages.get(name, []), dst_pages.get(name, [])
        for s, d in zip(s_pages, d_pages):
            got, want = (
                group.tensor[:, d * rows : (d + 1) * rows],
                src_pool.groups[name].tensor[:, s * rows : (s + 1) * rows],
            )
            assert torch.equal(as_bytes(got), as_bytes(want)), (name, s, d)
        untouched = torch.ones(group.tensor.shape[1], dtype=torch.bool)
        for d in d_pages:
            untouched[d * rows : (d + 1) * rows] = False
        assert torch.equal(as_bytes(group.tensor[:, untouched]), as_bytes(before[name][:, untouched])), name


def wait_poll(backend, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = backend.poll()
        if got:
            return got
        time.sleep(0.01)
    return []


def connect(kind, src_pool, dst_pool, **src_kw):
    released = []
    src = make_backend(kind, src_pool, on_release=lambda rid, err: released.append((rid, err)), **src_kw)
    dst = make_backend(kind, dst_pool)
    dst.add_peer(src.worker_name, src.metadata())  # in production this blob travels through Ray, once
    return src, dst, released


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_pull_moves_every_group_byte_for_byte(kind):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    before = {n: g.tensor.clone() for n, g in dst_pool.groups.items()}
    src, dst, released = connect(kind, src_pool, dst_pool)
    try:
        table, dtab = src_table(src_pool), dst_table(dst_pool)
        ticket = src.export("req-1", table, NUM_TOKENS)
        ticket = pickle.loads(pickle.dumps(ticket))  # it travels through Ray
        stats = dst.pull(ticket, dtab, timeout_s=10)
        plan = dst.plan_for(ticket, dtab)
        assert stats.bytes == plan.total_bytes > 0
        # NIXL stages by default (kv_transfer.staging): the whole request is one descriptor
        assert plan.num_descriptors > 1
        assert stats.descriptors == (1 if kind == "nixl" else plan.num_descriptors)
        assert 0 < stats.wire_seconds <= stats.seconds, "the data movement's time is measured inside the pull's"
        # only a staged pull scatters (NIXL here), inside the pull and apart from its READ
        assert (stats.scatter_seconds > 0) == (kind == "nixl")
        assert stats.wire_seconds + stats.scatter_seconds <= stats.seconds
        assert_moved(src_pool, dst_pool, ticket.page_table(), dtab, before)
        assert wait_poll(src) == [("req-1", None)] and released == [("req-1", None)]
        assert src.exported() == []
    finally:
        src.close()
        dst.close()


@needs_nixl
@pytest.mark.nixl
def test_nixl_and_tcp_give_identical_pools():
    src_pool = random_pool(SRC_CACHE, 0)
    table = src_table(src_pool)
    results = {}
    for kind in ("tcp", "nixl"):
        dst_pool = random_pool(DST_CACHE, 1)
        src, dst, _ = connect(kind, src_pool, dst_pool)
        try:
            dst.pull(src.export("req", table, NUM_TOKENS), dst_table(dst_pool), timeout_s=10)
        finally:
            src.close()
            dst.close()
        results[kind] = {n: as_bytes(g.tensor) for n, g in dst_pool.groups.items()}
    for name in results["tcp"]:
        assert torch.equal(results["tcp"][name], results["nixl"][name]), name


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_receive_allocates_and_frees_on_failure(kind):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = connect(kind, src_pool, dst_pool)
    try:
        idle = dst_pool.num_free_pages()
        ticket = src.export("ok", src_table(src_pool), NUM_TOKENS)
        table, stats = dst.receive(ticket, timeout_s=10)
        assert stats.bytes > 0 and len(table["kv4"]) == 5
        dst_pool.free(table)
        ticket2 = src.export("lost", src_table(src_pool), NUM_TOKENS)
        dst.remove_peer(src.worker_name)  # e.g. the prefill worker was declared dead
        with pytest.raises(TransferError, match="unknown to"):
            dst.receive(ticket2, timeout_s=5)
        assert dst_pool.num_free_pages() == idle  # the failed request's destination pages are back
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_stalled_source_times_out_and_source_frees_on_failure_report(kind, monkeypatch):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = connect(kind, src_pool, dst_pool)
    try:
        if kind == "tcp":  # the server takes the request, then hangs before answering
            monkeypatch.setattr(src, "_check_read", lambda req: time.sleep(1.0) or [])
        else:  # a READ that never completes
            monkeypatch.setattr(dst.agent, "transfer", lambda h, notif_msg=b"": "PROC")
            monkeypatch.setattr(dst.agent, "check_xfer_state", lambda h: "PROC")
        ticket = src.export("slow", src_table(src_pool), NUM_TOKENS)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="'slow'.*timed out"):
            dst.pull(ticket, dst_table(dst_pool), timeout_s=0.5)
        assert time.monotonic() - t0 >= 0.45  # it waited for its deadline (an upper bound would be a timing test)
        got = wait_poll(src)
        assert [r for r, _ in got] == ["slow"] and "failed the transfer" in got[0][1]
        assert released == got and src.exported() == []
    finally:
        src.close()
        dst.close()


def test_tcp_server_serves_only_exported_pages():
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = connect("tcp", src_pool, dst_pool)
    try:
        ticket = src.export("r", src_table(src_pool), NUM_TOKENS)
        pages = dict(ticket.src_pages)
        forged = dataclasses.replace(
            ticket, src_pages=tuple((g, (0,) + p[1:] if g == "kv4" else p) for g, p in pages.items())
        )  # page 0 belongs to another request
        with pytest.raises(TransferError, match=r"pages \[0\] are not exported"):
            dst.pull(forged, dst_table(dst_pool), timeout_s=5)
        with pytest.raises(TransferError, match="'other' is not exported"):
            dst.pull(dataclasses.replace(ticket, request_id="other"), dst_table(dst_pool), timeout_s=5)
    finally:
        src.close()
        dst.close()


def test_tcp_source_gone_fails_fast_and_lease_expires():
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = connect("tcp", src_pool, dst_pool, lease_s=0.2)
    ticket = src.export("r", src_table(src_pool), NUM_TOKENS)
    src.close()
    # the pull would refuse a 0.2 s lease up front (test_lease_bounds_the_pull): this checks the connection
    ticket = dataclasses.replace(ticket, lease_expires_at=time.time() + 60)
    with pytest.raises(TransferError, match="cannot connect") as err:
        dst.pull(ticket, dst_table(dst_pool), timeout_s=5)
    assert not isinstance(err.value, TransferTimeout)  # a refused connection fails at once, not at the deadline
    time.sleep(0.25)  # no confirmation ever came: the lease frees the source pages
    assert src.poll() == [("r", released[0][1])] and "lease" in released[0][1]
    dst.close()


def test_handshake_and_registry_errors():
    src_pool = random_pool(SRC_CACHE, 0)
    other = CachePool(CFG, SRC_CACHE, torch.float32, "cpu")  # other dtype: other layout
    a, b = make_backend("tcp", src_pool), make_backend("tcp", other)
    try:
        with pytest.raises(TransferError, match="cache layout"):
            b.add_peer(a.worker_name, a.metadata())
        with pytest.raises(TransferError, match="not 'x'"):
            b.add_peer("x", a.metadata())
        header, _ = unpack_metadata(a.metadata())
        with pytest.raises(TransferError, match="same --transfer"):
            b.add_peer(a.worker_name, pack_metadata({**header, "backend": "nixl"}))
        with pytest.raises(TransferError, match="malformed"):
            b.add_peer("x", b"\x01")
        ticket = a.export("q", src_table(src_pool), NUM_TOKENS)
        with pytest.raises(TransferError, match="unknown to"):
            b.pull(ticket, {}, timeout_s=1)
        with pytest.raises(ValueError, match="already exported"):
            a.export("q", src_table(src_pool), NUM_TOKENS)
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError, match="unknown transfer backend"):
        make_backend("rdma", src_pool)
    assert resolve_name("auto") == ("tcp" if NIXL_SKIP else "nixl")


def _nixl_source(q, stop):
    """Child process: a prefill-side NIXL backend that exports one request, then waits to be killed."""
    pool = random_pool(SRC_CACHE, 0)
    src = make_backend("nixl", pool)
    q.put((src.worker_name, src.metadata(), src.export("r", src_table(pool), NUM_TOKENS)))
    stop.wait(60)


@needs_nixl
@pytest.mark.nixl
def test_nixl_dead_source_process_fails_within_deadline():
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_nixl_source, args=(q, stop), daemon=True)
    proc.start()
    dst_pool = random_pool(DST_CACHE, 1)
    dst = make_backend("nixl", dst_pool)
    try:
        name, meta, ticket = q.get(timeout=60)
        dst.add_peer(name, meta)
        dst.pull(ticket, dst_table(dst_pool), timeout_s=10)  # alive: works across processes
        proc.kill()
        proc.join(10)
        with pytest.raises(TransferError, match="'r'"):  # an error or the deadline, never a hang
            dst.pull(ticket, dst_table(dst_pool, seed=2), timeout_s=3)
    finally:
        proc.kill()
        dst.close()


def _thread_cpu(tids) -> float:
    import os

    total = 0
    for tid in tids:
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


@needs_nixl
@pytest.mark.nixl
def test_idle_nixl_agent_does_not_spin():
    """NIXL's progress thread would poll UCX back to back (90% of a core here, per agent); with the backend's
    progress delay an idle agent's threads use a few percent. Measured on the agent's own threads."""
    import os

    before = set(os.listdir("/proc/self/task"))
    backend = make_backend("nixl", random_pool(SRC_CACHE, 0), worker_name="idle-probe")
    try:
        threads = set(os.listdir("/proc/self/task")) - before
        assert threads, "the NIXL agent started no thread"
        time.sleep(0.5)
        c0, t0 = _thread_cpu(threads), time.monotonic()
        time.sleep(3.0)
        share = (_thread_cpu(threads) - c0) / (time.monotonic() - t0)
        assert share < 0.3, f"idle NIXL agent threads use {100 * share:.0f}% of a core"
    finally:
        backend.close()


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_lease_bounds_the_pull(kind, monkeypatch):
    """A pull's deadline is the earlier of its timeout and the source's lease (less READ_LEASE_MARGIN_S): a pull
    never outlives the pages it reads, and one that starts too late fails at once (the source is told)."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, released = connect(kind, src_pool, dst_pool, lease_s=READ_LEASE_MARGIN_S + 1.0)
    try:
        late = src.export("late", src_table(src_pool), NUM_TOKENS)
        late = dataclasses.replace(late, lease_expires_at=time.time() + READ_LEASE_MARGIN_S - 0.5)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="too late to pull"):
            dst.pull(late, dst_table(dst_pool), timeout_s=30)
        assert time.monotonic() - t0 < 5
        got = wait_poll(src)
        assert [r for r, _ in got] == ["late"] and "failed the transfer" in got[0][1]
        if kind == "tcp":  # a source that stalls: the pull gives up when the lease would, not after 30 s
            monkeypatch.setattr(src, "_check_read", lambda req: time.sleep(3.0) or [])
        else:
            monkeypatch.setattr(dst.agent, "transfer", lambda h, notif_msg=b"": "PROC")
            monkeypatch.setattr(dst.agent, "check_xfer_state", lambda h: "PROC")
        ticket = src.export("slow", src_table(src_pool), NUM_TOKENS)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            dst.pull(ticket, dst_table(dst_pool), timeout_s=30)
        assert time.monotonic() - t0 < 2.5  # lease 6 s less the 5 s margin
    finally:
        src.close()
        dst.close()


def test_tcp_server_pins_pages_while_it_reads_them():
    """The tcp server reads page views after dropping its lock: an export being read neither expires nor is freed
    (an abort waits for the read), and a read is not started when the lease ends within the margin."""
    src_pool = random_pool(SRC_CACHE, 0)
    released = []
    src = make_backend("tcp", src_pool, lease_s=0.3, on_release=lambda rid, err: released.append((rid, err)))
    try:
        src.export("short", src_table(src_pool), NUM_TOKENS)
        assert src._begin_read("short") is None  # its lease ends within the margin: never read
        src.lease_s = READ_LEASE_MARGIN_S + 0.3
        src.export("pinned", src_table(src_pool), NUM_TOKENS)
        export = src._begin_read("pinned")
        assert export is not None
        time.sleep(0.4)
        export.deadline = time.monotonic() - 1  # its lease ran out during the read
        assert [r for r, _ in src.poll()] == ["short"]  # "pinned" does not expire while it is read
        assert src.release("pinned", ABORTED) is False and "pinned" in src.exported()  # waits for the read
        assert src.poll() == []
        assert released == [("short", released[0][1])] and "pinned" in src.exported()
        src._end_read("pinned")
        assert src.poll() == [("pinned", ABORTED)] and released[-1] == ("pinned", ABORTED)
        assert src.exported() == []
    finally:
        src.close()


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_a_restarted_source_is_known_only_once_introduced_again(kind):
    """A worker that restarts keeps its name but not its backend: a ticket it exports after the restart is not
    `knows`-able with the metadata of the process before (the decode worker raises PeerUnknown and the pair is
    introduced again, rather than pulling from the dead process's address), and one from before it is not once the
    new metadata is in; pulls with the right metadata move the bytes."""
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(DST_CACHE, 1)
    src, dst, _ = connect(kind, src_pool, dst_pool, worker_name="p0")
    again = make_backend(kind, src_pool, worker_name="p0")  # the same worker after a restart
    try:
        old = src.export("req-old", src_table(src_pool), NUM_TOKENS)
        new = again.export("req-new", src_table(src_pool), NUM_TOKENS)
        assert old.source == new.source == "p0" and old.source_instance != new.source_instance
        assert dst.knows(old) and not dst.knows(new)
        assert dst.knows(dataclasses.replace(new, source_instance=""))  # a ticket that names none is not checked
        dst.remove_peer("p0")  # as DecodeWorker.add_peer re-learns a peer
        dst.add_peer("p0", again.metadata())
        assert dst.knows(new) and not dst.knows(old)
        stats = dst.pull(new, dst_table(dst_pool), timeout_s=10)
        assert stats.bytes == dst.plan_for(new, dst_table(dst_pool)).total_bytes > 0
        dst.remove_peer("p0")
        assert not dst.knows(new)
    finally:
        for b in (src, again, dst):
            b.close()
