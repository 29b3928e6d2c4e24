"""Synthetic prefill and decode workers for `dsv4 bench frontdoor`: no model, tokens at a set rate per stream.

They answer exactly what `service.ray_dispatcher.RayDispatcher` and the ingress replicas call on the real workers
(ping, stats, transfer_metadata, add_peer, prefill and its link, decode, generate_local, token_feed, open_tcp_feed and the
requests opened over its connection, renew_feed, abort), so the real router, ingress replicas and Serve proxy carry
their tokens unchanged. Prefill answers at once with the first token and a
ticket that names no pages; decode yields `Transferred` at once, then the request joins the worker's step clock: as a
real engine's continuous batch, every running request gets one token a step, `rate` steps a second, and the
wall-clock (time.time()) instant of each token is recorded, keyed by the request's prompt (the client's tag), so the
bench can subtract it from the client's receive time on the same host clock. A step's tokens go to each request's
own `decode` stream (a tuple of the events ready, as the real worker's batch mode) or, for a request opened with a
feed, to that token feed (decode_worker.token_feed: one item for all of its requests of the step).

Token k of a stream is `letter_id + k % 26`: with the built-in tiny model's tokenizer each decodes to one
letter, so a client sees every token as one SSE chunk and can check order and loss from the text alone.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from dataclasses import dataclass

from decode_worker import feed_wire, tcp_feed
from decode_worker.feed_opens import Opener
from decode_worker.token_feed import Feeds, FeedUnknown
from dsv4_kernels.settings import settings
from engine.execution.request import TokenEvent
from engine.handoff import EngineLoad, PrefillResult, Transferred, TransferTicket, WorkerStats
from engine.runtime.async_sink import AsyncSink
from prefill_worker import prefill_link, prefill_wire

SLOTS = 100_000  # never the limit: the bench measures the token path, not admission
KV_TOKENS = 10**9


def token_for(k: int, letter_id: int) -> int:
    """The k-th token of every synthetic stream (k = 0 is prefill's first token)."""
    return letter_id + k % 26


class _Synthetic:
    role = "decode"

    def __init__(self, worker_id: str, token_rate: float, letter_id: int):
        self.worker_id, self.token_rate, self.letter_id = worker_id, token_rate, letter_id
        self.incarnation = f"{worker_id}-{os.getpid()}-{time.time_ns()}"
        self.active = 0
        self.emits: dict[tuple, list[float]] = {}  # prompt -> time.time() of each yielded token (k = 0 first)
        self.aborted: set[str] = set()
        gc.freeze()  # as the ingress replica (service.serve_ingress): no full collection walks the start-up objects

    def ping(self) -> str:
        return self.incarnation

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> WorkerStats:
        load = EngineLoad(
            running=self.active, waiting=0, kv_usage=0.0, kv_free_tokens=KV_TOKENS, free_slots=SLOTS - self.active
        )
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            incarnation=self.incarnation,
            load=load,
            max_slots=SLOTS,
            kv_capacity_tokens=KV_TOKENS,
            kv_page_tokens=1,
        )

    def take_emits(self) -> dict:
        """The emit log so far, cleared (one load level's worth)."""
        out, self.emits = self.emits, {}
        return out

    def transfer_metadata(self) -> bytes:
        return self.worker_id.encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)


class SyntheticPrefill(_Synthetic):
    role = "prefill"

    def __init__(self, worker_id: str, token_rate: float, letter_id: int, token: str | None = None):
        """token: the cluster token its prefill links present to the ingress replicas (prefill_worker.prefill_link)."""
        super().__init__(worker_id, token_rate, letter_id)
        self.token = token or ""
        self.link_prefills = 0  # prefill calls that came over a link, not Ray (the bench's rows say how many)

    def take_link_prefills(self) -> int:
        out, self.link_prefills = self.link_prefills, 0
        return out

    def _link_prefill(self, request_id: str, prompt: list[int], params, seed: int | None = None) -> PrefillResult:
        self.link_prefills += 1
        return self.prefill(request_id, prompt, params, seed)

    async def open_prefill_link(self, link_id: str, host: str, port: int, key: str) -> tuple[str, ...]:
        """As `PrefillWorker.open_prefill_link`: call the replica back and take its prefill calls as frames."""
        prefiller = prefill_link.Prefiller(prefill=self._link_prefill, abort=self.abort)
        await prefill_link.connect(link_id, host, port, self.token, key, prefiller)
        return (prefill_wire.PREFILL, prefill_wire.CANCEL)  # no streamed hand-off here

    def prefill(self, request_id: str, prompt: list[int], params, seed: int | None = None) -> PrefillResult:
        self.emits.setdefault(tuple(prompt), []).append(time.time())
        n = params.max_new_tokens
        ticket = TransferTicket(
            source=self.worker_id, request_id=request_id, src_pages=(), num_tokens=len(prompt), fingerprint="synthetic"
        )
        return PrefillResult(
            request_id=request_id,
            worker_id=self.worker_id,
            first_token=token_for(0, self.letter_id),
            first_logprob=0.0,
            prompt_logprobs=(),
            seed=seed or 0,
            finished=n <= 1,
            finish_reason="length" if n <= 1 else None,
            ticket=None if n <= 1 else ticket,
            queue_time_s=0.0,
            prefill_time_s=0.0,
            incarnation=self.incarnation,
        )


class _LoopSink(AsyncSink):
    """A request's own sink, put to on the actor's loop itself (the step clock runs there: no cross-thread hop)."""

    def put(self, item) -> None:
        self.queue.put_nowait(item)


