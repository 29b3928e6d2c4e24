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


def test_a_verdict_about_another_process_of_the_worker_releases_nothing():
    """A router that has not seen p0's restart reports p0 down with the old incarnation: a stream another router
    placed on the new one goes on; the verdict about the new one (or one naming none: the router's own Generate)
    releases it."""

    async def main():
        watches = StreamWatches()
        new = watches.watch("p0", "d0", incarnations={"p0": "p0-new", "d0": "d0-1"})
        unknown = watches.watch("p0", "d0")  # placed without incarnations: any verdict on p0 is its
        assert watches.worker_down("p0", "p0-old") == 1 and unknown.down == "p0" and new.down is None
        assert watches.worker_down("d0", "d0-2") == 0 and new.down is None
        assert watches.worker_down("p0", "p0-new") == 1 and new.down == "p0"
        again = watches.watch("p0", "d0", incarnations={"p0": "p0-new"})
        assert watches.worker_down("p0") == 1 and again.down == "p0"

    asyncio.run(main())
