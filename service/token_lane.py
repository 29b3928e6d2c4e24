"""`TokenLane`: a streamed request's plain tokens written to its client from the token feed's receive path, without
waking the request's task.

Why: a decode worker emits every stream's token of an engine step at once, and the feed hands them to this replica in
one frame (service.tcp_feed). Each token then woke its request's task and climbed the chain of layers between the
feed's queue and the response (service.ray_stream's placement, the stream watch, router.migration's recovering
stream, DirectClient.generate, the SSE body, SSEResponse): a task step and ~7 frames resumed a token, one request
after another, so the last stream of a burst waited for all the others' (BENCHMARKS frontdoor's reading, py-spy of
the replica). Here a plain token (a decode token: no finish, no prompt logprobs) goes from `FeedQueue.put` straight
through each layer's bookkeeping to the response's send, in the frame's own callback.

How: each layer fills in its part of the lane once the request's first token has passed it the usual way, and the
lane takes an event only while every part is in and the request's task is parked waiting for its next event (so
everything before the event has been written: the order holds). Anything else (the first token, a finish, logprobs
of the prompt, a stop string to search, a worker marked down, a deadline passed, a write still waiting on the
client) takes today's path through the task; the layers' state is the same either way. Parts:
- `watch` (DirectClient): the placement's StreamWatch; a worker marked down sends the event the slow way (it raises).
- `relay` (DirectClient): recovering_stream's bookkeeping (the streamed ids a migration resumes from) -> the event as
  the router client's StreamEvent.
- `body` (the SSE body): whether the body may take a plain event now (no stop strings, deadline not passed), and
  `render`: the event taken into the job (service.openai_job) -> its SSE bytes (None: nothing to send yet).
- `response` (SSEResponse): `write_now`, one send of the response from outside its task, and whether an earlier one
  still waits on the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TokenLane:
    """One streamed request's way around its task (module docstring); the layers fill in its parts."""

    __slots__ = ("body", "parked", "relay", "render", "response", "watch")

    def __init__(self) -> None:
        self.parked = False  # the response's task waits for the request's next event (the SSE body sets it)
        self.watch: Any = None  # router.stream_watch.StreamWatch of the current placement
        self.relay: Callable[[Any], Any] | None = None  # TokenEvent -> StreamEvent, bookkeeping done
        self.body: Callable[[], bool] | None = None  # may the body take a plain event now?
        self.render: Callable[[Any], bytes | None] | None = None  # StreamEvent -> its SSE bytes (None: none yet)
        self.response: Any = None  # service.http_stream.SSEResponse once its head is out

    def offer(self, ev) -> bool:
        """Write `ev` to the client now if it is plain and every part lets it (-> True); else False and nothing
        changed (the event goes to the request's queue). An exception after the layers took it is the request's."""
        if not self.parked or ev.token_id is None or ev.finished or ev.prompt_logprobs:
            return False
        watch, relay, body, render, response = self.watch, self.relay, self.body, self.render, self.response
        if relay is None or render is None or body is None or response is None:
            return False
        if (watch is not None and watch.down is not None) or response.busy() or not body():
            return False
        chunk = render(relay(ev))
        if chunk is not None:
            response.write_now(chunk)
        return True
