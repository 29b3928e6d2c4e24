"""Transfer metrics as Prometheus scrapes them: real prefill and decode workers in process (tcp transfer), the real
/metrics server, parsed with prometheus_client's own parser. A failed pull counts once (by the decode worker that
pulled, not again by the prefill worker its failure report reaches); a cancelled request is an abort, never a
failure (the failure-ratio alert must not page on cancellations); a lease that expires unconfirmed (the decode side
vanished: nobody else can count it) is the prefill worker's failure."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.worker import DecodeWorker
from engine.execution.sampling_params import SamplingParams
from engine.telemetry.metrics import start_metrics_server
from kv_transfer.base import TransferTimeout
from prefill_worker.worker import PrefillWorker
from tests.support.ports import free_port

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def port():
    p = free_port()
    server, _ = start_metrics_server(p, "127.0.0.1")
    yield p
    server.shutdown()
    server.server_close()


def scrape(port: int, name: str) -> dict[tuple, float]:
    """{sorted label items: value} of counter `name` (without _total) as served on /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name == f"{name}_total":
                    out[tuple(sorted(s.labels.items()))] = s.value
    return out


def count(samples: dict, **labels) -> float:
    return sum(v for k, v in samples.items() if all((key, val) in k for key, val in labels.items()))


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)


def held(worker, rid: str) -> bool:
    return worker.loop.call(lambda e: rid in e.held).result(10)


def test_failed_pull_counts_once_and_aborts_are_apart(port):
    prefill = PrefillWorker("mx-p", None, transfer="tcp")
    decode = DecodeWorker("mx-d", None, transfer="tcp", transfer_timeout_s=1e-9)  # every pull times out
    decode.add_peer("mx-p", prefill.transfer_metadata())
    try:

        async def fail_one():
            res = await prefill.prefill("f1", [5, 6, 7], PARAMS)
            with pytest.raises(TransferTimeout):
                await anext(decode.decode(res, [5, 6, 7], PARAMS))
            for _ in range(200):  # the prefill side frees once the failure report reaches it (polled)
                if not held(prefill, "f1"):
                    break
                await asyncio.sleep(0.05)
            res = await prefill.prefill("a1", [8, 9, 10], PARAMS)
            assert held(prefill, "a1")
            await prefill.abort("a1")  # the client went away: the export is withdrawn

        asyncio.run(fail_one())
        assert not held(prefill, "f1") and not held(prefill, "a1")
        failures = scrape(port, "dsv4_kv_transfer_failures")
        assert count(failures, worker="mx-d") == 1 and count(failures, worker="mx-d", kind="timeout") == 1
        assert count(failures, worker="mx-p") == 0  # the failure report is not counted a second time
        aborts = scrape(port, "dsv4_kv_transfer_aborts")
        assert count(aborts, worker="mx-p", side="prefill", backend="tcp") == 1
        assert count(aborts, worker="mx-d") == 0
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_expired_lease_is_the_prefill_workers_failure(port):
    prefill = PrefillWorker("mx-lease", None, transfer="tcp", lease_s=0.3)
    try:

        async def expire():
            await prefill.prefill("e1", [5, 6, 7], PARAMS)  # nobody pulls it
            for _ in range(200):  # the lease runs out; the prefill worker's poller releases it
                if not held(prefill, "e1"):
                    return
                await asyncio.sleep(0.05)

        asyncio.run(expire())
        assert not held(prefill, "e1")
        wait_for(lambda: count(scrape(port, "dsv4_kv_transfer_failures"), worker="mx-lease") == 1)
        assert count(scrape(port, "dsv4_kv_transfer_failures"), worker="mx-lease", kind="lease_expired") == 1
    finally:
        prefill.shutdown()
