"""RayDispatcher: the router's Dispatcher over Ray actor pools of PrefillWorker and DecodeWorker.

generate(): prefill on the chosen prefill actor (first token + transfer ticket), then stream from the
chosen decode actor, which pulls the caches and decodes. The first token is released to the client
only once the decode side holds the caches, so TTFT includes the transfer (and a failed transfer
fails the request before anything was streamed). Actor deaths become WorkerDied; a restarted actor
(new incarnation) gets its transfer metadata re-exchanged by the health check.
"""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from engine.handoff import DecodeOverloaded, Transferred
from kv_transfer.base import TransferError
from engine.request import TokenEvent
from router.dispatch import DispatchRequest, Overloaded, WorkerDied, WorkerInfo

log = logging.getLogger(__name__)
DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


class RayDispatcher:
    def __init__(self, prefill: dict, decode: dict, call_timeout_s: float = 10.0):
        """prefill / decode: {worker_id: actor handle}."""
        self.prefill = dict(prefill)
        self.decode = dict(decode)
        self.call_timeout_s = call_timeout_s
        self._info: dict[str, WorkerInfo] = {}
        self._incarnation: dict[str, str] = {}
        for wid in self.prefill:
            self._info[wid] = WorkerInfo(wid, "prefill")
        for wid in self.decode:
            self._info[wid] = WorkerInfo(wid, "decode")

    def workers(self) -> list[WorkerInfo]:
        return list(self._info.values())

    # ---- health ----------------------------------------------------------------------------------
    async def _probe(self, wid: str, handle) -> bool:
        try:
            stats = await asyncio.wait_for(handle.stats.remote(), self.call_timeout_s)
        except (asyncio.TimeoutError, *DEAD):
            self._info[wid] = WorkerInfo(wid, self._info[wid].role, healthy=False)
            return False
        self._info[wid] = WorkerInfo(wid, stats.role, True, stats.running, stats.waiting, stats.kv_free_tokens,
                                     stats.kv_usage, incarnation=stats.incarnation, prefix=stats.prefix)
        if self._incarnation.get(wid) != stats.incarnation:
            self._incarnation[wid] = stats.incarnation
            if wid in self.prefill:  # a new prefill incarnation has a new transfer agent
                await self.connect_prefill(wid)
        return True

    async def connect_prefill(self, wid: str) -> None:
        md = await self.prefill[wid].transfer_metadata.remote()
        await asyncio.gather(*(d.add_peer.remote(wid, md) for d in self.decode.values()), return_exceptions=True)

    async def health_check(self) -> dict[str, bool]:
        items = list(self.prefill.items()) + list(self.decode.items())
        alive = await asyncio.gather(*(self._probe(w, h) for w, h in items))
        return {w: a for (w, _), a in zip(items, alive)}

    async def _still_holds(self, handle, incarnation: str) -> bool:
        """Is the worker that prefilled (this incarnation of it, not a restarted one) still alive?"""
        try:
            return await asyncio.wait_for(handle.ping.remote(), self.call_timeout_s) == incarnation
        except (asyncio.TimeoutError, *DEAD):
            return False

    # ---- one request -----------------------------------------------------------------------------
    async def _generate_local(self, rid: str, prompt: list[int], params, decode_id: str):
        """Prefill and decode on one decode worker (router reason "local_prefill")."""
        decode, finished = self.decode[decode_id], False
        try:
            async for ref in decode.generate_local.options(num_returns="streaming").remote(rid, prompt, params,
                                                                                          params.seed):
                try:
                    item = await ref
                except DEAD as e:
                    raise WorkerDied(decode_id, str(e)) from None
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                try:
                    decode.abort.remote(rid)
                except DEAD:
                    pass

    async def generate(self, request: DispatchRequest, prefill_id: str, decode_id: str):
        rid, prompt, params = request.request_id, list(request.prompt_ids), request.params
        if prefill_id == decode_id and decode_id in self.decode:  # conditional disaggregation: no transfer
            async for ev in self._generate_local(rid, prompt, params, decode_id):
                yield ev
            return
        prefill, decode = self.prefill[prefill_id], self.decode[decode_id]
        try:
            result = await prefill.prefill.remote(rid, prompt, params, params.seed)
        except DEAD as e:
            raise WorkerDied(prefill_id, str(e)) from None
        first = TokenEvent(rid, result.first_token, result.first_logprob, result.finished, result.finish_reason,
                           tuple(result.prompt_logprobs[1:]) if params.prompt_logprobs else (), result.cached_tokens)
        if result.finished:
            yield first
            return
        stream = decode.decode.options(num_returns="streaming").remote(result, prompt, params)
        finished = False
        try:
            async for ref in stream:
                try:
                    item = await ref
                except DEAD as e:
                    raise WorkerDied(decode_id, str(e)) from None
                except DecodeOverloaded as e:
                    raise Overloaded(str(e)) from None
                except TransferError as e:
                    # A pull fails when its source dies mid-transfer: report that as the prefill worker's
                    # death (nothing was streamed yet, so the router retries elsewhere); else fail as is.
                    if not await self._still_holds(prefill, result.incarnation):
                        raise WorkerDied(prefill_id, f"KV transfer failed: {e}") from None
                    raise
                if isinstance(item, Transferred):
                    yield first  # released only now: TTFT includes the transfer
                    continue
                finished = item.finished
                yield item
                if finished:
                    return
        except DEAD as e:
            raise WorkerDied(decode_id, str(e)) from None
        finally:
            if not finished:
                # Client went away or something failed: free pages on both sides, never leak.
                for handle in (prefill, decode):
                    try:
                        handle.abort.remote(rid)
                    except DEAD:
                        pass
