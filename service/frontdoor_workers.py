"""Synthetic prefill and decode workers for `dsv4 bench frontdoor`: no model, tokens at a set rate per stream.

They answer exactly what `service.ray_dispatcher.RayDispatcher` calls on the real workers (ping, stats,
transfer_metadata, add_peer, prefill, decode, generate_local, abort), so the real router, ingress replicas
and Serve proxy carry their tokens unchanged. Prefill answers at once with the first token and a ticket that
names no pages; decode yields `Transferred` at once, then one token every 1/rate s per stream and records the
wall-clock (time.time()) instant of each yield, keyed by the request's prompt (the client's tag), so the bench
can subtract it from the client's receive time on the same host clock.

Token k of a stream is `letter_id + k % 26`: with the built-in tiny model's tokenizer each decodes to one
letter, so a client sees every token as one SSE chunk and can check order and loss from the text alone.
"""

from __future__ import annotations

import asyncio
import os
import time

from engine.execution.request import TokenEvent
from engine.handoff import EngineLoad, PrefillResult, Transferred, TransferTicket, WorkerStats

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

    async def _tokens(self, rid: str, prompt: list[int], n: int, first_k: int):
        """Yield tokens first_k..n-1 of a stream on the rate's schedule (each stamped as it is yielded)."""
        log = self.emits.setdefault(tuple(prompt), [])
        start = time.monotonic()
        self.active += 1
        try:
            for k in range(first_k, n):
                delay = start + (k - first_k + 1) / self.token_rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if rid in self.aborted:
                    return
                done = k == n - 1
                log.append(time.time())
                yield TokenEvent(rid, token_for(k, self.letter_id), 0.0, done, "length" if done else None, ())
        finally:
            self.active -= 1


class SyntheticPrefill(_Synthetic):
    role = "prefill"

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


class SyntheticDecode(_Synthetic):
    role = "decode"

    async def decode(self, result: PrefillResult, prompt: list[int], params, batch: bool = False):
        yield Transferred(request_id=result.request_id, num_bytes=0, seconds=0.0)
        async for ev in self._tokens(result.request_id, prompt, params.max_new_tokens, 1):
            yield ev

    async def generate_local(
        self, request_id: str, prompt: list[int], params, seed: int | None = None, batch: bool = False
    ):
        async for ev in self._tokens(request_id, prompt, params.max_new_tokens, 0):
            yield ev
