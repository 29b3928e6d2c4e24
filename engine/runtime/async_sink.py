"""`AsyncSink`: a request's events, put by the engine thread, delivered to an asyncio queue on another thread's loop.

Apart from `engine.runtime.engine_loop` (which routes events to sinks) so that the token feed's sink
(decode_worker.token_feed, whose item types the ingress replica reads) builds on it without importing the loop and,
through its EngineCore, torch.
"""

from __future__ import annotations

import asyncio


class AsyncSink:
    """Delivers a request's events to an asyncio queue owned by another thread's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # loop closed: nobody listens any more
            pass
