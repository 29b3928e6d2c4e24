"""Reading Ray calls' answers on the token path: a streaming call's items fetched once each, and Ray's errors as what
they mean to the caller (a dead actor is the worker's `WorkerDied`, an actor's own error arrives without Ray's
remote-traceback wrapper). Used by service.ray_stream (one placement) and service.token_feed (a worker's feed).
"""

from __future__ import annotations

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectRefStreamEndOfStreamError,
    RayActorError,
    RayTaskError,
)

from engine.runtime.loop_errors import LoopStopped
from router.dispatch import WorkerDied

DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


def cause(e: BaseException) -> BaseException:
    """The exception an actor method raised, without Ray's remote-traceback wrapper."""
    inner = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None
    return inner if isinstance(inner, Exception) else e


def failure(e: BaseException, worker_id: str) -> BaseException:
    """What a caller sees for an actor's task error: a dead engine loop is the worker's death, else the cause."""
    inner = cause(e)
    return WorkerDied(worker_id, f"its engine failed: {inner}") if isinstance(inner, LoopStopped) else inner


async def stream_items(stream, worker_id: str):
    """The items of a Ray streaming call, flattened (a decode worker sends a tuple of events per message), with a
    dead actor as WorkerDied and a task error as its cause."""
    while True:
        try:
            item = await next_item(stream)
        except DEAD as e:
            raise WorkerDied(worker_id, str(e)) from None
        except RayTaskError as e:
            raise failure(e, worker_id) from None
        if item is END:
            return
        if isinstance(item, tuple):
            for ev in item:
                yield ev
        else:
            yield item


END = object()  # next_item's answer once a stream has ended cleanly


async def next_item(stream):
    """The next item's value of a Ray streaming call (an ObjectRefGenerator), or END; an item that is an error raises.

    Fetched once: the generator's own `anext` waits for an item by fetching it, then hands out its ref, which must
    be fetched again (two gets, each a hop from Ray's thread to the loop). Reading the head ref of the stream
    (`_get_next_ref_n`: a clean end raises ObjectRefStreamEndOfStreamError there, a dead actor its error) and
    advancing past it once its value is in costs about a quarter less of the reader's CPU per item (BENCHMARKS.md,
    section frontdoor's reading). A Ray without those methods takes the generator's own path."""
    head = getattr(stream, "_get_next_ref_n", None)
    if head is None:
        try:
            ref = await anext(stream)
        except StopAsyncIteration:
            return END
        return await ref
    try:
        value = await head(1)[0]
    except ObjectRefStreamEndOfStreamError:
        return END
    stream._consume_next_ref_n(1)
    return value
