"""PrefillFeed: the items of one `PrefillWorker.prefill_streamed` call (a Ray streaming call, or STREAM frames on a
prefill link: service.prefill_link), read as they arrive by a task of their own.

service.ray_stream's streamed hand-off pulls each chunk ticket into the decode worker while the prefill goes on; the
puller may lag behind the prefill, so a separate reader takes the stream's items (chunk `TransferTicket`s, then the
`PrefillResult`) off Ray as they come, with their arrival time (the result's arrival is when the prefill ended, as
the dispatcher sees it, whatever the puller is doing), and notices at once when the stream ends in the prefill
worker's death (`died`: a pull in flight from a dead source cannot succeed and need not be waited for).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from engine.handoff import PrefillResult, TransferTicket
from router.dispatch import WorkerDied

log = logging.getLogger(__name__)


class PrefillFeed:
    """Create inside the loop that reads it; `close` it unless its PrefillResult was taken."""

    def __init__(self, cancel: Callable[[], None], items: AsyncIterator, prefill_id: str):
        """cancel: stops the prefill_streamed call (`close`: `ray.cancel` of its ObjectRefGenerator, or a prefill
        link's CANCEL, service.prefill_link); items: its items, flattened, with the worker's death as WorkerDied and
        its own errors unwrapped (service.ray_stream.stream_items, or the link's)."""
        loop = asyncio.get_running_loop()
        self.prefill_id = prefill_id
        self._cancel = cancel
        self._queue: asyncio.Queue = asyncio.Queue()
        self._result_seen = False
        self.died: asyncio.Future[WorkerDied] = loop.create_future()  # set when the stream ends in the worker's death
        self.ended = loop.create_task(self._read(items))  # done when the stream ended, however

    async def _read(self, items: AsyncIterator) -> None:
        error: Exception | None = None
        try:
            async for item in items:
                self._result_seen = self._result_seen or isinstance(item, PrefillResult)
                self._queue.put_nowait((item, time.monotonic()))
        except Exception as e:  # noqa: BLE001 - handed to the reader of the queue, in order
            error = e
        if error is None and not self._result_seen:
            error = WorkerDied(self.prefill_id, "its streamed prefill ended without a result")
        if error is None:
            return
        if isinstance(error, WorkerDied) and error.worker_id == self.prefill_id:
            self.died.set_result(error)
        self._queue.put_nowait((error, time.monotonic()))

    async def next(self) -> tuple[TransferTicket | PrefillResult, float]:
        """The next item and its monotonic arrival; raises what ended the stream before its result."""
        item, arrived = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item, arrived

    def close(self, request_id: str) -> None:
        """Stop reading and cancel the call: its worker drops the request and its chunks (its stream's own
        cleanup; the dispatcher's abort follows anyway)."""
        self.ended.cancel()
        if not self.died.done():
            self.died.cancel()
        try:
            self._cancel()
        except Exception as e:  # noqa: BLE001 - best effort (a dead worker, a call already over)
            log.debug("request %s: cancelling its prefill stream: %s", request_id, e)
