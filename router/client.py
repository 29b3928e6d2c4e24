"""Client wrappers of the router's gRPC API: `RouterClient` (blocking) and `AsyncRouterClient` (grpc.aio).

Both speak plain Python: requests take the engine's `SamplingParams`, streams yield frozen `StreamEvent`s
(prompt logprobs with the leading None restored from the wire's NaN), and every failure raises
`RouterError` with the gRPC status code, whether it arrived as the stream's in-band error message or
as the call's status.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass

import grpc

from engine.execution.sampling_params import SamplingParams
from router.auth import call_metadata
from router.prompt_hashes import HashScheme, PromptHashes
from router.protos import pb2, pb2_grpc

_STATUS = {sc.value[0]: sc for sc in grpc.StatusCode}


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    token_id: int | None  # None only on a final message without a token (e.g. abort)
    logprob: float | None  # set when the request asked for logprobs
    finished: bool
    finish_reason: str | None
    prompt_logprobs: tuple  # this message's share; None for the first prompt token
    prefill_worker: str = ""  # set on the first event only
    decode_worker: str = ""
    cached_tokens: int = 0  # set on the first event only: prompt tokens served from the prefix cache


@dataclass(frozen=True)
class GenerateResult:
    """A whole stream collected; fields mirror `engine.execution.request.GenerationOutput`."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float | None] | None
    prompt_logprobs: list[float | None] | None
    finish_reason: str
    prefill_worker: str
    decode_worker: str
    cached_tokens: int = 0


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    role: str
    healthy: bool
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_free_tokens: int = 0
    inflight: int = 0
    cached_blocks: int = 0
    fast_paths_active: tuple[str, ...] = ()  # in health reports only: the GPU fast paths the worker takes
    fast_path_fallbacks: tuple[str, ...] = ()  # and those it does not, as "name: why"
    incarnation: str = ""  # in health reports only: the worker's process the verdict is about ("" unknown)


@dataclass(frozen=True)
class PlacedRequest:
    """Where the router placed a request (`Place`); the caller runs it there. prefill_worker == decode_worker:
    the decode worker prefills it itself."""

    request_id: str
    prefill_worker: str
    decode_worker: str
    prefill_incarnation: str
    decode_incarnation: str
    prefill_reason: str = ""
    decode_reason: str = ""
    cached_tokens: int = 0
    hash_scheme: HashScheme | None = None  # how the router names prompt blocks now (send PromptHashes in it)

    def incarnation(self, worker_id: str) -> str:
        return self.prefill_incarnation if worker_id == self.prefill_worker else self.decode_incarnation


@dataclass(frozen=True)
class HealthReport:
    serving: bool
    workers: tuple[WorkerStatus, ...]


@dataclass(frozen=True)
class StatsReport:
    policy: str
    workers: tuple[WorkerStatus, ...]
    decisions: dict  # (stage, reason) -> count
    requests_total: int
    retries_total: int
    worker_deaths_total: int
    errors_total: dict  # error code name -> count


def build_request(
    prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str = ""
) -> pb2.GenerateRequest:
    p = params or SamplingParams()
    return pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_ids),
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        stop_token_ids=list(p.stop_token_ids),
    )


def to_event(msg) -> StreamEvent:
    """GenerateResponse -> StreamEvent; raises RouterError for the in-band error message."""
    if msg.HasField("error") and msg.error.code != pb2.Error.OK:
        raise RouterError(_STATUS[msg.error.code], msg.error.message)
    return StreamEvent(
        msg.request_id,
        msg.token_id if msg.HasField("token_id") else None,
        msg.logprob if msg.HasField("logprob") else None,
        msg.finished,
        msg.finish_reason or None,
        tuple(None if math.isnan(x) else x for x in msg.prompt_logprobs),
        msg.prefill_worker,
        msg.decode_worker,
        msg.cached_tokens,
    )


def collect(events: list[StreamEvent], params: SamplingParams | None) -> GenerateResult:
    p = params or SamplingParams()
    tokens = [e.token_id for e in events if e.token_id is not None]
    lps = [e.logprob for e in events if e.token_id is not None] if p.logprobs else None
    plps = [x for e in events for x in e.prompt_logprobs] if p.prompt_logprobs else None
    first = events[0] if events else None
    return GenerateResult(
        first.request_id if first else "",
        tokens,
        lps,
        plps,
        events[-1].finish_reason or "length" if events else "error",
        first.prefill_worker if first else "",
        first.decode_worker if first else "",
        first.cached_tokens if first else 0,
    )


