"""`TokenLane`: a streamed request's plain tokens written to its client from the token feed's receive path, without
waking the request's task.

Why: a decode worker emits every stream's token of an engine step at once, and the feed hands them to this replica in
one frame (service.tcp_feed). Each token then woke its request's task and climbed the chain of layers between the
feed's queue and the response (service.ray_stream's placement, the stream watch, router.migration's recovering
stream, DirectClient.generate, the SSE body, SSEResponse): a task step and ~7 frames resumed a token, one request
after another, so the last stream of a burst waited for all the others' (BENCHMARKS frontdoor's reading, py-spy of
the replica). Here a plain token (a decode token: no finish, no prompt logprobs) goes from the feed's frame straight
through each layer's bookkeeping to the response's send, in the frame's own callback. It goes as its two values
(`take`: the token id and its logprob), not as an event object: the TCP feed hands them from the frame's arrays
(service.tcp_feed), and no layer builds its own event for it (a TokenEvent and a StreamEvent a token were ~3 us of the
~24 us the replica spent on one); a Ray feed's plain events are taken the same way (`FeedQueue.put` -> `take_plain`).

How: each layer fills in its part of the lane once the request's first token has passed it the usual way, and the
lane takes a token only while every part is in and the request's task is parked waiting for its next event (so
everything before it has been written: the order holds). Anything else (the first token, a finish, logprobs
of the prompt, a stop string to search, a worker marked down, a deadline passed, a write still waiting on the
client) takes today's path through the task; the layers' state is the same either way. Parts:
- `watch` (DirectClient): the placement's StreamWatch; a worker marked down sends the event the slow way (it raises).
- `streamed` (DirectClient): recovering_stream's list of the ids streamed so far (a migration resumes from it).
- `body` (the SSE body): whether the body may take a plain token now (no stop strings, deadline not passed), and
  `render`: the token (id, logprob) taken into the job (service.openai_job) -> its SSE bytes (None: nothing to send
  yet).
- `response` (SSEResponse): `write_now`, one send of the response from outside its task, and whether an earlier one
  still waits on the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TokenLane:
    """One streamed request's way around its task (module docstring); the layers fill in its parts."""

    __slots__ = ("body", "parked", "render", "response", "streamed", "watch")

    def __init__(self) -> None:
        self.parked = False  # the response's task waits for the request's next event (the SSE body sets it)
        self.watch: Any = None  # router.stream_watch.StreamWatch of the current placement
        self.streamed: list[int] | None = None  # router.migration.StreamProgress.generated
        self.body: Callable[[], bool] | None = None  # may the body take a plain token now?
        self.render: Callable[[int, float | None], bytes | None] | None = None  # (id, logprob) -> SSE bytes or None
        self.response: Any = None  # service.http_stream.SSEResponse once its head is out

    def take(self, token_id: int, logprob: float | None) -> bool:
        """Write a plain decode token to the client now if every part lets it (-> True); else False and nothing
        changed (the token goes to the request's queue as its event). An exception after the layers took it is the
        request's."""
        if not self.parked:
            return False
        streamed, body, render, response = self.streamed, self.body, self.render, self.response
        if streamed is None or render is None or body is None or response is None:
            return False
        watch = self.watch
        if (watch is not None and watch.down is not None) or response.busy() or not body():
            return False
        streamed.append(token_id)
        chunk = render(token_id, logprob)
        if chunk is not None:
            response.write_now(chunk)
        return True
