"""PrefillWorker: chunked prefill under a token budget, first token, then a KV hand-off.

One engine per worker, stepped by an EngineLoop thread; many requests share each step (the engine's
scheduler packs prompt chunks up to `max_batch_tokens`). A request stops after its first token with its
caches held; `export` registers it with the transfer backend and returns a ticket the decode side pulls
with. Streamed (`prefill_streamed`), each step's completed pages are exported as chunk tickets while the prompt is
still being prefilled, and the final ticket moves only the rest (kv_transfer.plan). The backend reports the decode side's confirmation (or failure, or lease expiry) through `poll`,
which runs on the engine thread and frees the pages there: the prefill side frees only after the
decode side has confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from engine.execution.sampling_params import SamplingParams
from engine.handoff import PrefillResult, TransferTicket
from engine.runtime.async_sink import AsyncSink
from engine.runtime.health import HealthOptions
from engine.runtime.loop_errors import LoopStopped
from engine.runtime.worker_base import WorkerBase
from engine.telemetry import metrics
from kv_transfer.base import ABORTED, TransferBackend, attached_backend, release_kind
from kv_transfer.registry import make_backend, network_options, resolve_name
from prefill_worker import prefill_link, prefill_wire

POLL_INTERVAL_S = 0.02


@dataclass
class _Stream:
    """A streamed prefill (`prefill_streamed`): where its chunk tickets go, and the position its chunks reach."""

    sink: AsyncSink
    start_tokens: int = 0
    pending: list[TransferTicket] = field(default_factory=list)  # exported, bytes not written yet (CUDA)


class PrefillWorker(WorkerBase):
    role = "prefill"

    @property
    def transfer_backend(self) -> TransferBackend:
        return attached_backend(self.backend, f"{self.role} worker {self.worker_id}")

    def __init__(
        self,
        worker_id: str,
        model_dir: str | None,
        engine_options: dict | None = None,
        transfer: str = "tcp",
        lease_s: float = 120.0,
        bind_host: str | None = None,
        cluster_token: str | None = None,
        health: HealthOptions | None = None,
    ):
        super().__init__(worker_id, model_dir, engine_options, health)
        self.transfer = resolve_name(transfer)  # the concrete backend, for metric labels
        self.attach_backend(
            make_backend(
                transfer,
                self.engine.pool,
                worker_name=worker_id,
                lease_s=lease_s,
                **network_options(transfer, bind_host, cluster_token),
            )
        )
        self.transfer_backend.add_release_callback(self._on_release)
        self.cluster_token = cluster_token or ""  # a prefill link's HELLO carries it (prefill_worker.prefill_link)
        self._poller: asyncio.Task | None = None
        self._streams: dict[str, _Stream] = {}  # streamed requests still prefilling (engine thread only)

    # ---- engine thread ---------------------------------------------------------------------------
    def _on_release(self, request_id: str, error: str | None) -> None:
        self.engine.release(request_id)
        kind = release_kind(error)  # a failed pull is counted by the decode worker that pulled, not here too
        if kind == "lease_expired":  # the decode side vanished: nobody else counts this one
            metrics.KV_TRANSFER_FAILURES.labels(self.worker_id, self.transfer, kind).inc()
        elif kind == "aborted":
            metrics.KV_TRANSFER_ABORTS.labels(self.worker_id, self.transfer, "prefill").inc()

    def _on_step(self, engine, events) -> None:
        if isinstance(self.backend, TransferBackend):  # the first steps can run before it is attached
            self.backend.poll()
            if self._streams:
                self._export_chunks(engine)
        self.publish_load()

    # ---- actor API -------------------------------------------------------------------------------
    def transfer_metadata(self) -> bytes:
        return self.transfer_backend.metadata()

    def stream_chunk_tokens(self) -> int:
        """Prompt positions one prefill step completes at most for a request (the step's token budget), in whole
        pages of the largest page (a chunk ticket moves complete pages only): the dispatcher streams a prompt
        that spans several of these (service.ray_stream)."""
        budget, page = self.engine.scheduler_config.max_batch_tokens, self.kv_page_tokens
        return -(-budget // page) * page

    async def _poll_forever(self) -> None:
        # Confirmations arrive while the engine may be idle: poll on the engine thread regularly (and hand over the
        # chunk tickets whose bytes were not written yet at their step's end).
        while True:
            await self.loop.acall(self._poll_and_publish)
            await asyncio.sleep(POLL_INTERVAL_S)

    async def prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams, seed: int | None = None
    ) -> PrefillResult:
        result = None
        async with contextlib.aclosing(self._prefill_items(request_id, prompt, params, seed, streamed=False)) as items:
            async for item in items:
                result = item
        assert isinstance(result, PrefillResult)  # the only item of an unstreamed prefill
        return result

    async def open_prefill_link(self, link_id: str, host: str, port: int, key: str) -> tuple[str, ...]:
        """Call an ingress replica back at host:port and take its `prefill` calls as frames on that connection
        (prefill_worker.prefill_link) -> the frame kinds this worker takes (prefill_wire.WORKER_TAKES)."""
        prefiller = prefill_link.Prefiller(
            prefill=self.prefill, abort=self.abort, prefill_streamed=self.prefill_streamed
        )
        await prefill_link.connect(link_id, host, port, self.cluster_token, key, prefiller)
        return prefill_wire.WORKER_TAKES

    async def prefill_streamed(
        self, request_id: str, prompt: list[int], params: SamplingParams, seed: int | None = None
    ) -> AsyncGenerator[TransferTicket | PrefillResult, None]:
        """Streaming (a Ray streaming method): a chunk `TransferTicket` (final=False) whenever a prefill step
        completed pages of the request's caches, for the decode side to pull while later chunks are prefilled
        (`DecodeWorker.decode_streamed`), then the `PrefillResult`, whose ticket moves the rest (start_tokens).
        Closing the stream early, or an error, aborts the request and releases its chunks."""
        # closed with this stream: an early close drops the request there (an async for alone would leave it open)
        async with contextlib.aclosing(self._prefill_items(request_id, prompt, params, seed, streamed=True)) as items:
            async for item in items:
                yield item

    async def _prefill_items(
        self, request_id: str, prompt: list[int], params: SamplingParams, seed: int | None, streamed: bool
    ) -> AsyncGenerator[TransferTicket | PrefillResult, None]:
        if self._poller is None or self._poller.done():  # a poller that ended (its loop closed, an error) restarts
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
        arrival = time.monotonic()
        sink = AsyncSink(asyncio.get_running_loop())

        def add(engine):
            engine.add_request(prompt, params, request_id, prefill_only=True, seed=seed)
            self.loop.subscribe(request_id, sink)
            if streamed:
                self._streams[request_id] = _Stream(sink)

        await self.loop.acall(add)
        first_step = None
        prompt_lps = [None] if params.prompt_logprobs else []
        try:
            while True:
                ev = await sink.queue.get()
                if isinstance(ev, BaseException):
                    raise ev
                if isinstance(ev, TransferTicket):  # a chunk exported by _export_chunks
                    yield ev
                    continue
                first_step = first_step or time.monotonic()
                prompt_lps.extend(ev.prompt_logprobs)
                if ev.token_id is not None:
                    break
        except BaseException:
            await self.loop.acall(functools.partial(self._drop, request_id))
            raise
        done = time.monotonic()
        self.first_token_times.add(done - arrival, done)
        labels = (self.role, self.worker_id)
        metrics.REQUEST_QUEUE_TIME.labels(*labels).observe(first_step - arrival)
        metrics.PREFILL_TIME.labels(*labels).observe(done - first_step)
        metrics.PROMPT_TOKENS.labels(*labels).inc(len(prompt))
        metrics.GENERATION_TOKENS.labels(*labels).inc()

        def finish(engine):
            stream = self._streams.pop(request_id, None)
            if ev.finished:
                self.transfer_backend.release(request_id, ABORTED)  # chunks nobody needs now
                req = engine.pop_finished(request_id)
                return req.seed, None, []
            req = engine.held_request(request_id)
            start = stream.start_tokens if stream is not None else 0
            backend = self.transfer_backend
            chunks = [] if stream is None else [t for t in stream.pending if backend.chunk_ready(t, wait=True)]
            return req.seed, backend.export(request_id, req.pages, req.num_computed, start_tokens=start), chunks

        try:
            seed_used, ticket, chunks = await self.loop.acall(finish)
        except BaseException:
            await self.loop.acall(functools.partial(self._drop, request_id))
            raise
        try:
            for chunk in chunks:  # not yet handed over when the prefill ended: before the result that follows them
                yield chunk
        except BaseException:  # the stream closed before its result: withdraw the export it would have carried
            await self.loop.acall(functools.partial(self._drop, request_id))
            raise
        yield PrefillResult(
            request_id=request_id,
            worker_id=self.worker_id,
            first_token=ev.token_id,
            first_logprob=ev.logprob,
            prompt_logprobs=tuple(prompt_lps),
            seed=seed_used,
            finished=ev.finished,
            finish_reason=ev.finish_reason,
            ticket=ticket,
            queue_time_s=first_step - arrival,
            prefill_time_s=done - first_step,
            incarnation=self.incarnation,
            cached_tokens=ev.cached_tokens,
        )

    async def abort(self, request_id: str) -> None:
        """Drop a request (queued, running or held) and withdraw its export and chunks; frees its pages."""
        try:
            await self.loop.acall(functools.partial(self._drop, request_id))
        except LoopStopped:
            # The loop has ended (a failed step; the watchdog ends this process): its requests went with it.
            # Raising would only leave an unread error behind the dispatcher's fire-and-forget abort.
            pass

    def _drop(self, request_id: str, engine) -> None:
        """Engine thread: withdraw the request's export (and streamed chunks) and abort it."""
        self._streams.pop(request_id, None)
        self.transfer_backend.release(request_id, ABORTED)
        if request_id not in self.transfer_backend.exported():  # else a read of its pages is in progress: the release
            engine.abort(request_id)  # frees them after it (kv_transfer.base.release)
        self.loop.unsubscribe(request_id)

    def _export_chunks(self, engine) -> None:
        """Engine thread, after a step: export the pages each streamed request's finished chunks completed."""
        for rid, stream in self._streams.items():
            req = engine.requests.get(rid)
            if req is None or req.num_computed <= stream.start_tokens:  # queued, or done (the final export's)
                continue
            ticket = self.transfer_backend.export_chunk(rid, req.pages, req.num_computed, stream.start_tokens)
            if ticket is not None:
                stream.start_tokens = req.num_computed
                stream.pending.append(ticket)
        self._publish_chunks()

    def _poll_and_publish(self, engine) -> None:
        self.transfer_backend.poll()
        self._publish_chunks()

    def _publish_chunks(self) -> None:
        """Engine thread: hand the streamed requests' chunk tickets whose bytes are written (on CUDA, once the
        device work has completed: TransferBackend.chunk_ready) to their streams, in order."""
        for stream in self._streams.values():
            while stream.pending and self.transfer_backend.chunk_ready(stream.pending[0]):
                stream.sink.put(stream.pending.pop(0))
