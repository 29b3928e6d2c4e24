"""NIXL's done / fail notifications carry the per-service cluster token (the one the tcp transfer and the router
require): a notification without it, from any process that reaches the prefill agent's UCX endpoint, must not
release (free) an export's pages early."""

from __future__ import annotations

import pytest

from kv_transfer.registry import make_backend
from tests.kv_transfer.test_kv_transfer import DST_CACHE, NUM_TOKENS, SRC_CACHE, dst_table, random_pool, src_table
from tests.support.backends import needs_nixl

pytestmark = [needs_nixl, pytest.mark.nixl]


def test_nixl_notifications_need_the_cluster_token():
    """NIXL's done/fail notifications carry the per-service token: one from a peer without it (or with another)
    does not release (free) the export; the right one does. Real agents, real READs and notifications."""
    import time

    from tests.kv_transfer.test_kv_transfer import wait_poll

    src_pool = random_pool(SRC_CACHE, 0)
    released = []
    src = make_backend("nixl", src_pool, token="s3cret", on_release=lambda rid, err: released.append((rid, err)))
    peers = {tok: make_backend("nixl", random_pool(DST_CACHE, 1), token=tok) for tok in (None, "wrong", "s3cret")}
    table = src_table(src_pool)
    try:
        for tok, dst in peers.items():
            dst.add_peer(src.worker_name, src.metadata())
            rid = f"from-{tok}"
            ticket = src.export(rid, table, NUM_TOKENS)
            dst.pull(ticket, dst_table(dst.pool), timeout_s=10)  # the READ itself is one-sided: it works
            if tok == "s3cret":
                assert [r for r, _ in wait_poll(src)] == [rid]
            else:
                deadline = time.monotonic() + 1.5  # the notification arrives, and is ignored
                while time.monotonic() < deadline:
                    assert src.poll() == []
                    time.sleep(0.05)
                assert rid in src.exported()
        assert [r for r, _ in released] == ["from-s3cret"]
    finally:
        src.close()
        for dst in peers.values():
            dst.close()