@dataclass
class _Running:
    """One request on the synthetic decode worker's step clock."""

    log: list[float]  # the emit log of its prompt
    n: int  # tokens in all (k = 0 .. n - 1)
    k: int  # the next token's index
    sink: AsyncSink


class SyntheticDecode(_Synthetic):
    role = "decode"

    def __init__(self, worker_id: str, token_rate: float, letter_id: int, token: str | None = None):
        """token: the cluster token its TCP token feeds present to the ingress replicas (decode_worker.tcp_feed)."""
        super().__init__(worker_id, token_rate, letter_id)
        self.token = token or ""
        self.feeds = Feeds()
        self._tcp_feeds: set[asyncio.Task] = set()
        self._running: dict[str, _Running] = {}
        self._clock: asyncio.Task | None = None
        # How late each step ran against its due time: the emitter's own timer lag. Not part of the added latency
        # (a token's emit time is stamped when it leaves), but reported beside it: the same 2 cores run it.
        self.step_lag_ms: list[float] = []

    def take_step_lag(self) -> list[float]:
        out, self.step_lag_ms = self.step_lag_ms, []
        return out

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.feeds.forget(request_id)
        if self._running.pop(request_id, None) is not None:
            self.active = len(self._running)

    def _join(self, rid: str, prompt: list[int], n: int, first_k: int, sink: AsyncSink) -> None:
        if first_k >= n:
            return
        self._running[rid] = _Running(self.emits.setdefault(tuple(prompt), []), n, first_k, sink)
        self.active = len(self._running)
        if self._clock is None or self._clock.done():
            self._clock = asyncio.get_running_loop().create_task(self._steps())

    async def _steps(self) -> None:
        """The step clock: while requests run, every 1/rate s each gets its next token (a late step is not made up
        for: the clock starts again from now, as an engine whose step ran long)."""
        period, next_at = 1.0 / self.token_rate, time.monotonic()
        while self._running:
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.step_lag_ms.append((time.monotonic() - next_at) * 1e3)
            if delay <= 0:
                next_at = time.monotonic()
            for rid, run in list(self._running.items()):
                done = run.k == run.n - 1
                run.log.append(time.time())
                run.sink.put(
                    TokenEvent(rid, token_for(run.k, self.letter_id), 0.0, done, "length" if done else None, ())
                )
                run.k += 1
                if done:
                    del self._running[rid]
            self.active = len(self._running)

    async def _own_stream(self, rid: str, sink: AsyncSink):
        """A request's events on its own decode stream: a tuple of those ready at once per item."""
        finished = False
        try:
            while not finished:
                got = [await sink.queue.get()]
                while not sink.queue.empty():
                    got.append(sink.queue.get_nowait())
                finished = got[-1].finished
                yield tuple(got)
        finally:
            if not finished:
                self.abort(rid)

    async def decode(self, result: PrefillResult, prompt: list[int], params, batch: bool = False, feed=None):
        rid = result.request_id
        target = self.feeds.get(feed, self.worker_id) if feed is not None else None
        yield Transferred(request_id=rid, num_bytes=0, seconds=0.0)
        sink = target.sink if target is not None else _LoopSink(asyncio.get_running_loop())
        if target is not None:
            if target.closed:  # as DecodeWorker.decode: a request never joins a feed that ended
                raise FeedUnknown(target.feed_id, self.worker_id)
            target.requests[rid] = time.monotonic()
        self._join(rid, prompt, params.max_new_tokens, 1, sink)
        if target is not None:
            return
        async for item in self._own_stream(rid, sink):
            yield item

    async def generate_local(
        self, request_id: str, prompt: list[int], params, seed: int | None = None, batch: bool = False
    ):
        sink = _LoopSink(asyncio.get_running_loop())
        self._join(request_id, prompt, params.max_new_tokens, 0, sink)
        async for item in self._own_stream(request_id, sink):
            yield item

    def renew_feed(self, feed_id: str) -> bool:
        return self.feeds.renew(feed_id)

    async def token_feed(self, feed_id: str, lease_s: float | None = None):
        """As `DecodeWorker.token_feed`: `()`, then one item a burst of its requests' events (FeedExpired ends it)."""
        feed = self.feeds.open(feed_id, asyncio.get_running_loop(), lease_s)
        try:
            yield ()
            while True:
                batch = await feed.next_batch()
                if batch.items:
                    yield batch.items
                feed.finish(batch.finished)
                if batch.error is not None:
                    raise batch.error
        finally:
            for rid in self.feeds.close(feed):
                self.abort(rid)

    async def open_tcp_feed(
        self, feed_id: str, host: str, port: int, key: str, lease_s: float | None = None
    ) -> tuple[str, ...]:
        """As `DecodeWorker.open_tcp_feed`: call the replica back, then write the feed's bursts as frames (and take
        the requests the replica opens over the connection to `decode`)."""
        opener = Opener(lambda r, p, s, f: self.decode(r, p, s, batch=True, feed=f), self.abort)
        link = await tcp_feed.connect(
            self.feeds, feed_id, host, port, self.token, key, lease_s, settings().token_feed_buffer_bytes, opener
        )

        def sent(batch) -> None:
            link.feed.finish(batch.finished)

        def drop(left: list[str]) -> None:
            for rid in left:
                self.abort(rid)

        tcp_feed.start(self.feeds, link, sent, drop, self._tcp_feeds)
        return feed_wire.WORKER_TAKES  # the replica may open requests over this connection
