"""One request's stream across worker deaths: the retry and migration rules, shared by whoever owns the stream.

The owner of a stream is the process that reads the decode worker's tokens: the HTTP ingress replica on the
service's path (service.direct_path: the router only places), or the router itself on its `Generate` RPC
(router.server, the path of in-process engines and plain gRPC clients). Both run `recovering_stream`, so a
worker's death means the same thing on both:
- `WorkerDied` before anything was streamed -> the request is placed once more, as `<id>-r1`, excluding that
  incarnation of the worker (a restarted one may take it); a second death -> UNAVAILABLE naming the worker;
- the decode worker dies after tokens were streamed -> migration (Dynamo's recipe): the request continues as a
  new one whose prompt is the original prompt plus every token streamed so far, with the remaining token budget,
  placed on another (or the restarted) decode worker; the client's stream just goes on. At most `max_migrations`
  times (0 turns it off: then UNAVAILABLE naming the worker and how far it got).
What a migration preserves, exactly: the budget (the continuation's max_new_tokens is the original less the
tokens streamed, so the stream has the same total length), every token streamed once (none lost, none repeated:
the continuation's tokens follow the last one streamed) and the prefix (original prompt + streamed tokens). Not
the continuation itself: it is decoded from that prefix in another batch, so where numerics depend on the batch
(bf16 on a GPU) greedy tokens after the migration can differ from an undisturbed run; a seeded sampler restarts
its generator at that point; prompt logprobs are not sent again.
Prompt logprobs of prefill-only steps are held back and sent with the first token, so "nothing streamed yet"
holds until the first token and a retry never duplicates them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable

from engine.execution.request import TokenEvent
from router.dispatch import DispatchRequest, Overloaded, WorkerDied
from router.protos import pb2

log = logging.getLogger(__name__)
Code = pb2.Error.Code


class RouterFailure(Exception):
    """Ends a stream with `code` (an `Error.Code` value, equal to the gRPC status number) and `message`."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# (request, {worker id: incarnation that died on it}) -> the events of one placement of the request
Attempt = Callable[[DispatchRequest, dict[str, str]], AsyncGenerator[TokenEvent, None]]


@dataclasses.dataclass
class StreamProgress:
    """What one request has streamed so far, across its placements (read by the owner for logs and stats)."""

    generated: list[int] = dataclasses.field(default_factory=list)  # token ids streamed to the client
    retries: int = 0  # placements after a worker death (retries before the first token plus migrations)
    migrations: int = 0


def continuation(dreq: DispatchRequest, generated: list[int], n: int) -> DispatchRequest:
    """The rest of `dreq` after `generated` tokens: their ids join the prompt, the budget shrinks."""
    params = dataclasses.replace(
        dreq.params, max_new_tokens=dreq.params.max_new_tokens - len(generated), prompt_logprobs=False
    )
    return DispatchRequest(f"{dreq.request_id}-m{n}", tuple(dreq.prompt_ids) + tuple(generated), params)


def failure_of(e: Exception, request_id: str) -> RouterFailure | None:
    """The typed failure of an attempt's error (None: not one of these: a WorkerDied or a RouterFailure)."""
    if isinstance(e, ValueError):
        return RouterFailure(Code.INVALID_ARGUMENT, str(e))
    if isinstance(e, Overloaded):
        log.warning("request %s: decode worker overloaded: %s", request_id, e)
        return RouterFailure(
            Code.RESOURCE_EXHAUSTED, "the service is at capacity (no decode slot or cache pages free); retry later"
        )
    if isinstance(e, (WorkerDied, RouterFailure)):
        return None
    log.error("request %s failed", request_id, exc_info=e)
    return RouterFailure(
        Code.INTERNAL, f"internal error serving request {request_id} (details are in the log under that id)"
    )


async def recovering_stream(
    dreq: DispatchRequest,
    attempt: Attempt,
    *,
    incarnation_of: Callable[[str], str],
    role_of: Callable[[str], str],
    max_migrations: int = 2,
    progress: StreamProgress | None = None,
    on_death: Callable[[str], None] | None = None,
) -> AsyncGenerator[TokenEvent, None]:
    """The request's events, across retries and migrations (module docstring). `attempt` places and streams
    one (continuation of the) request; it raises WorkerDied when a worker serving it is gone.
    `incarnation_of(worker)`: the worker's current incarnation (the one a retry must avoid);
    `role_of(worker)`: "prefill" or "decode", for the error message; `on_death(worker)`: told of each death
    (the router marks the worker down). Raises RouterFailure."""
    state = progress if progress is not None else StreamProgress()
    excluded: dict[str, str] = {}
    retried = 0
    current = dreq
    while True:
        sent = 0
        held: list = []  # prompt logprobs of prefill-only steps, sent with the first token
        try:
            async with contextlib.aclosing(attempt(current, excluded)) as events:
                async for ev in events:
                    held.extend(ev.prompt_logprobs)
                    if ev.token_id is None and not ev.finished:
                        continue
                    if held:  # with those of the prefill-only events before it (a copy only then: hot path)
                        ev = dataclasses.replace(ev, prompt_logprobs=tuple(held))
                        held = []
                    sent += 1
                    if ev.token_id is not None:
                        state.generated.append(ev.token_id)
                    yield ev
                    if ev.finished:
                        return
            raise RouterFailure(Code.INTERNAL, f"request {dreq.request_id}: stream ended without a finish")
        except WorkerDied as e:
            generated = state.generated
            if on_death is not None:
                on_death(e.worker_id)
            excluded[e.worker_id] = incarnation_of(e.worker_id)
            log.warning(
                "request %s: %s (after %d messages, %d tokens in all)", dreq.request_id, e, sent, len(generated)
            )
            if generated and state.migrations < max_migrations:
                state.migrations += 1
                state.retries += 1
                current = continuation(dreq, generated, state.migrations)
                log.warning(
                    "request %s: migrating after %d tokens as %s", dreq.request_id, len(generated), current.request_id
                )
                continue
            if sent or retried:
                how = f"after {len(generated)} streamed tokens" if generated else "twice"
                raise RouterFailure(
                    Code.UNAVAILABLE,
                    f"request {dreq.request_id} failed: the {role_of(e.worker_id)} worker "
                    f"{e.worker_id} died while serving it ({how}); retry the request",
                ) from None
            retried += 1
            state.retries += 1
            # A fresh id: the dead attempt's prefill worker may still hold its export under the old one (released
            # by the attempt's cleanup or its lease, not before this retry may land on that worker again).
            current = dataclasses.replace(dreq, request_id=f"{dreq.request_id}-r{retried}")
