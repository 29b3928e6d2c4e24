"""One deadline timer a streamed response, for all its waits on the next token.

Why: `asyncio.timeout_at` around each wait schedules and cancels a timer a token (a heap push and a cancelled handle
left in the loop's heap), per request. `StreamDeadline` schedules one timer at the request's start. The deadline
bounds only the waits (`wait`), never a write to the client in between: when it passes during a wait, that wait is
cancelled and raises TimeoutError (as `asyncio.timeout_at` would); when it passes between waits, the next wait raises
TimeoutError at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class StreamDeadline:
    """A deadline (the loop's clock, as `asyncio.timeout_at`) over a stream's waits; `close` it when the stream ends."""

    def __init__(self, when: float):
        self.expired = False
        self._waiting: asyncio.Task | None = None  # the task inside `wait`, if any
        self._task: asyncio.Task | None = None  # the task that reads the stream (all its waits)
        self._timer = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def wait(self, awaitable: Awaitable[T]) -> T:
        if self.expired:
            close = getattr(awaitable, "close", None)
            if close is not None:  # a coroutine not awaited: closed, so that nothing warns it never ran
                close()
            raise TimeoutError
        task = self._task
        if task is None:  # asked once: one task reads a stream (the SSE response's), and a token's wait is hot
            task = self._task = asyncio.current_task()
            assert task is not None, "StreamDeadline.wait runs in a task"
        cancelling = task.cancelling()
        self._waiting = task
        try:
            return await awaitable
        except asyncio.CancelledError:
            # ours (not another canceller's: e.g. the client went away) becomes the timeout
            if self.expired and task.uncancel() <= cancelling:
                raise TimeoutError from None
            raise
        finally:
            self._waiting = None

    def close(self) -> None:
        self._timer.cancel()
