"""The service's token path from the ingress replica's side: the router places, this replica runs the request on the
workers and reads the decode worker's stream itself (no router, no other process, between them and the client).

`DirectClient` is what an ingress replica's `OpenAIServer` talks to instead of the router's `Generate` stream (the
same interface as `router.client.AsyncRouterClient`: `generate` yields `StreamEvent`s, every failure is a
`RouterError` with its gRPC code, `health`). Per request:
1. `Place` on one of the router replicas (`RouterSet`: in turn; one that cannot be reached is skipped and the call
   goes to the next). The router admits (queues for a decode slot, or says 429 / 503) and names the workers. A
   replica sees the others' placements only through the workers' reports (a probe late), so two may place on one
   last slot: the decode worker refuses the second and that request goes back to a router's queue. The request
   carries the prompt's block hashes (`router.prompt_hashes.IngressHasher`, in the scheme the routers' last answer
   named), so the router's decision only matches and scores; the hashing is spread over the ingress replicas. The
   call is a frame on the router's place link once that is up (service.place_link: a TCP connection the router
   opened to this replica's listener, with DSV4_PLACE_LINK), else gRPC; a lost link fails over as a lost channel;
2. `service.ray_stream.RayStreamer.run_placement` on the actor handles of those workers (`WorkerDirectory`):
   prefill, the KV pull (a long prompt's chunk by chunk while it is prefilled), then the decode actor's Ray stream
   (tokens batched per message) straight into this replica's SSE response; with DSV4_TOKEN_FEED (the default) the
   tokens come over the decode worker's token feed instead: one feed per (worker, replica) carrying every request's
   tokens of an engine step in one frame or item (service.token_feed: a TCP connection the worker opens to this
   replica, or a Ray stream);
3. `router.migration.recovering_stream` around both: a worker death retries or migrates the request exactly as the
   router does on its own `Generate` (budget, no lost or repeated token, prompt + streamed tokens as the new prefix).
Cancellation: closing the stream (client gone, stop string, deadline) closes the Ray streams, and the streamer's
`finally` aborts the request on both workers (their pages are freed). A worker that is alive but stuck releases its
streams here too: while streams are open, a watcher asks a router's Health every `watch_interval_s` and each worker
it reports down fails the streams waiting on it as `WorkerDied` (router.stream_watch), which recover as above.

Killing a router loses no stream (none passes through it) and no queued request (its Place fails over to another
router); a killed router is restarted by Ray on a new port, which `RouterSet` asks of its actor again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from dsv4_kernels.settings import settings
from engine.execution.request import TokenEvent
from engine.execution.sampling_params import SamplingParams
from router.client import AsyncRouterClient, HealthReport, PlacedRequest, RouterError, StreamEvent, place_request
from router.dispatch import DispatchRequest, Overloaded, WorkerDied
from router.migration import RouterFailure, StreamProgress, failure_of, recovering_stream
from router.prompt_hashes import IngressHasher, PromptHashes
from router.stream_watch import StreamWatch, StreamWatches
from service.place_link import PlaceLinks
from service.prefill_link import PrefillLinks
from service.ray_stream import RayStreamer, Workers
from service.token_feed import TokenFeeds
from service.token_lane import TokenLane

log = logging.getLogger(__name__)
T = TypeVar("T")
_STATUS = {sc.value[0]: sc for sc in grpc.StatusCode}
# The router's own UNAVAILABLE answers: the request waited its turn there; another router would not do better.
_ROUTER_VERDICTS = ("no decode capacity", "no healthy worker")
_SHUTTING_DOWN = "shutting down"  # a draining router: try the others, but do not wait for them
ACTOR_CALL_TIMEOUT_S = 5.0
FAILOVER_WAIT_S = 10.0  # no router answers: keep trying this long (Ray restarts a killed one in seconds)
ROUND_PAUSE_S = 0.25
OPEN_RETRY_S = 1.0  # a full decode worker at open: retried this long, then the request goes back to a queue
OVERLOAD_REQUEUE_S = 30.0  # ... for at most this long in all, then RESOURCE_EXHAUSTED
REQUEUE_PAUSE_S = 0.2
DROP_GRACE_S = 30.0  # a dropped router's channel closes after its calls in flight end, or after this long
SETTLE_WAIT_S = 0.05  # a settle waits this long for a Place to the same router to carry it, then is sent alone


def unreachable(e: RouterError) -> bool:
    """Did the call fail because the router replica is gone or stopping (not because of its answer)?"""
    if e.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return True
    return e.code == grpc.StatusCode.UNAVAILABLE and not e.message.startswith(_ROUTER_VERDICTS)


class RouterSet:
    """The router replicas (Ray actor handles of service.router_actor.RouterActor) an ingress places through."""

    def __init__(
        self,
        actors: Sequence,
        token: str | None,
        timeout_s: float,
        cooldown_s: float = 5.0,
        failover_wait_s: float = FAILOVER_WAIT_S,
        links: PlaceLinks | None = None,
    ):
        """cooldown_s: how long an unreachable router is tried last; failover_wait_s: how long a call keeps trying
        when no router answers (Ray restarting the only one); links: Place over each router's place link once it is
        up (service.place_link), else over gRPC."""
        if not actors:
            raise ValueError("RouterSet needs at least one router actor")
        self.actors, self.token, self.timeout_s, self.cooldown_s = list(actors), token, timeout_s, cooldown_s
        self.failover_wait_s = failover_wait_s
        self.links = links
        self._clients: dict[int, AsyncRouterClient] = {}
        self._cooling: dict[int, float] = {}  # router index -> monotonic time until which it is skipped
        self._closing: set[asyncio.Task] = set()  # channels of dropped clients, closing with a grace
        self._unsettled: dict[int, list[str]] = {}  # router index -> placements settled, not yet told (`settle`)
        self._settle_timers: dict[int, asyncio.TimerHandle] = {}
        self._settling: set[asyncio.Task] = set()  # Settle calls in flight (kept referenced until done)
        self._next = 0

    async def _client(self, i: int) -> AsyncRouterClient:
        client = self._clients.get(i)
        if client is None:
            # A (re)started router listens where its actor says (it starts serving on this call after a restart).
            addr = await asyncio.wait_for(self.actors[i].address.remote(), ACTOR_CALL_TIMEOUT_S)
            client = self._clients[i] = AsyncRouterClient(addr, timeout_s=self.timeout_s, token=self.token)
        return client

    def _drop(self, i: int, why: object, client: AsyncRouterClient | None) -> None:
        """Router i failed a call made on `client`: try it last for cooldown_s and reconnect to it next time. Only
        that client is closed (a newer one, made since by a concurrent request, may already reach the restarted
        router), and with a grace: calls of other requests still in flight on it end on their own first."""
        log.warning("router replica %d unreachable (%s); using the others for %.0f s", i, why, self.cooldown_s)
        self._cooling[i] = time.monotonic() + self.cooldown_s
        if client is None or self._clients.get(i) is not client:
            return
        del self._clients[i]
        task = asyncio.get_running_loop().create_task(client.close(grace_s=min(self.timeout_s, DROP_GRACE_S)))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _order(self) -> list[int]:
        """Router indices to try: in turn from the next one, those cooling down last."""
        n, now = len(self.actors), time.monotonic()
        start, self._next = self._next, (self._next + 1) % n
        order = [(start + k) % n for k in range(n)]
        return [i for i in order if self._cooling.get(i, 0) <= now] + [
            i for i in order if self._cooling.get(i, 0) > now
        ]

    async def call(self, fn: Callable[[AsyncRouterClient], Awaitable[T]]) -> T:
        return (await self.call_indexed(fn))[1]

    async def call_indexed(self, fn: Callable[[AsyncRouterClient], Awaitable[T]]) -> tuple[int, T]:
        """fn on one router; on the next when that one is unreachable, in rounds for up to failover_wait_s;
        -> (the router's index, fn's result). RouterError UNAVAILABLE when none answers."""
        return await self._call_each(lambda i, client: fn(client))

    async def place(
        self, dreq: DispatchRequest, excluded: dict[str, str], hashes: PromptHashes | None
    ) -> tuple[int, PlacedRequest]:
        """Place on one router (as call_indexed), carrying that router's settles due since (`settle`)."""

        async def on(i: int, client: AsyncRouterClient) -> PlacedRequest:
            settled = self._unsettled.pop(i, [])
            try:
                link = self.links.ready(i, self.actors[i]) if self.links is not None else None
                if link is not None:
                    msg = place_request(
                        dreq.prompt_ids, dreq.params, dreq.request_id, excluded, bool(excluded), hashes, settled
                    )
                    return await link.place(msg, self.timeout_s)
                return await client.place(
                    dreq.prompt_ids,
                    dreq.params,
                    dreq.request_id,
                    dict(excluded),
                    retry=bool(excluded),
                    hashes=hashes,
                    settled=settled,
                )
            except BaseException:
                for rid in settled:  # not known to have arrived: due again (settling twice is harmless)
                    self.settle(i, rid)
                raise

        return await self._call_each(on)

    async def _call_each(self, fn: Callable[[int, AsyncRouterClient], Awaitable[T]]) -> tuple[int, T]:
        deadline = time.monotonic() + self.failover_wait_s
        while True:
            stopping: RouterError | None = None  # a router said the service is shutting down
            for i in self._order():
                client = None
                try:
                    client = await self._client(i)
                    result = await fn(i, client)
                except RouterError as e:
                    if not unreachable(e):
                        raise
                    if _SHUTTING_DOWN in e.message:
                        stopping = e
                        continue
                    self._drop(i, e, client)
                except Exception as e:  # noqa: BLE001 - its actor is dead or restarting (Ray errors, timeout)
                    self._drop(i, e, client)
                else:
                    self._cooling.pop(i, None)
                    return i, result
            if stopping is not None:  # no waiting for a service that is going away
                raise stopping
            if time.monotonic() >= deadline:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no router replica is reachable; retry later")
            await asyncio.sleep(ROUND_PAUSE_S)

    def settle(self, i: int, request_id: str) -> None:
        """Router i's placement reached the decode worker (or failed before it). Carried on the next Place to router
        i, or sent in one Settle call with the others due within SETTLE_WAIT_S: a Settle call a request would cost
        the replica and the router as much CPU as the Place itself. Best effort: a router that is gone forgot the
        placement anyway, and one that never hears of it releases it after its hold's limit."""
        self._unsettled.setdefault(i, []).append(request_id)
        if i not in self._settle_timers:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a stream finalised outside its loop (shutdown): the next Place or close carries it
                return
            self._settle_timers[i] = loop.call_later(SETTLE_WAIT_S, self._flush_soon, i)

    def _flush_soon(self, i: int) -> None:
        del self._settle_timers[i]
        task = asyncio.get_running_loop().create_task(self._flush(i))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _flush(self, i: int) -> None:
        """Send router i's settles that no Place has carried."""
        ids = self._unsettled.pop(i, [])
        if not ids:
            return
        try:
            link = self.links.up(i) if self.links is not None else None
            if link is not None:
                return link.settle(ids)
            client = await self._client(i)
            await asyncio.wait_for(client.settle_many(ids), ACTOR_CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - best effort (router.placement_holds' limit releases them)
            log.info("settling %d placements on router replica %d: %s", len(ids), i, e)

    async def close(self) -> None:
        for timer in self._settle_timers.values():
            timer.cancel()
        self._settle_timers.clear()
        await asyncio.gather(*(self._flush(i) for i in list(self._unsettled)), *self._settling)
        if self.links is not None:
            await self.links.close()
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


class WorkerDirectory:
    """Worker id -> Ray actor handle, as the routers know them (a group restart replaces a worker's handle)."""

    def __init__(self, routers: RouterSet):
        self.routers = routers
        self._handles: dict[str, object] = {}
        self._stale = True
        self._lock = asyncio.Lock()

    def mark_stale(self) -> None:
        """A worker died: ask for the handles again before the next placement uses them."""
        self._stale = True

    async def _refresh(self) -> None:
        async with self._lock:
            if not self._stale:
                return
            for actor in self.routers.actors:
                try:
                    self._handles = await asyncio.wait_for(actor.worker_handles.remote(), ACTOR_CALL_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001 - that router is down: ask another
                    log.warning("worker handles: a router actor did not answer (%s)", type(e).__name__)
                    continue
                self._stale = False
                return
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no router replica is reachable; retry later")

    async def workers(self, placed: PlacedRequest) -> Workers:
        ids = (placed.prefill_worker, placed.decode_worker)
        if self._stale or any(w not in self._handles for w in ids):
            self._stale = True
            await self._refresh()
        missing = [w for w in ids if w not in self._handles]
        if missing:  # it left its (elastic) pool since the placement: placed again, like after a death
            raise WorkerDied(missing[0], "it left its pool")
        return Workers(ids[0], self._handles[ids[0]], ids[1], self._handles[ids[1]])


class DirectClient:
    """An ingress replica's client of the service (module docstring); create it inside the loop that uses it."""

    takes_lane = True  # `generate` takes a service.token_lane.TokenLane

    def __init__(
        self,
        routers: Sequence,
        token: str | None,
        timeout_s: float,
        *,
        max_migrations: int = 2,
        watch_interval_s: float = 1.0,
        token_feed: bool | None = None,
        feed_host: str | None = None,
    ):
        """token_feed: read the tokens from the decode workers' feeds (None: DSV4_TOKEN_FEED). feed_host: where a
        TCP feed's listener binds (None: the service's internal host; service.tcp_feed)."""
        token_feed = settings().token_feed if token_feed is None else token_feed
        # Each decode worker's tokens for this replica's requests over one feed (service.token_feed): a TCP connection
        # the worker opens to this replica, or a Ray stream (DSV4_TOKEN_FEED_TRANSPORT); the workers present `token`
        self.feeds = TokenFeeds(token=token, host=feed_host) if token_feed else None
        # the prefill calls over connections the prefill workers open to the same listener (service.prefill_link)
        listener = self.feeds.listener if self.feeds is not None else None
        self.prefill_links = PrefillLinks(listener) if listener is not None and settings().prefill_feed else None
        # ... and the Place calls over connections the routers open to it (service.place_link)
        links = PlaceLinks(listener) if listener is not None and settings().place_link else None
        self.routers = RouterSet(routers, token, timeout_s, links=links)
        self.directory = WorkerDirectory(self.routers)
        self.streamer = RayStreamer(overload_retry_s=OPEN_RETRY_S, feeds=self.feeds, prefill_links=self.prefill_links)
        self.hasher = IngressHasher()  # names prompt blocks for the routers (none until one has said how)
        self.max_migrations = max_migrations
        self.watch_interval_s = watch_interval_s
        self.watches = StreamWatches()
        self._watcher: asyncio.Task | None = None

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str = "",
        lane: TokenLane | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """lane: the request's TokenLane (service.token_lane), for its plain tokens to bypass these layers."""
        params = params or SamplingParams()
        dreq = DispatchRequest(request_id, tuple(prompt_ids), params)
        placed: dict[str, PlacedRequest] = {}  # request id of each placement -> where it ran
        self._watch_soon()
        progress = StreamProgress()
        if lane is not None:  # what recovering_stream does for a plain token; the loop below passes it on as is
            lane.streamed = progress.generated
        events = recovering_stream(
            dreq,
            lambda req, excluded: self._attempt(req, excluded, placed, lane),
            incarnation_of=lambda wid: _incarnation(placed, wid),
            role_of=lambda wid: "decode" if any(p.decode_worker == wid for p in placed.values()) else "prefill",
            max_migrations=self.max_migrations,
            progress=progress,
            on_death=lambda wid: self.directory.mark_stale(),
        )
        first, shown = True, set()
        try:
            async with contextlib.aclosing(events):
                async for ev in events:
                    where = placed.get(ev.request_id) if ev.request_id not in shown else None
                    shown.add(ev.request_id)
                    yield _event(ev, where, params, lead_none=first and params.prompt_logprobs)
                    first = False
        except RouterFailure as f:
            raise RouterError(_STATUS[f.code], f.message) from None

    async def _attempt(
        self,
        dreq: DispatchRequest,
        excluded: dict[str, str],
        placed: dict[str, PlacedRequest],
        lane: TokenLane | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """One placement of the request (router.migration's attempt): place on a router, then run it on the named
        workers. A decode worker found full when the stream opens sends the request back to a router's queue: another
        router placed on its last slot before this router's reports showed it (each replica sees the others'
        placements only through the workers' reports, up to a probe late), and the queue, not a 429, is where the
        request should wait. For up to OVERLOAD_REQUEUE_S, then RESOURCE_EXHAUSTED. The events are read here, not
        through a generator of the placement's own: every layer a token passes is a hop on the replica's loop."""
        deadline, pause = time.monotonic() + OVERLOAD_REQUEUE_S, REQUEUE_PAUSE_S
        while True:
            try:
                events, watch, prefill = await self._placement(dreq, excluded, placed, lane)
                if lane is not None:
                    lane.watch = watch
                try:
                    async with contextlib.aclosing(events):
                        while (ev := await watch.next(events)) is not StreamWatches.END:
                            if prefill is not None and (ev.token_id is not None or ev.finished):
                                watch.release(prefill)  # prefill is over
                                prefill = None
                            yield ev
                            if ev.finished:
                                return
                except Exception as e:
                    failure = None if isinstance(e, Overloaded) else failure_of(e, dreq.request_id)
                    if failure is None:
                        raise
                    raise failure from None
                finally:
                    watch.close()
                return
            except Overloaded as e:  # raised before the first event: nothing was streamed
                failure = failure_of(e, dreq.request_id)
                if time.monotonic() + pause > deadline and failure is not None:
                    raise failure from None
                log.info("request %s: decode worker full at open (%s); back to a router's queue", dreq.request_id, e)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)

    async def _placement(
        self,
        dreq: DispatchRequest,
        excluded: dict[str, str],
        placed: dict[str, PlacedRequest],
        lane: TokenLane | None = None,
    ) -> tuple[AsyncGenerator[TokenEvent, None], StreamWatch, str | None]:
        """Place on a router and start the request on the named workers -> (its events, the watch on its workers,
        the prefill worker it depends on until its first token: None for a local prefill); the events raise
        Overloaded as is."""
        router, where = await self.routers.place(dreq, excluded, self.hasher.hashes(dreq.prompt_ids))
        self.hasher.learn(where.hash_scheme)
        placed[dreq.request_id] = where

        def reached() -> None:  # the decode worker holds it: the router may count it by that worker's reports
            self.routers.settle(router, dreq.request_id)

        try:
            workers = await self.directory.workers(where)
        except BaseException:
            reached()  # it never reaches a worker: the router need not hold it
            raise
        p_id, d_id = workers.prefill_id, workers.decode_id
        watch = self.watches.watch(
            p_id, d_id, incarnations={p_id: where.prefill_incarnation, d_id: where.decode_incarnation}
        )
        events = self.streamer.run_placement(dreq, workers, reached, lane)
        return events, watch, p_id if p_id != d_id else None

    # ---- workers found down by the routers' health probes -------------------------------------------
    def _watch_soon(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_health())

    async def _watch_health(self) -> None:
        """While streams are open: fail the streams of each worker a router reports down (they then recover)."""
        while True:
            await asyncio.sleep(self.watch_interval_s)
            if not len(self.watches):
                return
            try:
                rep = await asyncio.wait_for(self.health(), 5.0)
            except (TimeoutError, RouterError):
                continue
            for w in rep.workers:
                if not w.healthy and (moved := self.watches.worker_down(w.worker_id, w.incarnation)):
                    log.warning(
                        "worker %s is down: %d streams waiting on it are retried or migrated", w.worker_id, moved
                    )
                    self.directory.mark_stale()

    async def health(self, probe: bool = False) -> HealthReport:
        return await self.routers.call(lambda c: c.health(probe))

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.prefill_links is not None:
            await self.prefill_links.close()
        if self.feeds is not None:  # after the links: it closes the listener they share
            await self.feeds.close()
        await self.routers.close()


def _incarnation(placed: dict[str, PlacedRequest], worker_id: str) -> str:
    """The incarnation of worker_id that the request's last placement on it named ("" if none did)."""
    for p in reversed(placed.values()):
        if worker_id in (p.prefill_worker, p.decode_worker):
            return p.incarnation(worker_id)
    return ""


def _event(ev: TokenEvent, where: PlacedRequest | None, params: SamplingParams, lead_none: bool) -> StreamEvent:
    """A TokenEvent as the router client would have delivered it: prompt logprobs with the first prompt token's None,
    the workers and cached tokens on a placement's first event."""
    plps: tuple = ()  # a decode token's event has none: no tuples built a token
    if lead_none or ev.prompt_logprobs:
        plps = ((None,) if lead_none else ()) + tuple(
            None if x is not None and math.isnan(x) else x for x in ev.prompt_logprobs
        )
    return StreamEvent(
        ev.request_id,
        ev.token_id,
        ev.logprob if params.logprobs and ev.token_id is not None else None,
        ev.finished,
        ev.finish_reason,
        plps,
        where.prefill_worker if where else "",
        where.decode_worker if where else "",
        ev.cached_tokens if where else 0,
    )
