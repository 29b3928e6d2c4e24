"""DecodeWorker: admits a request only after its caches arrived, then decodes in continuous batches.

`decode` is an async generator (a Ray streaming method): it reserves pages for the request's whole
reservation and a batch slot (a full worker answers DecodeOverloaded, retryable, before any byte moves), pulls
the prefill side's pages into them with a deadline, yields a `Transferred` marker, then joins the running
batch and yields every TokenEvent as it is produced. Any failure before the request joins frees the reserved
pages; closing the stream early aborts the request.
Streamed (`reserve_streamed`, `pull_chunk` for each chunk ticket of `PrefillWorker.prefill_streamed`, then `decode`
with the result): the pages are reserved before the prefill ends, each chunk is pulled and scattered as it comes,
and `decode` pulls only the rest (kv_transfer.plan's streaming).
A staged NIXL pull leaves its last step, the scatter of the pulled bytes into the pages, to this worker
(`TransferBackend.pull_deferred`): it is queued on the engine thread, in the call that joins the request to the
batch, not on a pulling thread, whose many small torch calls each wait for the GIL there (kv_transfer.staging). The
pull itself (`TransferBackend.pull_async`) runs on this actor's event loop thread for NIXL (no hand-off to a
worker thread and back), on a worker thread for tcp.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

from decode_worker import feed_wire, tcp_feed
from decode_worker.feed_opens import Opener
from decode_worker.token_feed import Batch, Feed, Feeds, FeedUnknown
from dsv4_kernels.settings import settings
from engine.execution.sampling_params import SamplingParams
from engine.handoff import DecodeOverloaded, PeerUnknown, PrefillResult, Transferred
from engine.model.allocator import OutOfPages
from engine.runtime.async_sink import AsyncSink
from engine.runtime.health import HealthOptions
from engine.runtime.loop_errors import LoopStopped
from engine.runtime.worker_base import WorkerBase
from engine.telemetry import metrics
from kv_transfer.base import ReadInFlight, TransferBackend, TransferError, TransferTimeout, attached_backend
from kv_transfer.registry import make_backend, network_options, resolve_name

# transfer_totals' finer seconds (summed over pulls, like the others):
#   plan_seconds: the page plan / staged layout; staging_wait_seconds: getting a destination staging range (reclaim,
#   or a wait for queued scatters holding ranges); pull_cpu_seconds: the pulling thread's CPU time over the pull
#   (far below pull_seconds: it waited off the CPU, for the GIL or the READ's sleeps);
#   scatter_index_seconds / scatter_views_seconds / scatter_copies_seconds / scatter_record_seconds: the scatter's
#   page-id upload, per-group views, index_copy_ launches and event; scatter_cpu_seconds: the CPU time of the
#   thread that ran it over the same span; join_seconds: from asking the engine thread to join the request
#   (scatter included) until it has (the wait for the step in flight).
QUARANTINE_SWEEP_S = 0.5  # how often quarantined pages are checked for their READ's end
STREAM_IDLE_S = 120.0  # a streamed reservation without a chunk for this long is aborted (as the prefill's lease)


@dataclass
class _StreamedImport:
    """A streamed request reserved here before its prefill ended (`reserve_streamed`): the position its pulled
    chunks reach, and when it expires without another chunk."""

    deadline: float
    covered: int = 0
    pulling: bool = False  # a chunk's pull is writing the pages: an abort leaves freeing them to it


TRANSFER_PARTS = (
    "plan_seconds",
    "staging_wait_seconds",
    "pull_cpu_seconds",
    "scatter_index_seconds",
    "scatter_views_seconds",
    "scatter_copies_seconds",
    "scatter_record_seconds",
    "scatter_cpu_seconds",
    "join_seconds",
)


def _add_scatter_parts(totals: dict, parts: dict) -> None:
    for key in ("index", "views", "copies", "record", "cpu"):
        totals[f"scatter_{key}_seconds"] += parts.get(key, 0.0)


class DecodeWorker(WorkerBase):
    role = "decode"

    @property
    def transfer_backend(self) -> TransferBackend:
        return attached_backend(self.backend, f"{self.role} worker {self.worker_id}")

    def __init__(
        self,
        worker_id: str,
        model_dir: str | None,
        engine_options: dict | None = None,
        transfer: str = "tcp",
        transfer_timeout_s: float = 30.0,
        bind_host: str | None = None,
        cluster_token: str | None = None,
        health: HealthOptions | None = None,
    ):
        super().__init__(worker_id, model_dir, engine_options, health)
        self.transfer = resolve_name(transfer)  # the concrete backend, for metric labels
        self.transfer_timeout_s = transfer_timeout_s
        self.attach_backend(
            make_backend(
                transfer, self.engine.pool, worker_name=worker_id, **network_options(transfer, bind_host, cluster_token)
            )
        )
        self.cluster_token = cluster_token or ""  # a TCP token feed's HELLO carries it (decode_worker.tcp_feed)
        self.peers: dict[str, bytes] = {}
        self.quarantined: dict = {}  # request id -> its Request, pages held behind a READ that may still land
        self._streamed: dict[str, _StreamedImport] = {}  # streamed imports not joined yet
        self.feeds = Feeds()  # token feeds of the ingress replicas (decode_worker.token_feed)
        self._tcp_feeds: set[asyncio.Task] = set()  # their writers, when they run over TCP (kept referenced)
        self._stream_sweeper: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        # seconds: each pull's whole time here (thread hand-off included); pull_seconds: inside the backend's pull;
        # wire_seconds: its data movement alone; scatter_seconds: staged pulls' scatter
        # (kv_transfer.outcomes.TransferStats), queued on the engine thread in the join (not part of pull_seconds; in
        # it for a backend that scatters itself). The finer parts (TRANSFER_PARTS) say where each of those went.
        self.transfer_totals = {
            "bytes": 0,
            "seconds": 0.0,
            "pull_seconds": 0.0,
            "wire_seconds": 0.0,
            "scatter_seconds": 0.0,
            "count": 0,
            "failures": 0,
            **{k: 0.0 for k in TRANSFER_PARTS},
            "scatters_on_engine": 0,
        }

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Learn (or re-learn, after a restart) a prefill worker's transfer metadata."""
        if self.peers.get(name) == metadata:
            return
        if name in self.peers:
            self.transfer_backend.remove_peer(name)
        self.transfer_backend.add_peer(name, metadata)
        self.peers[name] = metadata

    def remove_peer(self, name: str) -> None:
        """Forget a prefill worker that left its pool (service/pools.py); a ticket from it then gets `PeerUnknown`."""
        if self.peers.pop(name, None) is not None:
            self.transfer_backend.remove_peer(name)

    def transfer_summary(self) -> dict:
        """Bytes, seconds, count and failures of every pull so far (for `dsv4 bench serve`)."""
        return dict(self.transfer_totals)

    async def decode(
        self,
        result: PrefillResult,
        prompt: list[int],
        params: SamplingParams,
        batch: bool = False,
        feed: str | None = None,
    ):
        """A Ray streaming method: `Transferred` once the pull is over, then the request's TokenEvents (with batch,
        a tuple of every event ready at once per item: fewer Ray messages when the reader lags). With `feed` (the id
        of an open `token_feed`: FeedUnknown if this process has none), the stream ends after `Transferred` and the
        request's events go to that feed instead (a join that fails after it: a RequestFailed there)."""
        rid, ticket = result.request_id, result.ticket
        if ticket is None:
            raise ValueError(f"request {rid} finished at prefill ({result.finish_reason}): there is nothing to decode")
        target = self.feeds.get(feed, self.worker_id) if feed is not None else None
        if not self.transfer_backend.knows(ticket):  # this worker (or the source) restarted since the handshake
            raise PeerUnknown(ticket.source, self.worker_id)
        stream = self._streamed.pop(rid, None)
        if stream is None and ticket.start_tokens:  # its chunks went into a reservation that is gone (aborted)
            raise TransferError(f"request {rid!r} has no streamed reservation on {self.worker_id} for its last part")
        if stream is None:
            pages = await self._reserve(rid, prompt, params, result)
        else:  # reserve_streamed took the pages, pull_chunk filled the chunks': set the first token, pull the rest
            pages = await self.loop.acall(functools.partial(_complete_import, rid, result))
            if ticket.start_tokens != stream.covered:
                await self.loop.acall(lambda eng: eng.abort(rid))
                raise TransferError(
                    f"request {rid!r}: its chunks reached position {stream.covered} here, the final ticket starts at "
                    f"{ticket.start_tokens}"
                )
        start = time.monotonic()
        stats, deferred = await self._pull(rid, ticket, pages)
        seconds = time.monotonic() - start
        joined = False
        try:
            self._count_pull(stats, seconds)
            yield Transferred(request_id=rid, num_bytes=stats.bytes, seconds=seconds)

            sink = target.sink if target is not None else AsyncSink(asyncio.get_running_loop())
            if target is not None:
                if target.closed:  # it ended during the pull: nobody would read or free this request
                    raise FeedUnknown(target.feed_id, self.worker_id)
                target.requests[rid] = time.monotonic()

            def join(engine):
                parts = None
                if deferred is not None:
                    try:  # on the engine's stream, before the step that first reads the pages (commit_import's)
                        parts = deferred.run()
                    except BaseException:
                        engine.abort(rid)  # cancelled meanwhile (the stream closed), or the copies failed
                        raise
                self.loop.subscribe(rid, sink)
                engine.commit_import(rid)
                return parts

            t_join = time.monotonic()
            parts = await self.loop.acall(join)
            joined = True
            totals = self.transfer_totals
            totals["join_seconds"] += time.monotonic() - t_join
            if parts is not None:  # totals are only written on this (the actor's) thread
                totals["scatter_seconds"] += parts["seconds"]
                totals["scatters_on_engine"] += 1
                _add_scatter_parts(totals, parts)
        except BaseException as e:
            if target is not None:  # its reader waits on the feed, not on this stream
                target.fail(rid, e if isinstance(e, Exception) else LoopStopped(f"request {rid}: join cancelled"))
            raise
        finally:
            if not joined:  # the stream closed (or the loop stopped) before the request joined: drop it
                if deferred is not None:
                    deferred.cancel()  # frees its staging range, unless the join is running it right now
                self.loop.call(lambda eng: self.drop_request(eng, rid))
        if target is not None:
            return
        async for ev in self._stream(rid, sink, batch):
            yield ev

    async def _reserve(self, rid: str, prompt: list[int], params: SamplingParams, result: PrefillResult | None):
        """Pages and a batch slot for an import (the first token from `result`; None: set when it comes)."""
        first = (0, 0.0, 0, None) if result is None else _first_token(result, params)
        try:
            return await self.loop.acall(lambda e: e.reserve_import(prompt, params, rid, *first))
        except OutOfPages as e:
            raise DecodeOverloaded(f"decode worker {self.worker_id} has no room for {rid}: {e}") from None

    async def _pull(self, rid: str, ticket, pages):
        """Pull `ticket` into the import's `pages` (`pull_async`) -> (stats, deferred scatter or None). On
        failure the import is aborted (its pages freed), or quarantined behind a READ that could not be cancelled."""
        try:  # NIXL: on this thread, polling its READ between the loop's other work (TransferBackend.pull_async)
            return await self.transfer_backend.pull_async(ticket, pages, self.transfer_timeout_s)
        except TransferError as e:
            kind = "timeout" if isinstance(e, TransferTimeout) else "error"
            metrics.KV_TRANSFER_FAILURES.labels(self.worker_id, self.transfer, kind).inc()
            self.transfer_totals["failures"] += 1
            self._streamed.pop(rid, None)
            if isinstance(e, ReadInFlight):  # the READ may still write the pages: keep them until it is over
                await self.loop.acall(lambda eng: self._quarantine(eng, rid))
                self._sweep_soon()
            else:
                await self.loop.acall(lambda eng: eng.abort(rid))
            raise
        except BaseException:
            # cancelled while pulling: the backend freed what the pull held (its READ, range, scatter)
            metrics.KV_TRANSFER_ABORTS.labels(self.worker_id, self.transfer, "decode").inc()
            self._streamed.pop(rid, None)
            await self.loop.acall(lambda eng: eng.abort(rid))
            raise

    def _count_pull(self, stats, seconds: float) -> None:
        metrics.KV_TRANSFER_TIME.labels(self.worker_id, self.transfer).observe(seconds)
        metrics.KV_TRANSFER_BYTES.labels(self.worker_id, self.transfer).observe(stats.bytes)
        totals = self.transfer_totals
        totals["bytes"] += stats.bytes
        totals["seconds"] += seconds
        totals["count"] += 1
        totals["pull_seconds"] += stats.seconds
        totals["wire_seconds"] += stats.wire_seconds
        totals["scatter_seconds"] += stats.scatter_seconds
        totals["plan_seconds"] += stats.plan_seconds
        totals["staging_wait_seconds"] += stats.staging_wait_seconds
        totals["pull_cpu_seconds"] += stats.cpu_seconds
        _add_scatter_parts(totals, stats.scatter_parts)

    # ---- streaming: chunks pulled while the prefill runs (PrefillWorker.prefill_streamed) -----------------
    async def reserve_streamed(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Reserve pages and a batch slot for a request whose prefill has only begun (DecodeOverloaded when full),
        so its chunk tickets can be pulled as they come (`pull_chunk`); `decode` with its PrefillResult then
        pulls the rest and joins it. `abort` drops it at any point (its pages are freed)."""
        await self._reserve(request_id, prompt, params, None)
        self._streamed[request_id] = _StreamedImport(deadline=time.monotonic() + STREAM_IDLE_S)
        if self._stream_sweeper is None or self._stream_sweeper.done():
            self._stream_sweeper = asyncio.get_running_loop().create_task(self._expire_streams())

    async def pull_chunk(self, request_id: str, ticket) -> Transferred:
        """Pull one chunk ticket (final=False) of a streamed request into its reserved pages; chunks come in
        order. A failure aborts the import (TransferError), as a failed pull in `decode` does."""
        stream = self._streamed.get(request_id)
        if stream is None:
            raise TransferError(f"request {request_id!r} has no streamed reservation on {self.worker_id}")
        covered = stream.covered
        if ticket.final or ticket.start_tokens != covered:
            await self.abort(request_id)
            raise TransferError(
                f"request {request_id!r}: chunk ticket from position {ticket.start_tokens} (final={ticket.final}); "
                f"its chunks reached {covered} here"
            )
        if not self.transfer_backend.knows(ticket):
            raise PeerUnknown(ticket.source, self.worker_id)
        pages = await self.loop.acall(lambda e: e.imports[request_id].pages)
        start = time.monotonic()
        stream.pulling = True
        try:
            stats, deferred = await self._pull(request_id, ticket, pages)
            if deferred is not None:  # on the engine thread and stream, as in `decode`'s join (never read before it)
                try:
                    await self.loop.acall(lambda e: deferred.run())
                finally:
                    deferred.cancel()  # a no-op after run; frees the range when the call never ran
        finally:
            stream.pulling = False
            if self._streamed.get(request_id) is not stream:  # aborted meanwhile: its pages are free to go now
                await self.loop.acall(lambda e: self.drop_request(e, request_id))
        if self._streamed.get(request_id) is not stream:
            raise TransferError(f"request {request_id!r} was aborted during a chunk's pull")
        seconds = time.monotonic() - start
        self._count_pull(stats, seconds)
        metrics.KV_STREAM_CHUNKS.labels(self.worker_id, self.transfer).inc()
        stream.covered, stream.deadline = ticket.num_tokens, time.monotonic() + STREAM_IDLE_S
        return Transferred(request_id=request_id, num_bytes=stats.bytes, seconds=seconds)

    async def _expire_streams(self) -> None:
        """Abort streamed reservations that saw no chunk for STREAM_IDLE_S (their dispatcher is gone): their pages
        and batch slot come back, as the prefill side's lease frees its pages."""
        while self._streamed:
            await asyncio.sleep(min(1.0, STREAM_IDLE_S))
            now = time.monotonic()
            for rid in [r for r, st in self._streamed.items() if st.deadline <= now]:
                await self.abort(rid)

    # ---- pages behind a READ that could not be cancelled (kv_transfer.base.ReadInFlight) -----------------
    def _quarantine(self, engine, rid: str) -> None:
        """Engine thread: take the import out of the engine (an abort must not free its pages) and hold it."""
        req = engine.imports.pop(rid, None)
        if req is not None:
            self.quarantined[rid] = req

    def _sweep_soon(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Free quarantined pages once the backend says their READ is over (or its peer is gone)."""
        while self.quarantined:
            await asyncio.sleep(QUARANTINE_SWEEP_S)
            over = await asyncio.to_thread(self.transfer_backend.settled)
            if over:
                await self.loop.acall(functools.partial(self._free_settled, over))

    def _free_settled(self, over, engine) -> None:
        """Engine thread: free the pages of quarantined pulls whose READ is over."""
        for r in over:
            if r in self.quarantined:
                engine.pool.free(self.quarantined.pop(r).pages)

    async def generate_local(
        self, request_id: str, prompt: list[int], params: SamplingParams, seed: int | None = None, batch: bool = False
    ):
        """Conditional disaggregation: prefill and decode a request here, no transfer (its prompt is mostly in
        this worker's prefix cache, or short). A Ray streaming method yielding every TokenEvent; closing the
        stream early aborts the request."""
        sink = AsyncSink(asyncio.get_running_loop())

        def add(engine):
            engine.add_request(prompt, params, request_id, seed=seed)
            self.loop.subscribe(request_id, sink)

        await self.loop.acall(add)
        async for ev in self._stream(request_id, sink, batch):
            yield ev

    async def _stream(self, rid: str, sink: AsyncSink, batch: bool = False):
        """Yield a joined request's TokenEvents until it finishes (batch: tuples of the events ready at once); pop
        it when done, abort it when the consumer stops early (closed stream, cancelled call) or the engine failed."""
        start = time.monotonic()
        finished = False
        try:
            while not finished:
                got = [await sink.queue.get()]
                while batch and not sink.queue.empty():
                    got.append(sink.queue.get_nowait())
                events: list = []
                error: BaseException | None = None
                for ev in got:
                    if isinstance(ev, BaseException):
                        error = ev
                        break
                    events.append(ev)
                    if ev.finished:
                        finished = True
                        break
                tokens = sum(ev.token_id is not None for ev in events)
                if tokens:
                    metrics.GENERATION_TOKENS.labels(self.role, self.worker_id).inc(tokens)
                if events:
                    yield tuple(events) if batch else events[0]
                if error is not None:
                    raise error
        finally:
            if finished:
                metrics.DECODE_TIME.labels(self.role, self.worker_id).observe(time.monotonic() - start)
                await self.loop.acall(lambda e: e.pop_finished(rid))
            else:
                await self.loop.acall(lambda e: self.drop_request(e, rid))

    # ---- token feeds: every request's events to an ingress replica in one Ray stream (decode_worker.token_feed) ----
    async def token_feed(self, feed_id: str, lease_s: float | None = None):
        """A Ray streaming method, open as long as its ingress replica keeps it: first `()` (the feed is open:
        `decode(feed=feed_id)` may route requests to it), then per burst of events a tuple of TokenEvents and
        RequestFailed of every request routed here. An engine failure ends it with that error, a lease not renewed
        (`renew_feed`) for `lease_s` with FeedExpired; its end, however it comes, drops the requests still routed
        to it."""
        feed = self.feeds.open(feed_id, asyncio.get_running_loop(), lease_s)
        tokens_counter = metrics.GENERATION_TOKENS.labels(self.role, self.worker_id)  # looked up once a feed
        try:
            yield ()
            while True:
                batch = await feed.next_batch()
                if batch.tokens:
                    tokens_counter.inc(batch.tokens)
                if batch.items:
                    yield batch.items
                if batch.finished:
                    self._finish_fed(feed, batch.finished)
                if batch.error is not None:
                    raise batch.error
        finally:
            left = self.feeds.close(feed)
            if left:
                self.loop.call(functools.partial(_drop_all, self, left))

    async def open_tcp_feed(
        self, feed_id: str, host: str, port: int, key: str, lease_s: float | None = None
    ) -> tuple[str, ...]:
        """The token feed over TCP (decode_worker.tcp_feed): open feed `feed_id` and call its replica back at
        host:port; returns once connected (the HELLO sent) with the frame kinds it takes from the replica (feed_wire.WORKER_TAKES), the bursts then go out as frames until the feed ends,
        and its end, however it comes, drops the requests still routed to it. The replica may open requests over
        the connection too (OPEN frames: `decode` with this feed, decode_worker.feed_opens)."""
        opener = Opener(lambda r, p, s, f: self.decode(r, p, s, batch=True, feed=f), self.abort)
        link = await tcp_feed.connect(
            self.feeds,
            feed_id,
            host,
            port,
            self.cluster_token,
            key,
            lease_s,
            settings().token_feed_buffer_bytes,
            opener,
        )
        tokens_counter = metrics.GENERATION_TOKENS.labels(self.role, self.worker_id)

        def sent(batch: Batch) -> None:
            if batch.tokens:
                tokens_counter.inc(batch.tokens)
            if batch.finished:
                self._finish_fed(link.feed, batch.finished)

        def drop(left: list[str]) -> None:
            self.loop.call(functools.partial(_drop_all, self, left))

        tcp_feed.start(self.feeds, link, sent, drop, self._tcp_feeds)
        return feed_wire.WORKER_TAKES  # the replica may open requests over this connection

    def renew_feed(self, feed_id: str) -> bool:
        """The feed's replica still reads it (its lease starts again) -> whether this process has the feed."""
        return self.feeds.renew(feed_id)

    def _finish_fed(self, feed: Feed, request_ids: tuple[str, ...]) -> None:
        for seconds in feed.finish(request_ids):
            metrics.DECODE_TIME.labels(self.role, self.worker_id).observe(seconds)
        self.loop.call(functools.partial(_pop_all, request_ids))  # not awaited: the next burst goes out meanwhile

    async def abort(self, request_id: str) -> None:
        self.feeds.forget(request_id)
        stream = self._streamed.pop(request_id, None)
        if stream is not None and stream.pulling:  # the chunk's pull (a READ) may be writing its pages right now:
            return  # `pull_chunk` frees them when it ends
        try:
            await self.loop.acall(lambda e: self.drop_request(e, request_id))
        except LoopStopped:
            # The loop has ended (a failed step; the watchdog ends this process): it holds no request any more.
            # Raising would only leave an unread error behind the dispatcher's fire-and-forget abort.
            pass


def _first_token(result: PrefillResult, params: SamplingParams) -> tuple:
    """reserve_import's (seed, first_token, first_logprob, prompt_logprobs) from a prefill's result."""
    lps = list(result.prompt_logprobs) if params.prompt_logprobs else None
    return result.seed, result.first_token, result.first_logprob, lps


def _complete_import(rid: str, result: PrefillResult, engine) -> dict:
    """Engine thread: give a streamed import (reserved before its prefill ended) the prefill's first token, seed
    and prompt logprobs -> its pages."""
    req = engine.imports.get(rid)
    if req is None:
        raise TransferError(f"request {rid!r} is no longer reserved here (aborted)")
    req.seed, req.output, req.logprobs = result.seed, [result.first_token], [result.first_logprob]
    if req.params.prompt_logprobs:
        req.prompt_logprobs = list(result.prompt_logprobs)
    return req.pages


def _pop_all(request_ids: tuple[str, ...], engine) -> None:
    """Engine thread: free the pages of finished requests (one an abort already dropped is not there)."""
    for rid in request_ids:
        if rid in engine.requests:
            engine.pop_finished(rid)


def _drop_all(worker: DecodeWorker, request_ids: list[str], engine) -> None:
    """Engine thread: drop requests whose feed ended (their pages are freed)."""
    for rid in request_ids:
        worker.drop_request(engine, rid)
