"""Chunk-by-chunk streaming of a prompt's caches (kv_transfer.plan, TransferBackend.export_chunk): the pages each
finished prefill chunk filled move while later chunks are still being prefilled, the final ticket moves only the
rest, and the decode side's tokens equal one engine doing both phases; chunks are released with their request,
by their own lease, or by the decode side's confirmation, and never free the request's pages themselves."""

from __future__ import annotations

import pytest
import torch

from engine.execution.sampling_params import SamplingParams
from engine.loading.load import load_engine
from kv_transfer.base import ABORTED, chunk_id
from kv_transfer.outcomes import TransferTimeout
from kv_transfer.plan import build_plan, complete_pages, page_span
from kv_transfer.registry import make_backend
from tests.kv_transfer.test_kv_transfer import NUM_TOKENS, SRC_CACHE, random_pool, src_table, wait_poll
from tests.support.backends import BACKEND_NAMES
from tests.support.handoff import run_colocated, run_streamed_handoff

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 150, 300)]


# ---- plans -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cuts", [(0, 300), (0, 64, 300), (0, 10, 64, 65, 190, 256, 299, 300), (0, 299, 300)])
def test_chunk_plans_and_the_final_plan_partition_the_whole_plan(cuts):
    """Chunks [cuts[i], cuts[i+1]) then the final plan from the last cut move every page of the whole plan
    exactly once; a chunk never moves a page its positions have not filled completely, nor a fixed group."""
    pool = random_pool(SRC_CACHE, 0)
    specs = [g.spec for g in pool.groups.values()]
    table = src_table(pool)
    whole = build_plan(specs, table, table, NUM_TOKENS)
    moved: dict[str, list[int]] = {s.name: [] for s in specs}
    for start, end in zip(cuts[:-2], cuts[1:-1]):
        chunk = build_plan(specs, table, table, end, start_tokens=start, final=False)
        for g, spec in zip(chunk.groups, specs):
            assert not (spec.fixed and g.pages), g.name
            assert len(moved[g.name]) + len(g.pages) <= complete_pages(spec, end), g.name
            moved[g.name] += [s for s, _ in g.pages]
    final = build_plan(specs, table, table, NUM_TOKENS, start_tokens=cuts[-2])
    for g in final.groups:
        moved[g.name] += [s for s, _ in g.pages]
    assert moved == {g.name: [s for s, _ in g.pages] for g in whole.groups}


def test_page_span_and_bad_start_tokens():
    specs = {g.spec.name: g.spec for g in random_pool(SRC_CACHE, 0).groups.values()}
    kv4, swa = specs["kv4"], specs["swa"]  # kv4: 16 entries (64 positions) a page
    assert page_span(kv4, 300, 0, final=False) == (0, 4) and page_span(kv4, 300, 130, final=True) == (2, 5)
    assert page_span(swa, 300, 130, final=False) == (0, 0) and page_span(swa, 300, 130) == (0, 1)
    table = {s: list(range(1, 6)) for s in specs}
    with pytest.raises(ValueError, match="start_tokens must be in"):
        build_plan(list(specs.values()), table, table, 100, start_tokens=101)


# ---- engines through both backends -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def colocated():
    return run_colocated(load_engine(page_tokens=64, max_batch_tokens=2048, warmup=False), PROMPTS, PARAMS)


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_streamed_handoff_equals_colocated(kind, colocated):
    # 32-token prefill chunks, 64-token pages: chunks move pages while later chunks are prefilled
    prefill = load_engine(page_tokens=64, max_batch_tokens=32, warmup=False)
    decode = load_engine(page_tokens=64, max_batch_tokens=64, warmup=False)
    got, moved = run_streamed_handoff(kind, prefill, decode, PROMPTS, PARAMS)
    for g, w in zip(got, colocated):
        assert g.output == w.output
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5)
    assert moved[0]["chunks"] == 0  # 5 positions fill no page: all of it moves with the final ticket
    longest = moved[2]
    assert longest["chunks"] >= 3 and longest["chunk_bytes"] > 0
    assert longest["start_tokens"] >= 256  # the last chunk was pulled before the prefill ended
    for engine in (prefill, decode):
        assert engine.pool.num_free_pages() == engine.pool.idle_free_pages()


