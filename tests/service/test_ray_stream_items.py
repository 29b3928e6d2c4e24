"""service.ray_items' reader of Ray streaming calls (`next_item`, `stream_items`) on a real local Ray: every item in
order then the end, a task error as its cause, a dead actor as WorkerDied; the one-fetch path and the generator's own
path give the same items."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest

from router.dispatch import WorkerDied
from service.ray_cluster import init_ray

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def producer():
    started = not ray.is_initialized()
    if started:
        init_ray(tempfile.mkdtemp(prefix="dsv4-test-metrics-"))  # retries a start that misses Ray's deadline

    @ray.remote(num_cpus=0, max_restarts=0)
    class Producer:
        async def items(self, n: int, then: str = "end", batch: int = 1):
            for k in range(n):
                yield tuple(range(k * batch, (k + 1) * batch)) if batch > 1 else k
            if then == "raise":
                raise ValueError(f"failed after {n} items")
            if then == "die":
                # Ray sends a streaming item's report after the yield, asynchronously: dying at once can lose the
                # items yielded just before (seen under the full suite's load); a worker that dies mid-stream has
                # long sent the tokens before it. What is tested is the reader given those items, then the death.
                await asyncio.sleep(0.5)
                os._exit(1)

    yield Producer
    if started:
        ray.shutdown()


class _PublicOnly:
    """A streaming call seen through the generator's public async iteration only (no `_get_next_ref_n`)."""

    def __init__(self, stream):
        self.stream = stream

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.stream.__anext__()


def _drain(stream, public: bool = False):
    from service.ray_items import stream_items

    async def run():
        got: list = []
        try:
            async for item in stream_items(_PublicOnly(stream) if public else stream, "w-1"):
                got.append(item)
        except Exception as e:  # noqa: BLE001 - returned for the test to check
            return got, e
        return got, None

    return asyncio.run(run())


@pytest.mark.parametrize("public", [False, True])
def test_items_in_order_then_the_end(producer, public):
    actor = producer.remote()
    got, error = _drain(actor.items.options(num_returns="streaming").remote(12), public)
    assert (got, error) == (list(range(12)), None)
    batched, error = _drain(actor.items.options(num_returns="streaming").remote(5, batch=3), public)
    assert (batched, error) == (list(range(15)), None)  # tuples flattened in order


@pytest.mark.parametrize("public", [False, True])
def test_a_task_error_is_its_cause_after_the_items_before_it(producer, public):
    actor = producer.remote()
    got, error = _drain(actor.items.options(num_returns="streaming").remote(3, "raise"), public)
    assert got == [0, 1, 2]
    assert isinstance(error, ValueError) and "failed after 3 items" in str(error)


@pytest.mark.parametrize("public", [False, True])
def test_a_dead_actor_is_worker_died_after_the_items_before_it(producer, public):
    actor = producer.remote()
    got, error = _drain(actor.items.options(num_returns="streaming").remote(3, "die"), public)
    assert got == [0, 1, 2]
    assert isinstance(error, WorkerDied) and error.worker_id == "w-1"


def test_next_item_reads_once_and_ends(producer):
    from service.ray_items import END, next_item

    actor = producer.remote()

    async def run():
        stream = actor.items.options(num_returns="streaming").remote(2)
        return [await next_item(stream) for _ in range(4)]

    assert asyncio.run(run()) == [0, 1, END, END]
