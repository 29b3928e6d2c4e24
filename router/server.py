"""The router's gRPC service (grpc.aio): Place and Settle (unary), Generate (server streaming), Health, Stats.

`RouterServer(dispatcher, policy)` places each request with `router.policy.RoutingPolicy`.
- `Place` (the service's path: several router replicas, none on the token path; over gRPC, or as a frame on an
  ingress replica's place link, router.place_link, which runs the same `place`): admission and placement only. The
  caller (an HTTP ingress replica, service.direct_path) runs the request on the workers named and owns its stream,
  retries and migrations (router.migration). A placement counts as this router's in flight until the workers'
  reports show it (router.placement_holds: the caller's `Settle` says the request reached its decode worker, the
  next probe's report counts it); admission also counts what the decode workers report holding
  (PolicyConfig.reported_load), so routers that never see a stream end still admit by real capacity, and any
  replica can place any request.
  A `retry` placement (a worker died serving the request) marks that incarnation of the worker down here at once.
- `Generate` (in-process engines, plain gRPC clients): placement plus the stream itself through the dispatcher,
  with the same retry and migration rules (router.migration.recovering_stream, whose docstring has them).

Failure handling (Generate ends the stream with one message carrying `error`, then the gRPC status of the same
code, so streaming clients get a typed reason and plain gRPC clients a status; Place ends the call with the status):
- a bad request (empty prompt, bad sampling field, or the engine's `ValueError`: token out of
  vocabulary, too long) -> INVALID_ARGUMENT with the engine's message; nothing was placed or it ran
  nowhere, and the server keeps serving;
- more than `max_inflight` requests in the router -> RESOURCE_EXHAUSTED; so is `Overloaded`;
- admission: when no decode worker has a free slot and pages for the request (`RoutingPolicy.can_admit`),
  it waits in a FIFO queue of at most `max_queued` requests for up to `queue_timeout_s`; a full queue ->
  RESOURCE_EXHAUSTED, a wait that times out -> UNAVAILABLE (both say "retry later");
- no healthy worker for a phase (a one-worker pool whose worker Ray is restarting) -> the request waits up
  to `restart_wait_s` for one to come back, then UNAVAILABLE;
- a worker dies serving it -> retried or migrated (router.migration); anything else -> INTERNAL (logged with its
  traceback).
Messages carry no internals (remote tracebacks, pids, addresses): those go to the log under the request id.
With `auth_token` set, every call must carry it in the `x-dsv4-token` metadata (else UNAUTHENTICATED).

A background task probes `dispatcher.health_check()` every `health_interval_s` (bounded by
`health_timeout_s`) and feeds the verdicts to the policy: a dead worker stops receiving requests and a
restarted one is added back. A worker found down (dead, not answering, or reporting an unhealthy engine: a dead
loop or a stalled step) also releases every Generate stream waiting on it (`router.stream_watch`): each fails as
`WorkerDied` and is retried or migrated as above, so a stopped or hung worker's streams complete elsewhere (the
ingress replicas learn the same from `Health` for the streams they own).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from engine.execution.request import TokenEvent
from engine.execution.sampling_params import SamplingParams
from router.auth import TokenInterceptor
from router.dispatch import (
    DECODE_ROLES,
    PREFILL_ROLES,
    Dispatcher,
    DispatchRequest,
    NoWorkerAvailable,
)
from router.metrics import RouterMetrics
from router.migration import RouterFailure, StreamProgress, failure_of, recovering_stream
from router.placement_holds import DEFAULT_MAX_HOLD_S, PlacementHolds
from router.policy import Placement, RoutingPolicy
from router.prompt_hashes import HashScheme, PromptHashes
from router.protos import pb2, pb2_grpc
from router.stream_watch import StreamWatches

log = logging.getLogger(__name__)

Code = pb2.Error.Code
__all__ = ["RouterFailure", "RouterServer", "request_from_proto"]
_STATUS = {sc.value[0]: sc for sc in grpc.StatusCode}  # Error.Code numbers are gRPC status numbers


def request_from_proto(msg, default_id: str) -> DispatchRequest:
    """GenerateRequest -> DispatchRequest; ValueError names the bad field (the engine checks token ids)."""
    prompt = tuple(msg.prompt_token_ids)
    if not prompt:
        raise ValueError("prompt is empty: at least one token is required")
    params = SamplingParams(
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else SamplingParams.max_new_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else SamplingParams.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        prompt_logprobs=msg.prompt_logprobs,
        stop_token_ids=tuple(msg.stop_token_ids),
    )
    return DispatchRequest(msg.request_id or default_id, prompt, params)


class RouterServer(pb2_grpc.RouterServicer):
    def __init__(
        self,
        dispatcher: Dispatcher,
        policy: RoutingPolicy | None = None,
        *,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 5.0,
        max_inflight: int = 0,
        max_queued: int = 1024,
        queue_timeout_s: float = 60.0,
        restart_wait_s: float = 60.0,
        auth_token: str | None = None,
        max_migrations: int = 2,
        max_hold_s: float = DEFAULT_MAX_HOLD_S,
    ):
        if health_interval_s <= 0 or health_timeout_s <= 0 or max_inflight < 0:
            raise ValueError(
                f"health_interval_s and health_timeout_s must be > 0 and max_inflight >= 0, got "
                f"{health_interval_s}, {health_timeout_s}, {max_inflight}"
            )
        if max_queued < 0 or queue_timeout_s < 0 or restart_wait_s < 0:
            raise ValueError(
                f"max_queued, queue_timeout_s and restart_wait_s must be >= 0, got {max_queued}, "
                f"{queue_timeout_s}, {restart_wait_s}"
            )
        self.max_queued, self.queue_timeout_s, self.restart_wait_s = max_queued, queue_timeout_s, restart_wait_s
        self.max_migrations = max_migrations
        self.holds = PlacementHolds(max_hold_s)  # placements not yet in the workers' reports (reported_load)
        self.auth_token = auth_token
        self.draining = False  # shutting down: new requests are refused
        self._queued = 0
        self._changed: asyncio.Condition | None = None  # notified when capacity frees or health changes
        self.dispatcher = dispatcher
        self.policy = policy or RoutingPolicy()
        self.metrics = RouterMetrics(self.policy.config.block_size)
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.max_inflight = max_inflight  # 0 = unlimited
        self._active = 0
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task | None = None
        self.watches = StreamWatches()  # streams by the workers they wait on (released when one is marked down)
        self.link_places = 0  # Place calls taken as frames of a place link (router.place_link), not gRPC

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind and serve; returns the bound port (port 0 picks a free one)."""
        if self._server is not None:
            raise RuntimeError("router server already started")
        interceptors = [TokenInterceptor(self.auth_token)] if self.auth_token else []
        self._server = grpc.aio.server(interceptors=interceptors)
        pb2_grpc.add_RouterServicer_to_server(self, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind router to {host}:{port}")
        await self._server.start()
        self._health_task = asyncio.create_task(self._health_loop(), name="router-health")
        log.info("router listening on %s:%d (policy %s)", host, bound, self.policy.config.name)
        return bound

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting requests; in-flight streams get `grace` seconds, then are cancelled."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # ---- health --------------------------------------------------------------------------------
    async def check_health(self) -> dict[str, bool]:
        """Probe every worker once and apply the verdicts (also what `Health(probe=true)` runs)."""
        started = asyncio.get_running_loop().time()
        verdicts = await asyncio.wait_for(self.dispatcher.health_check(), self.health_timeout_s)
        if self.holds.release_covered(started, asyncio.get_running_loop().time()):
            self._wake_soon()
        changed = False
        for worker_id, ok in verdicts.items():
            if self.policy.set_health(worker_id, ok):
                changed = True
                log.warning("worker %s is %s", worker_id, "back" if ok else "down")
                if not ok:
                    self.metrics.worker_deaths += 1
            if not ok and (moved := self.watches.worker_down(worker_id)):
                log.warning("worker %s is down: %d streams waiting on it are retried or migrated", worker_id, moved)
        self.policy.observe(self.dispatcher.workers())  # index the new digests here, not in the next placement
        if changed or self._queued:  # a worker came back, or its report may show capacity freed
            await self._notify()
        return verdicts

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # created in the serving loop
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    async def _wait_change(self, timeout: float) -> None:
        cond = self._condition()
        async with cond:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cond.wait(), max(0.0, timeout))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except TimeoutError:  # cannot tell which worker hangs: keep the last verdicts
                log.warning("health check timed out after %.1f s", self.health_timeout_s)
            except Exception:
                log.exception("health check failed")

    def _worker_died(self, worker_id: str) -> None:
        if self.policy.set_health(worker_id, False):
            self.metrics.worker_deaths += 1
            log.warning("worker %s is down (died serving a request)", worker_id)

    # ---- Generate ------------------------------------------------------------------------------
    async def Generate(self, request, context) -> AsyncIterator:
        self.metrics.requests += 1
        rid = request.request_id or f"rtr-{uuid.uuid4().hex[:16]}"
        try:
            async for resp in self._generate(request, rid):
                yield resp
        except RouterFailure as f:
            self.metrics.errors[Code.Name(f.code)] += 1
            yield pb2.GenerateResponse(
                request_id=rid, finished=True, finish_reason="error", error=pb2.Error(code=f.code, message=f.message)
            )
            await context.abort(_STATUS[f.code], f.message)

    def _check_new(self, request, rid: str) -> DispatchRequest:
        """Refuse a request while draining or over max_inflight; -> the validated request."""
        if self.draining:
            raise RouterFailure(Code.UNAVAILABLE, "the service is shutting down; retry on another instance")
        if self.max_inflight and self._active >= self.max_inflight:
            raise RouterFailure(
                Code.RESOURCE_EXHAUSTED,
                f"the service has {self._active} requests in flight (max {self.max_inflight}); retry later",
            )
        try:
            return request_from_proto(request, rid)
        except ValueError as e:
            raise RouterFailure(Code.INVALID_ARGUMENT, str(e)) from None

    async def _generate(self, request, rid: str) -> AsyncIterator:
        dreq = self._check_new(request, rid)
        self._active += 1
        where: dict[str, tuple[str, str]] = {}  # request id of the current placement -> (prefill, decode) worker
        progress = StreamProgress()
        events = recovering_stream(
            dreq,
            functools.partial(self._attempt, where=where),
            incarnation_of=self._incarnation,
            role_of=self._role,
            max_migrations=self.max_migrations,
            progress=progress,
            on_death=self._worker_died,
        )
        shown: set[str] = set()
        first_plp = [math.nan] if dreq.params.prompt_logprobs else []  # the first prompt token has none
        try:
            async with contextlib.aclosing(events):
                async for ev in events:
                    resp = pb2.GenerateResponse(  # the client's id on every message (a retry's or migration's
                        request_id=dreq.request_id,  # placement runs under an id of its own: router.migration)
                        finished=ev.finished,
                        finish_reason=ev.finish_reason or "",
                        prompt_logprobs=first_plp + list(ev.prompt_logprobs),
                    )
                    first_plp = []
                    if ev.token_id is not None:
                        resp.token_id = ev.token_id
                        if dreq.params.logprobs and ev.logprob is not None:
                            resp.logprob = ev.logprob
                    if ev.request_id not in shown and ev.request_id in where:  # a placement's first message
                        shown.add(ev.request_id)
                        resp.prefill_worker, resp.decode_worker = where[ev.request_id]
                        resp.cached_tokens = ev.cached_tokens
                    yield resp
        finally:
            self.metrics.retries += progress.retries
            self._active -= 1

    def _incarnation(self, worker_id: str) -> str:
        return next((w.incarnation for w in self.dispatcher.workers() if w.worker_id == worker_id), "")

    def _role(self, worker_id: str) -> str:
        return next((w.role for w in self.dispatcher.workers() if w.worker_id == worker_id), "")

    async def _attempt(
        self, dreq: DispatchRequest, excluded: dict[str, str], where: dict[str, tuple[str, str]]
    ) -> AsyncGenerator[TokenEvent, None]:
        """One placement of the request, streamed by this router (router.migration's `attempt`)."""
        placement = await self._admit(dreq, excluded)
        where[dreq.request_id] = (placement.prefill.worker_id, placement.decode.worker_id)
        async for ev in self._stream(dreq, placement):
            yield ev

    async def _admit(
        self, dreq: DispatchRequest, excluded: dict[str, str], hashes: PromptHashes | None = None
    ) -> Placement:
        """Place the request once a decode worker fits it and each phase has a healthy worker, waiting
        (bounded, see the module docstring) for capacity or for Ray to restart a worker. hashes: the prompt's
        block hashes as the caller computed them (`Place`), or None."""
        loop = asyncio.get_running_loop()
        start, queued = loop.time(), False
        try:
            while True:
                workers = self.dispatcher.workers()
                exclude = [w.worker_id for w in workers if excluded.get(w.worker_id, None) == w.incarnation]
                waited = loop.time() - start
                fits = self.policy.can_admit(dreq.max_total_tokens, workers, exclude)
                if fits and (queued or not self._queued):  # FIFO: newcomers do not overtake the queue
                    try:
                        return self._place(dreq, exclude, hashes)
                    except NoWorkerAvailable as e:
                        if waited >= self.restart_wait_s:
                            raise RouterFailure(
                                Code.UNAVAILABLE,
                                f"no healthy worker can take the request ({e}) "
                                f"after waiting {waited:.0f} s; retry later",
                            ) from None
                        await self._wait_change(min(0.25, self.restart_wait_s - waited))
                        continue
                if not queued:
                    if self._queued >= self.max_queued:
                        raise RouterFailure(
                            Code.RESOURCE_EXHAUSTED,
                            f"the service is at capacity: {self._queued} "
                            f"requests are already waiting for a decode slot; retry later",
                        )
                    self._queued, queued = self._queued + 1, True
                if waited >= self.queue_timeout_s:
                    raise RouterFailure(
                        Code.UNAVAILABLE, f"no decode capacity freed up within {self.queue_timeout_s:g} s; retry later"
                    )
                await self._wait_change(min(1.0, self.queue_timeout_s - waited))
        finally:
            if queued:
                self._queued -= 1
                asyncio.get_running_loop().create_task(self._notify())  # the next in line may fit now

    def _place(self, dreq: DispatchRequest, excluded: list[str], hashes: PromptHashes | None = None) -> Placement:
        workers = self.dispatcher.workers()
        placement = self.policy.place(dreq.prompt_ids, dreq.max_total_tokens, workers, excluded, hashes=hashes)
        self.metrics.record_placement(placement)
        return placement

    async def _stream(self, dreq: DispatchRequest, placement: Placement) -> AsyncGenerator[TokenEvent, None]:
        """Run one placement through the dispatcher; yields its TokenEvents; raises WorkerDied or RouterFailure.
        Holds the placement's admission (in flight, reserved KV, pending prefill) until the stream ends; a router
        that admits by the workers' reports holds it only until the reports show it, as Place does (holding it to
        the end would count it twice)."""
        p_id, d_id = placement.prefill.worker_id, placement.decode.worker_id
        kv = dreq.max_total_tokens
        held = not self.policy.config.reported_load
        if held:
            self.policy.acquire(d_id, kv)
        else:  # settled at the first token (the decode worker holds the request by then) or at the end
            self._hold(dreq, placement)
        prefill_held = held and p_id != d_id
        if prefill_held:
            self.policy.acquire(p_id)
        pending = placement.prefill.uncached_tokens if held else 0  # counted queued on p_id until the first token
        watch = self.watches.watch(p_id, d_id)
        try:
            events = self.dispatcher.generate(dreq, p_id, d_id)
            async with contextlib.aclosing(events):
                while (ev := await watch.next(events)) is not StreamWatches.END:
                    if ev.token_id is not None or ev.finished:
                        if not held:
                            self.holds.settle(dreq.request_id, asyncio.get_running_loop().time())
                        if p_id != d_id:  # prefill is over: the stream no longer waits on that worker
                            watch.release(p_id)
                        if pending:
                            self.policy.prefill_done(p_id, pending)
                            pending = 0
                        if prefill_held:  # the prefill worker is free of this request
                            self.policy.release(p_id)
                            prefill_held = False
                    yield ev
                    if ev.finished:
                        return
        except Exception as e:
            failure = failure_of(e, dreq.request_id)
            if failure is None:
                raise
            raise failure from None
        finally:
            watch.close()
            if not held:
                self.holds.settle(dreq.request_id, asyncio.get_running_loop().time())
            if pending:
                self.policy.prefill_done(p_id, pending)
            if prefill_held:
                self.policy.release(p_id)
            if held:
                self.policy.release(d_id, kv)
            self._wake_soon()

    # ---- Place -----------------------------------------------------------------------------------
    async def Place(self, request, context):
        """Admission and placement only: the caller runs the request on the workers named and owns its stream."""
        try:
            return await self.place(request)
        except RouterFailure as f:
            await context.abort(_STATUS[f.code], f.message)

    async def place(self, request) -> pb2.PlaceResponse:
        """What `Place` answers, for a PlaceRequest from any transport (gRPC, or an ingress replica's place link:
        router.place_link); a refusal raises RouterFailure (its code, its message)."""
        self.metrics.requests += 1
        self.settle_all(request.settled)  # the caller's earlier placements, whatever this one's answer
        rid = request.request.request_id or f"rtr-{uuid.uuid4().hex[:16]}"
        try:
            dreq = self._check_new(request.request, rid)
            excluded = {e.worker_id: e.incarnation for e in request.excluded}
            if request.retry:
                self.metrics.retries += 1
                for wid, incarnation in excluded.items():
                    if self._incarnation(wid) == incarnation:  # still the process that died, as far as we know
                        self._worker_died(wid)
            self._active += 1
            try:
                placement = await self._admit(dreq, excluded, _prompt_hashes(request))
            finally:
                self._active -= 1
        except RouterFailure as f:
            self.metrics.errors[Code.Name(f.code)] += 1
            raise
        self._hold(dreq, placement)
        p, d = placement.prefill, placement.decode
        return pb2.PlaceResponse(
            request_id=rid,
            prefill_worker=p.worker_id,
            decode_worker=d.worker_id,
            prefill_incarnation=self._incarnation(p.worker_id),
            decode_incarnation=self._incarnation(d.worker_id),
            prefill_reason=p.reason,
            decode_reason=d.reason,
            cached_tokens=p.cached_tokens,
            hash_scheme=_hash_scheme(self.policy.hash_scheme),
        )

    def _hold(self, dreq: DispatchRequest, placement: Placement) -> None:
        """Count a placement as this router's in flight (slot, KV reservation, pending prefill) until the workers'
        reports show it (router.placement_holds: released by the first probe after its `Settle`)."""
        p_id, d_id, kv = placement.prefill.worker_id, placement.decode.worker_id, dreq.max_total_tokens
        pending = placement.prefill.uncached_tokens
        self.policy.acquire(d_id, kv)
        if p_id != d_id:
            self.policy.acquire(p_id)

        def release() -> None:
            if pending:
                self.policy.prefill_done(p_id, pending)
            if p_id != d_id:
                self.policy.release(p_id)
            self.policy.release(d_id, kv)

        self.holds.add(dreq.request_id, release, asyncio.get_running_loop().time())

    async def Settle(self, request, context):
        """The caller's requests reached their decode workers (or failed before): the next probe's reports count them."""
        ids = [request.request_id, *request.request_ids] if request.request_id else request.request_ids
        return pb2.SettleResponse(held=self.settle_all(ids))

    def settle_all(self, request_ids) -> bool:
        """Settle each placement named; -> whether every one was held here."""
        now = asyncio.get_running_loop().time()
        held = [self.holds.settle(rid, now) for rid in request_ids]
        return all(held)

    def _wake_soon(self) -> None:
        """Capacity freed: let queued requests re-check (from a finally: never await there)."""
        if self._queued:
            asyncio.get_running_loop().create_task(self._notify())

    # ---- Health / Stats ------------------------------------------------------------------------
    async def Health(self, request, context):
        if request.probe:
            try:
                await self.check_health()
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "health check timed out")
        workers = self.dispatcher.workers()
        up = [w for w in workers if self.policy.is_up(w)]
        serving = any(w.role in PREFILL_ROLES for w in up) and any(w.role in DECODE_ROLES for w in up)
        return pb2.HealthResponse(
            serving=serving,
            workers=[
                pb2.WorkerHealth(
                    worker_id=w.worker_id,
                    role=w.role,
                    healthy=self.policy.is_up(w),
                    fast_paths_active=w.fast_paths_active,
                    fast_path_fallbacks=w.fast_path_fallbacks,
                    incarnation=w.incarnation,
                )
                for w in workers
            ],
        )

    async def Stats(self, request, context):
        snap = self.metrics.snapshot()
        workers = [
            pb2.WorkerStats(
                worker_id=w.worker_id,
                role=w.role,
                healthy=self.policy.is_up(w),
                running=w.running,
                waiting=w.waiting,
                kv_usage=w.kv_usage,
                kv_free_tokens=w.kv_free_tokens,
                inflight=self.policy.inflight(w.worker_id),
                cached_blocks=self.policy.cached_blocks(w.worker_id),
            )
            for w in self.dispatcher.workers()
        ]
        decisions = [pb2.DecisionCount(stage=s, reason=r, count=n) for (s, r), n in sorted(snap.decisions.items())]
        return pb2.StatsResponse(
            policy=self.policy.config.name,
            workers=workers,
            decisions=decisions,
            requests_total=snap.requests_total,
            retries_total=snap.retries_total,
            worker_deaths_total=snap.worker_deaths_total,
            errors_total=snap.errors_total,
        )


def _prompt_hashes(request) -> PromptHashes | None:
    """A PlaceRequest's prompt hashes (None: the caller sent none, the router hashes the prompt)."""
    if not request.HasField("prompt_hashes"):
        return None
    ph = request.prompt_hashes
    return PromptHashes(HashScheme(ph.scheme.block_tokens, ph.scheme.seed), tuple(ph.hashes))


def _hash_scheme(scheme: HashScheme | None):
    return None if scheme is None else pb2.HashScheme(block_tokens=scheme.block_tokens, seed=scheme.seed)