def _worker(w) -> WorkerStatus:
    return WorkerStatus(
        w.worker_id,
        w.role,
        w.healthy,
        running=w.running,
        waiting=w.waiting,
        kv_usage=w.kv_usage,
        kv_free_tokens=w.kv_free_tokens,
        inflight=w.inflight,
        cached_blocks=w.cached_blocks,
    )


def place_request(
    prompt_ids: Sequence[int],
    params: SamplingParams | None,
    request_id: str,
    excluded: dict[str, str] | None = None,
    retry: bool = False,
    hashes: PromptHashes | None = None,
    settled: Sequence[str] = (),
) -> pb2.PlaceRequest:
    """hashes: the prompt's block hashes in the scheme the router named (router.prompt_hashes.IngressHasher);
    settled: earlier placements on this router that have settled since (each as `settle` would say)."""
    msg = pb2.PlaceRequest(
        request=build_request(prompt_ids, params, request_id),
        excluded=[pb2.ExcludedWorker(worker_id=w, incarnation=i) for w, i in (excluded or {}).items()],
        retry=retry,
        settled=settled,
    )
    if hashes is not None:
        scheme = pb2.HashScheme(block_tokens=hashes.scheme.block_tokens, seed=hashes.scheme.seed)
        msg.prompt_hashes.CopyFrom(pb2.PromptHashes(scheme=scheme, hashes=hashes.hashes))
    return msg


def placed_from(msg) -> PlacedRequest:
    """A PlaceResponse (from gRPC or a place link: service.place_link) as the caller's PlacedRequest."""
    return PlacedRequest(
        request_id=msg.request_id,
        prefill_worker=msg.prefill_worker,
        decode_worker=msg.decode_worker,
        prefill_incarnation=msg.prefill_incarnation,
        decode_incarnation=msg.decode_incarnation,
        prefill_reason=msg.prefill_reason,
        decode_reason=msg.decode_reason,
        cached_tokens=msg.cached_tokens,
        hash_scheme=(
            HashScheme(msg.hash_scheme.block_tokens, msg.hash_scheme.seed) if msg.HasField("hash_scheme") else None
        ),
    )


def _health(msg) -> HealthReport:
    workers = tuple(
        WorkerStatus(
            w.worker_id,
            w.role,
            w.healthy,
            fast_paths_active=tuple(w.fast_paths_active),
            fast_path_fallbacks=tuple(w.fast_path_fallbacks),
            incarnation=w.incarnation,
        )
        for w in msg.workers
    )
    return HealthReport(msg.serving, workers)


def _stats(msg) -> StatsReport:
    return StatsReport(
        msg.policy,
        tuple(_worker(w) for w in msg.workers),
        {(d.stage, d.reason): d.count for d in msg.decisions},
        msg.requests_total,
        msg.retries_total,
        msg.worker_deaths_total,
        dict(msg.errors_total),
    )


