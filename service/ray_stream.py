"""One placement of a request over Ray actors: prefill on the prefill actor, then the decode actor's token stream.

Called by whoever owns the request's stream: the HTTP ingress replica (service.direct_path; the router only placed
the request) or the router's RayDispatcher (the router's own `Generate`). Nothing here keeps state between requests
beyond an optional cache of the prefill workers' transfer metadata.

`run_placement` yields the engine's TokenEvents: the first token only once the decode side holds the caches (so
TTFT includes the transfer, and a failed transfer fails the request before anything was streamed), then the decode
actor's tokens, which it sends in batches (every event its engine produced since the last message: one Ray item
for several tokens when the reader lags or speculative decoding accepts several). With `feeds` (an ingress replica's
service.token_feed.TokenFeeds) the decode stream carries only `Transferred` and the tokens come over the decode
worker's token feed, one Ray item an engine step for all of this replica's requests there; over a TCP feed the
decode is opened on the feed's connection itself, no Ray call (DSV4_TOKEN_FEED_OPEN, service.tcp_feed), with the
same errors as the call's; with `prefill_links` the `prefill` (and `prefill_streamed`) call goes as a frame on a connection the prefill
worker opened to this replica the same way (DSV4_PREFILL_FEED, service.prefill_link), same errors again. Errors:
- an actor that died (or whose engine loop ended: `LoopStopped`) -> `WorkerDied` naming it;
- a decode worker that does not know the prefill worker (`PeerUnknown`: one of them restarted since the health
  probe introduced them) -> the pair is introduced here and the pull retried once;
- a decode worker that is momentarily full (`DecodeOverloaded`: the router's admission estimate was off, or two
  routers placed on its last slot) -> retried with backoff for `overload_retry_s`, then `Overloaded`;
- a failed pull whose prefill worker no longer holds the export (it restarted) -> that worker's `WorkerDied`;
- an actor's own error arrives wrapped in Ray's RayTaskError (a remote traceback with pids and addresses): it is
  unwrapped, so only the worker's message travels on (a ValueError is the request's fault).
Closing the generator before the finish (client gone, stop string, a worker marked down) aborts the request on both
workers, fire-and-forget: the engines free its pages (docs/architecture.md, who frees what).

Streamed hand-off: a prompt spanning at least `DSV4_KV_STREAM_MIN_CHUNKS` of its prefill worker's steps
(`PrefillWorker.stream_chunk_tokens`, asked once per worker) reserves its pages on the decode worker first
(`reserve_streamed`: DecodeOverloaded retried as above), then reads `prefill_streamed` (service.prefill_feed: a
reader task takes its chunk tickets as the prefill steps complete pages), and each is pulled (`pull_chunk`) in order
while the later chunks are prefilled; `decode` with the PrefillResult then moves only the rest. The same errors as
above, on each call; the prefill worker's death during a chunk pull (its stream says so) is that worker's
`WorkerDied`.
Closing early cancels the prefill stream (its worker drops the request and its chunks) and aborts both workers
(the decode worker frees the reservation, after a chunk pull in flight if there is one).
Every placement records its hand-off time not overlapped with the prefill (the PrefillResult's arrival here to the
decode side's `Transferred`) in `dsv4_kv_handoff_exposed_seconds{streamed}` and, if given, `on_handoff`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import ray
from ray.exceptions import RayTaskError

from decode_worker.token_feed import FeedUnknown
from dsv4_kernels.settings import settings
from engine.execution.request import TokenEvent
from engine.handoff import DecodeOverloaded, PeerUnknown, PrefillResult, Transferred, TransferTicket
from engine.telemetry import metrics
from kv_transfer.outcomes import TransferError
from router.dispatch import DispatchRequest, Overloaded, WorkerDied
from service.prefill_feed import PrefillFeed
from service.prefill_link import PrefillLink, PrefillLinks
from service.ray_items import DEAD, END, cause, failure, next_item, stream_items
from service.token_feed import FeedQueue, TokenFeeds


@dataclass(frozen=True)
class HandoffTiming:
    """One disaggregated placement's hand-off, as its dispatcher saw it (monotonic seconds on its clock)."""

    request_id: str
    streamed: bool
    chunks: int  # chunk tickets pulled before the PrefillResult arrived here or after it (streamed only)
    prefill_s: float  # the prefill call (after the reservation, when streamed) to its PrefillResult's arrival
    exposed_s: float  # the PrefillResult's arrival to the decode worker's Transferred: not hidden by the prefill