def test_final_ticket_moves_only_the_tail():
    """The streamed request's final pull moves fewer bytes than its whole caches: the chunks took the rest."""
    prefill = load_engine(page_tokens=64, max_batch_tokens=32, warmup=False)
    decode = load_engine(page_tokens=64, max_batch_tokens=64, warmup=False)
    _, moved = run_streamed_handoff("tcp", prefill, decode, PROMPTS[2:], PARAMS)
    m = moved[0]
    specs = [g.spec for g in prefill.pool.groups.values()]
    table = {s.name: list(range(1, 1 + s.pages_for_tokens(300))) for s in specs}
    whole = build_plan(specs, table, table, 300).total_bytes
    assert m["chunk_bytes"] + m["final_bytes"] == whole and m["final_bytes"] < whole


# ---- releases ---------------------------------------------------------------------------------------------
def _pair(kind, lease_s=120.0):
    src_pool, dst_pool = random_pool(SRC_CACHE, 0), random_pool(SRC_CACHE, 1)
    released = []
    src = make_backend(kind, src_pool, lease_s=lease_s, on_release=lambda rid, err: released.append((rid, err)))
    dst = make_backend(kind, dst_pool)
    dst.add_peer(src.worker_name, src.metadata())
    return src, dst, src_pool, dst_pool, released


def _idle(*backends):
    for b in backends:
        staging = getattr(b, "staging", None)
        if staging is not None:
            assert staging.arena.allocated() == {}, b.worker_name


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_abort_releases_the_requests_chunks_without_callbacks(kind):
    src, dst, src_pool, dst_pool, released = _pair(kind)
    try:
        table = src_table(src_pool)
        first = src.export_chunk("r", table, 130, 0)
        second = src.export_chunk("r", table, 260, 130)
        assert first is not None and second is not None and first.request_id == chunk_id("r", 0)
        # a chunk's ticket lists its own pages only (64 positions a kv4 page): tickets do not grow along a stream
        assert first.page_table()["kv4"] == table["kv4"][:2] and second.page_table()["kv4"] == table["kv4"][2:4]
        assert first.page_table()["swa"] == [] and second.start_tokens == 130 and not second.final
        assert src.export_chunk("r", table, 20, 0) is None  # 20 positions fill no page
        with pytest.raises(ValueError, match="already exported"):
            src.export_chunk("r", table, 130, 0)
        dst_table = {}
        dst_pool.grow(dst_table, NUM_TOKENS)
        assert dst.pull(first, dst_table, timeout_s=10).bytes > 0
        assert wait_poll(src) == [(first.request_id, None)]  # the chunk's confirmation: no page callback
        assert released == [] and src.exported() == [second.request_id]
        assert src.release("r", ABORTED) is False  # the request itself was never exported
        assert src.exported() == [] and released == []  # its unpulled chunk went with it
        _idle(src, dst)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("kind", BACKEND_NAMES)
def test_a_chunk_lease_expires_alone_and_is_not_pulled_after(kind):
    src, dst, src_pool, dst_pool, released = _pair(kind, lease_s=0.05)
    try:
        table = src_table(src_pool)
        chunk = src.export_chunk("r", table, 200, 0)
        assert wait_poll(src)[0][0] == chunk.request_id and released == [] and src.exported() == []
        dst_table = {}
        dst_pool.grow(dst_table, NUM_TOKENS)
        with pytest.raises(TransferTimeout, match="too late to pull"):  # its ticket's lease is over
            dst.pull(chunk, dst_table, timeout_s=10)
        _idle(src, dst)
    finally:
        src.close()
        dst.close()
