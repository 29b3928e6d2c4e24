"""router.stream_watch: a worker marked down fails the streams waiting on it as WorkerDied, whichever task reads the
stream at that moment (the ingress awaits a stream's first event in a task of its own and the response's task reads
the rest), and a real cancellation still gets through."""

from __future__ import annotations

import asyncio

import pytest

from router.dispatch import WorkerDied
from router.stream_watch import StreamWatches


async def _forever():
    yield 1
    await asyncio.Event().wait()  # a stopped worker: no next event, ever
    yield 2


def test_worker_down_fails_the_task_that_reads_now():
    async def main():
        watches = StreamWatches()
        events = _forever()
        watch = None

        async def first():  # the first event, read in a task of its own
            nonlocal watch
            watch = watches.watch("p0", "d0")
            return await watch.next(events)

        assert await asyncio.ensure_future(first()) == 1
        assert watch is not None and len(watches) == 1

        async def rest():  # the rest, read by another task
            return await watch.next(events)

        reader = asyncio.ensure_future(rest())
        await asyncio.sleep(0.05)
        assert watches.worker_down("p0") == 1  # the stream waits on both workers: p0 going down releases it
        done, _ = await asyncio.wait({reader}, timeout=5)
        assert done, "the stream's reader was not released"
        with pytest.raises(WorkerDied, match="p0"):
            reader.result()
        watch.close()
        assert len(watches) == 0

        other = watches.watch("p1", "d1")
        events2 = _forever()
        assert await other.next(events2) == 1
        reader2 = asyncio.ensure_future(other.next(events2))
        await asyncio.sleep(0.05)
        reader2.cancel()  # a real cancellation (client gone) is not turned into WorkerDied
        with pytest.raises(asyncio.CancelledError):
            await reader2

    asyncio.run(main())