@dataclass(frozen=True)
class Workers:
    """The two actors of one placement (the same decode actor twice for a local prefill)."""

    prefill_id: str
    prefill: object  # Ray actor handle
    decode_id: str
    decode: object

    @property
    def local(self) -> bool:
        """Conditional disaggregation: the decode worker prefills the request itself (no transfer)."""
        return self.prefill_id == self.decode_id


class RayStreamer:
    def __init__(
        self,
        call_timeout_s: float = 10.0,
        overload_retry_s: float = 5.0,
        known_metadata: Callable[[str, str], bytes | None] | None = None,
        stream_min_chunks: int | None = None,
        on_handoff: Callable[[HandoffTiming], None] | None = None,
        feeds: TokenFeeds | None = None,
        prefill_links: PrefillLinks | None = None,
    ):
        """known_metadata(prefill id, incarnation): transfer metadata already fetched for that incarnation (the
        dispatcher's cache), else None and it is asked for. stream_min_chunks: stream the hand-off of prompts
        spanning at least this many prefill steps (None: DSV4_KV_STREAM_MIN_CHUNKS; 0: never). on_handoff: called
        with each disaggregated placement's HandoffTiming (benchmarks). feeds: read the decode workers' tokens from
        their token feeds (service.token_feed) instead of one stream a request. prefill_links: call `prefill` over the
        prefill workers' links where one is up (service.prefill_link) instead of through Ray."""
        self.feeds = feeds
        self.prefill_links = prefill_links
        self.call_timeout_s = call_timeout_s
        self.overload_retry_s = overload_retry_s
        self.known_metadata = known_metadata
        self.stream_min_chunks = settings().kv_stream_min_chunks if stream_min_chunks is None else stream_min_chunks
        self.on_handoff = on_handoff
        self._chunk_tokens: dict[str, int | None] = {}  # prefill worker id -> its stream_chunk_tokens (None: none)

    async def still_holds(self, handle, incarnation: str) -> bool:
        """Is the worker that prefilled (this incarnation of it, not a restarted one) still alive?"""
        try:
            return await asyncio.wait_for(handle.ping.remote(), self.call_timeout_s) == incarnation
        except (TimeoutError, *DEAD, RayTaskError):
            return False

    async def introduce_pair(self, w: Workers, incarnation: str) -> None:
        md = self.known_metadata(w.prefill_id, incarnation) if self.known_metadata is not None else None
        if md is None:
            md = await w.prefill.transfer_metadata.remote()  # type: ignore[attr-defined]
        await w.decode.add_peer.remote(w.prefill_id, md)  # type: ignore[attr-defined]

    async def _generate_local(self, rid: str, prompt: list[int], params, w: Workers, reached: Callable[[], None]):
        """Prefill and decode on one decode worker (router reason "local_prefill")."""
        finished = False
        reached()  # the call below puts the request on the decode worker at once
        try:
            gen: object = w.decode.generate_local  # type: ignore[attr-defined]
            stream = gen.options(num_returns="streaming").remote(rid, prompt, params, params.seed, batch=True)  # type: ignore[attr-defined]
            async for item in stream_items(stream, w.decode_id):
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                abort(w.decode, rid)

    async def _open_decode(self, result, prompt, params, w: Workers, queue: FeedQueue | None = None):
        """Start the decode (its events to `queue`'s token feed, if given); -> (the decode stream, or None when
        opened over the feed's connection; its first item: Transferred). Over the feed's connection when it can
        (service.tcp_feed: an OPEN frame, no Ray call; its failures are the same exceptions), else the `decode` Ray
        call. Retries a race with a restart (PeerUnknown, once) and a full worker (DecodeOverloaded, for
        overload_retry_s); a worker without the feed (it restarted since the feed opened) is that worker's death."""
        deadline, delay, introduced = time.monotonic() + self.overload_retry_s, 0.05, False
        decode_call: object = w.decode.decode  # type: ignore[attr-defined]
        routed = {"feed": queue.feed_id} if queue is not None else {}
        while True:
            stream = None
            try:
                if queue is not None and queue.feed.can_open():
                    item = await queue.feed.open_decode(result, prompt, params)
                else:
                    stream = decode_call.options(num_returns="streaming").remote(  # type: ignore[attr-defined]
                        result, prompt, params, batch=True, **routed
                    )
                    try:
                        item = await next_item(stream)
                    except RayTaskError as e:
                        raise failure(e, w.decode_id) from None
                if item is END:
                    raise WorkerDied(w.decode_id, "its decode stream ended before the transfer")
            except DEAD as e:
                raise WorkerDied(w.decode_id, str(e)) from None
            except FeedUnknown as e:
                if self.feeds is not None:  # the retry must not reuse it
                    self.feeds.lost(w.decode_id, e.feed_id)
                raise WorkerDied(w.decode_id, str(e)) from None
            except PeerUnknown:
                if introduced:  # the metadata it got is not of the process that prefilled: that one is gone
                    if not await self.still_holds(w.prefill, result.incarnation):
                        raise WorkerDied(w.prefill_id, "it restarted after prefilling the request") from None
                    raise WorkerDied(
                        w.decode_id, "still lacks the prefill worker's metadata after an introduction"
                    ) from None
                introduced = True
                try:
                    await asyncio.wait_for(self.introduce_pair(w, result.incarnation), self.call_timeout_s)
                except (TimeoutError, *DEAD, RayTaskError) as e:
                    if not await self.still_holds(w.prefill, result.incarnation):
                        raise WorkerDied(w.prefill_id, f"introducing it to {w.decode_id}: {cause(e)}") from None
                    raise WorkerDied(w.decode_id, f"introducing {w.prefill_id}: {cause(e)}") from None
                continue
            except DecodeOverloaded as e:
                if time.monotonic() + delay > deadline:
                    raise Overloaded(str(e)) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            except TransferError as e:
                # A pull fails when its source dies mid-transfer: report that as the prefill worker's death
                # (nothing was streamed yet, so the owner retries elsewhere); else fail as is.
                if not await self.still_holds(w.prefill, result.incarnation):
                    raise WorkerDied(w.prefill_id, f"KV transfer failed: {e}") from None
                raise
            return stream, item

    # ---- the streamed hand-off -----------------------------------------------------------------------
    async def streams(self, w: Workers, prompt_len: int) -> bool:
        """Stream this prompt's hand-off? It spans at least stream_min_chunks of the prefill worker's steps."""
        if self.stream_min_chunks <= 0 or w.local:
            return False
        chunk = await self._chunk_tokens_of(w)
        return chunk is not None and prompt_len > (self.stream_min_chunks - 1) * chunk

    async def _chunk_tokens_of(self, w: Workers) -> int | None:
        """The prefill worker's `stream_chunk_tokens`, asked once per worker id (its options do not change across
        restarts); None when it has no such method (a synthetic worker). A call that fails is not remembered: the
        request goes unstreamed, whose own calls report a dead worker."""
        if w.prefill_id in self._chunk_tokens:
            return self._chunk_tokens[w.prefill_id]
        try:
            method = w.prefill.stream_chunk_tokens  # type: ignore[attr-defined]
        except AttributeError:
            tokens = None
        else:
            try:
                tokens = await asyncio.wait_for(method.remote(), self.call_timeout_s)
            except (TimeoutError, *DEAD, RayTaskError):
                return None
        self._chunk_tokens[w.prefill_id] = tokens
        return tokens

    async def _reserve_streamed(self, rid: str, prompt: list[int], params, w: Workers) -> None:
        """Pages and a slot on the decode worker before the prefill starts; DecodeOverloaded retried with backoff
        for overload_retry_s, then Overloaded (nothing was prefilled yet)."""
        deadline, delay = time.monotonic() + self.overload_retry_s, 0.05
        while True:
            try:
                await w.decode.reserve_streamed.remote(rid, prompt, params)  # type: ignore[attr-defined]
                return
            except DEAD as e:
                raise WorkerDied(w.decode_id, str(e)) from None
            except RayTaskError as e:
                error = failure(e, w.decode_id)
            if not isinstance(error, DecodeOverloaded):
                raise error from None
            if time.monotonic() + delay > deadline:
                raise Overloaded(str(error)) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _prefill_streamed(
        self, rid: str, prompt: list[int], params, w: Workers
    ) -> tuple[PrefillResult, int, float]:
        """Run `prefill_streamed`, pulling each chunk ticket into the decode reservation as it arrives, in order,
        while the prefill goes on -> (PrefillResult, chunks pulled, its monotonic arrival here)."""
        link = self._link(w)
        if link is not None and link.streams:  # STREAM frames on the worker's link (service.prefill_link)
            over_link = link.stream(rid, prompt, params, params.seed)
            feed = PrefillFeed(over_link.cancel, over_link.items(), w.prefill_id)
        else:
            call: object = w.prefill.prefill_streamed  # type: ignore[attr-defined]
            stream = call.options(num_returns="streaming").remote(rid, prompt, params, params.seed)  # type: ignore[attr-defined]
            feed = PrefillFeed(functools.partial(ray.cancel, stream), stream_items(stream, w.prefill_id), w.prefill_id)
        done, chunks = False, 0
        try:
            while True:
                item, arrived = await feed.next()
                if isinstance(item, PrefillResult):
                    done = True
                    return item, chunks, arrived
                await self._pull_chunk(rid, item, w, feed)
                chunks += 1
        finally:
            if not done:
                feed.close(rid)

    async def _pull_chunk(self, rid: str, ticket: TransferTicket, w: Workers, feed: PrefillFeed) -> None:
        """One chunk into the decode reservation (PeerUnknown: the pair is introduced and the pull retried once).
        The prefill worker's death during the pull, or behind a failed pull (its stream ends in it within
        call_timeout_s), is that death: the pull from a dead source is not waited for."""
        introduced = False
        while True:
            pull = asyncio.ensure_future(w.decode.pull_chunk.remote(rid, ticket))  # type: ignore[attr-defined]
            try:
                await asyncio.wait({pull, feed.died}, return_when=asyncio.FIRST_COMPLETED)
                if not pull.done():  # the prefill worker died mid-pull: the pull fails on its own, and the decode
                    # worker frees the reservation after it (the abort that follows waits for the pull's end)
                    raise feed.died.result()
            finally:
                if not pull.done():
                    pull.cancel()
            try:
                pull.result()
                return
            except DEAD as e:
                raise WorkerDied(w.decode_id, str(e)) from None
            except RayTaskError as e:
                error = failure(e, w.decode_id)
            if isinstance(error, PeerUnknown) and not introduced:
                introduced = True
                await self._introduce_for_stream(w)
                continue
            if isinstance(error, TransferError):
                ends: set[asyncio.Future] = {feed.ended, feed.died}
                await asyncio.wait(ends, timeout=self.call_timeout_s, return_when=asyncio.FIRST_COMPLETED)
                if feed.died.done() and not feed.died.cancelled():
                    raise WorkerDied(w.prefill_id, f"KV transfer failed: {error}") from None
            raise error from None

    async def _introduce_for_stream(self, w: Workers) -> None:
        try:
            await asyncio.wait_for(self.introduce_pair(w, ""), self.call_timeout_s)
        except (TimeoutError, *DEAD, RayTaskError) as e:
            raise WorkerDied(w.decode_id, f"introducing {w.prefill_id}: {cause(e)}") from None

    def _record_handoff(self, timing: HandoffTiming) -> None:
        metrics.KV_HANDOFF_EXPOSED.labels("true" if timing.streamed else "false").observe(timing.exposed_s)
        if self.on_handoff is not None:
            self.on_handoff(timing)

    # ---- one placement ----------------------------------------------------------------------------------
    def _link(self, w: Workers) -> PrefillLink | None:
        """The prefill worker's link if one is up (service.prefill_link), else None: the Ray call."""
        links = self.prefill_links
        return links.ready(w.prefill_id, w.prefill) if links is not None else None

    async def _prefill(self, rid: str, prompt: list[int], params, w: Workers, streamed: bool, tell):
        """Hop 7 -> (PrefillResult, chunks pulled, prefill seconds, the result's monotonic arrival)."""
        if streamed:
            await self._reserve_streamed(rid, prompt, params, w)
            tell()  # the decode worker holds the request (and reports it) from its reservation on
            start = time.monotonic()
            result, chunks, arrived = await self._prefill_streamed(rid, prompt, params, w)
            return result, chunks, arrived - start, arrived
        start = time.monotonic()
        link = self._link(w)
        try:
            if link is not None:  # no Ray call: a frame on the worker's link, the same errors (service.prefill_link)
                result = await link.prefill(rid, prompt, params, params.seed)
            else:
                result = await w.prefill.prefill.remote(rid, prompt, params, params.seed)  # type: ignore[attr-defined]
        except DEAD as e:
            raise WorkerDied(w.prefill_id, str(e)) from None
        except RayTaskError as e:
            raise failure(e, w.prefill_id) from None
        arrived = time.monotonic()
        return result, 0, arrived - start, arrived

    async def run_placement(
        self, request: DispatchRequest, w: Workers, reached: Callable[[], None] | None = None, lane=None
    ) -> AsyncGenerator[TokenEvent, None]:
        """The request's TokenEvents on these two workers (module docstring). `reached()` is called once, when the
        decode worker holds the request (its reports count it from then on) or the request ended before that.
        lane: the request's service.token_lane.TokenLane, given the feed's queue once the first token is taken."""
        rid, prompt, params = request.request_id, list(request.prompt_ids), request.params
        told = False

        def tell() -> None:
            nonlocal told
            if not told and reached is not None:
                told = True
                reached()

        if w.local:
            try:
                async for ev in self._generate_local(rid, prompt, params, w, tell):
                    yield ev
            finally:
                tell()
            return
        finished = False
        queue: FeedQueue | None = None
        try:
            if self.feeds is not None:  # opens the worker's feed, if it must, while the prefill runs
                queue = await self.feeds.subscribe(w.decode_id, w.decode, rid)
            streamed = await self.streams(w, len(prompt))
            result, chunks, prefill_s, arrived = await self._prefill(rid, prompt, params, w, streamed, tell)
            first = TokenEvent(
                rid,
                result.first_token,
                result.first_logprob,
                result.finished,
                result.finish_reason,
                tuple(result.prompt_logprobs[1:]) if params.prompt_logprobs else (),
                result.cached_tokens,
            )
            if result.finished:
                finished = True
                if streamed:
                    abort(w.decode, rid)  # its reservation: nothing to decode (the prefill released its chunks)
                yield first
                return
            # `stream` stays referenced until the request ends (with a feed it carries only Transferred: dropping
            # it earlier would delete the call's stream while the worker still joins the request); None when the
            # decode was opened over the feed's connection
            stream, item = await self._open_decode(result, prompt, params, w, queue)
            assert isinstance(item, Transferred), item
            self._record_handoff(HandoffTiming(rid, streamed, chunks, prefill_s, time.monotonic() - arrived))
            tell()
            yield first  # released only now: TTFT includes the transfer
            if queue is not None and lane is not None:  # the first token passed every layer: plain ones may bypass
                queue.lane = lane
            if queue is None:
                assert stream is not None
                async for ev in stream_items(stream, w.decode_id):
                    finished = ev.finished
                    yield ev
                    if finished:
                        return
                return
            while True:
                for ev in await queue.get():
                    finished = ev.finished
                    yield ev
                    if finished:
                        return
        except DEAD as e:
            raise WorkerDied(w.decode_id, str(e)) from None
        finally:
            if queue is not None:
                queue.close()
            tell()
            if not finished:
                # Client went away or something failed: free pages on both sides, never leak.
                abort(w.prefill, rid)
                abort(w.decode, rid)


def abort(handle, rid: str) -> None:
    """Fire-and-forget abort (the worker may be dead: nothing to wait for)."""
    try:
        handle.abort.remote(rid)
    except DEAD:
        pass
