"""service.stream_deadline on a real asyncio loop: one timer bounds a stream's waits, never what runs between them."""

from __future__ import annotations

import asyncio

import pytest

from service.stream_deadline import StreamDeadline


def test_waits_before_the_deadline_return_their_values():
    async def run():
        deadline = StreamDeadline(asyncio.get_running_loop().time() + 10)
        got = [await deadline.wait(asyncio.sleep(0.001, result=k)) for k in range(5)]
        deadline.close()
        return got, deadline.expired

    assert asyncio.run(run()) == ([0, 1, 2, 3, 4], False)


def test_the_deadline_during_a_wait_cancels_it_as_a_timeout():
    async def run():
        deadline = StreamDeadline(asyncio.get_running_loop().time() + 0.05)
        waited = asyncio.ensure_future(asyncio.sleep(5))  # a broken deadline fails, not hangs
        with pytest.raises(TimeoutError):
            await deadline.wait(waited)
        return waited.cancelled(), asyncio.current_task().cancelling()

    assert asyncio.run(run()) == (True, 0)  # the awaited thing was cancelled; the task is not left cancelling


def test_the_deadline_between_waits_spares_that_work_and_fails_the_next_wait():
    async def run():
        deadline = StreamDeadline(asyncio.get_running_loop().time() + 0.02)
        await deadline.wait(asyncio.sleep(0))
        await asyncio.sleep(0.1)  # a slow write to the client: the deadline passes meanwhile, it is not cancelled
        wrote = True
        with pytest.raises(TimeoutError):
            await deadline.wait(asyncio.sleep(0, result="never"))
        return wrote

    assert asyncio.run(run())


def test_another_cancel_during_a_wait_stays_a_cancel():
    async def run():
        deadline = StreamDeadline(asyncio.get_running_loop().time() + 3600)
        task = asyncio.current_task()
        asyncio.get_running_loop().call_later(0.02, task.cancel)  # the client went away
        try:
            await deadline.wait(asyncio.sleep(5))
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            deadline.close()
        return "not cancelled"

    assert asyncio.run(run()) == "cancelled"