class RouterClient:
    """Blocking client: `for ev in RouterClient("host:port").generate(ids, params): ...`."""

    def __init__(self, addr: str, timeout_s: float | None = None, token: str | None = None):
        self.addr = addr
        self.timeout_s = timeout_s  # per call deadline; None = none
        self._md = call_metadata(token)  # the cluster token, when the router requires one
        self._channel = grpc.insecure_channel(addr)
        self._stub = pb2_grpc.RouterStub(self._channel)

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str = ""
    ) -> Iterator[StreamEvent]:
        call = self._stub.Generate(
            build_request(prompt_ids, params, request_id), timeout=self.timeout_s, metadata=self._md
        )
        try:
            for msg in call:
                ev = to_event(msg)
                yield ev
                if ev.finished:
                    return
        except grpc.RpcError as e:
            raise RouterError(e.code(), e.details() or "") from None
        finally:
            call.cancel()  # no-op after a clean finish; stops the server's work if we stopped early

    def generate_full(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str = ""
    ) -> GenerateResult:
        return collect(list(self.generate(prompt_ids, params, request_id)), params)

    def place(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str = "",
        excluded: dict[str, str] | None = None,
        retry: bool = False,
        hashes: PromptHashes | None = None,
        settled: Sequence[str] = (),
    ) -> PlacedRequest:
        msg = place_request(prompt_ids, params, request_id, excluded, retry, hashes, settled)
        return placed_from(self._call(self._stub.Place, msg))

    def settle(self, request_id: str) -> bool:
        return self._call(self._stub.Settle, pb2.SettleRequest(request_id=request_id)).held

    def settle_many(self, request_ids: Sequence[str]) -> bool:
        return self._call(self._stub.Settle, pb2.SettleRequest(request_ids=request_ids)).held

    def health(self, probe: bool = False) -> HealthReport:
        return _health(self._call(self._stub.Health, pb2.HealthRequest(probe=probe)))

    def stats(self) -> StatsReport:
        return _stats(self._call(self._stub.Stats, pb2.StatsRequest()))

    def _call(self, method, msg):
        try:
            return method(msg, timeout=self.timeout_s, metadata=self._md)
        except grpc.RpcError as e:
            raise RouterError(e.code(), e.details() or "") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _raise_if_channel_closed() -> None:
    """In an `except CancelledError` of a grpc.aio call: grpc.aio ends the calls of a closed channel with
    CancelledError, not RpcError. Unless the calling task itself is being cancelled, that is the channel's close
    (e.g. another request dropped this router replica), not the caller's: raise it as RouterError CANCELLED, which
    the callers treat as an unreachable router, so that it never passes for the client's own disconnect."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() == 0:
        raise RouterError(grpc.StatusCode.CANCELLED, "the channel to the router was closed under the call") from None


class AsyncRouterClient:
    """grpc.aio client; create it inside the event loop that will use it."""

    def __init__(self, addr: str, timeout_s: float | None = None, token: str | None = None):
        self.addr = addr
        self.timeout_s = timeout_s
        self._md = call_metadata(token)
        self._channel = grpc.aio.insecure_channel(addr)
        self._stub = pb2_grpc.RouterStub(self._channel)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str = ""
    ) -> AsyncGenerator[StreamEvent, None]:
        call = self._stub.Generate(
            build_request(prompt_ids, params, request_id), timeout=self.timeout_s, metadata=self._md
        )
        try:
            async for msg in call:
                ev = to_event(msg)
                yield ev
                if ev.finished:
                    return
        except grpc.RpcError as e:
            raise RouterError(e.code(), e.details() or "") from None
        except asyncio.CancelledError:
            _raise_if_channel_closed()
            raise
        finally:
            call.cancel()

    async def generate_full(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str = ""
    ) -> GenerateResult:
        return collect([ev async for ev in self.generate(prompt_ids, params, request_id)], params)

    async def place(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str = "",
        excluded: dict[str, str] | None = None,
        retry: bool = False,
        timeout_s: float | None = None,
        hashes: PromptHashes | None = None,
        settled: Sequence[str] = (),
    ) -> PlacedRequest:
        """Admission and placement only (waits for a decode slot as Generate does); excluded: {worker id: the
        incarnation that died serving this request}; retry: a placement after such a death; hashes: the prompt's
        block hashes in the scheme the router's last answer named (None: the router hashes the prompt); settled:
        earlier placements on this router to settle (as `settle_many`), settled whatever this call's answer."""
        msg = place_request(prompt_ids, params, request_id, excluded, retry, hashes, settled)
        try:
            reply = await self._stub.Place(msg, timeout=timeout_s or self.timeout_s, metadata=self._md)
        except grpc.RpcError as e:
            raise RouterError(e.code(), e.details() or "") from None
        except asyncio.CancelledError:
            _raise_if_channel_closed()
            raise
        return placed_from(reply)

    async def settle(self, request_id: str) -> bool:
        """After place(): the request reached its decode worker (or failed before it); -> whether it was held."""
        return (await self._call(self._stub.Settle, pb2.SettleRequest(request_id=request_id))).held

    async def settle_many(self, request_ids: Sequence[str]) -> bool:
        """settle() for several placements in one call; -> whether every one was held."""
        return (await self._call(self._stub.Settle, pb2.SettleRequest(request_ids=request_ids))).held

    async def health(self, probe: bool = False) -> HealthReport:
        return _health(await self._call(self._stub.Health, pb2.HealthRequest(probe=probe)))

    async def stats(self) -> StatsReport:
        return _stats(await self._call(self._stub.Stats, pb2.StatsRequest()))

    async def _call(self, method, msg):
        try:
            return await method(msg, timeout=self.timeout_s, metadata=self._md)
        except grpc.RpcError as e:
            raise RouterError(e.code(), e.details() or "") from None
        except asyncio.CancelledError:
            _raise_if_channel_closed()
            raise

    async def close(self, grace_s: float | None = None) -> None:
        """Close the channel; calls still in flight after grace_s (None: at once) end in RouterError CANCELLED."""
        await self._channel.close(grace_s)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
