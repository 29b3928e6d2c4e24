"""RayDispatcher: the router's Dispatcher over Ray actor pools of PrefillWorker and DecodeWorker.

generate(): prefill on the chosen prefill actor (first token + transfer ticket), then stream from the
chosen decode actor, which pulls the caches and decodes. The first token is released to the client
only once the decode side holds the caches, so TTFT includes the transfer (and a failed transfer
fails the request before anything was streamed). Actor deaths become WorkerDied.

Healing: Ray restarts a dead actor (new process, new incarnation, empty transfer peers). A worker is
reported healthy only once it can serve: the health probe that first sees a new incarnation introduces
it to every peer it transfers with (a new prefill's metadata goes to every decode worker; a new decode
worker gets every prefill worker's metadata) and only then marks it healthy. A request that races a
restart (the decode worker answers `PeerUnknown`) introduces the pair and retries the pull once.
A decode worker that is momentarily full (`DecodeOverloaded`: the router's admission estimate was
off) is retried with backoff for `overload_retry_s` before the request fails as Overloaded.
Errors raised inside an actor arrive wrapped in Ray's RayTaskError (whose text is a remote traceback with
pids and addresses): they are unwrapped here so that only the worker's own message travels on.

Engine health: a worker whose stats report a problem (its engine loop ended, or a step stalled:
engine.runtime.health) is unhealthy, and so is one whose stats call does not answer within `probe_timeout_s`
(a stopped or wedged process). A request that failed because the worker's engine loop had ended (`LoopStopped`)
fails as `WorkerDied`, like one whose actor died: the router retries or migrates it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from engine.execution.request import TokenEvent
from engine.handoff import DecodeOverloaded, PeerUnknown, Transferred
from engine.runtime.engine_loop import LoopStopped
from kv_transfer.base import TransferError
from router.dispatch import DispatchRequest, Overloaded, WorkerDied, WorkerInfo

log = logging.getLogger(__name__)
DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


async def _events(stream, worker_id: str):
    """The items of a Ray streaming call, with a dead actor as WorkerDied and a task error as its cause."""
    async for ref in stream:
        try:
            yield await ref
        except DEAD as e:
            raise WorkerDied(worker_id, str(e)) from None
        except RayTaskError as e:
            raise _failure(e, worker_id) from None


def _cause(e: BaseException) -> BaseException:
    """The exception an actor method raised, without Ray's remote-traceback wrapper."""
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None
    return cause if isinstance(cause, Exception) else e


def _failure(e: BaseException, worker_id: str) -> BaseException:
    """What a caller sees for an actor's task error: a dead engine loop is the worker's death, else the cause."""
    cause = _cause(e)
    return WorkerDied(worker_id, f"its engine failed: {cause}") if isinstance(cause, LoopStopped) else cause


class RayDispatcher:
    def __init__(
        self,
        prefill: dict,
        decode: dict,
        call_timeout_s: float = 10.0,
        overload_retry_s: float = 5.0,
        probe_timeout_s: float = 5.0,
        pools=None,
    ):
        """prefill / decode: {worker_id: actor handle}; probe_timeout_s: a stats call slower than this marks the
        worker unhealthy (its process is stopped or wedged: the router then moves its streams); pools: the
        PoolManager actor of elastic pools (service/pools.py), whose membership each health check applies."""
        self.prefill = dict(prefill)
        self.decode = dict(decode)
        self.call_timeout_s = call_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.overload_retry_s = overload_retry_s
        self._info: dict[str, WorkerInfo] = {}
        self._incarnation: dict[str, str] = {}  # the incarnation each worker was last introduced as
        self._metadata: dict[str, tuple[str, bytes]] = {}  # prefill id -> (incarnation, transfer metadata)
        self.pools = pools
        self._pools_version = -1  # of the membership last applied
        self._draining: frozenset[str] = frozenset()  # workers leaving their pool: no new placements
        for wid in self.prefill:
            self._info[wid] = WorkerInfo(wid, "prefill", healthy=False)
        for wid in self.decode:
            self._info[wid] = WorkerInfo(wid, "decode", healthy=False)

    def workers(self) -> list[WorkerInfo]:
        # A probe still in flight when its worker left the pool may have written it back: pools decide.
        return [i for w, i in self._info.items() if w in self.prefill or w in self.decode]

    def replace_handle(self, wid: str, handle) -> None:
        """A multi-rank worker placed again (service.group_restart): route to the new actor; the next health
        probe sees its new incarnation and introduces it to its transfer peers before it serves."""
        pool = self.prefill if wid in self.prefill else self.decode
        pool[wid] = handle
        self._incarnation.pop(wid, None)
        self._metadata.pop(wid, None)
        role = self._info[wid].role
        self._info[wid] = WorkerInfo(wid, role, healthy=False, incarnation=self._info[wid].incarnation)

    # ---- elastic pools (service/pools.py) ---------------------------------------------------------
    async def sync_pools(self) -> None:
        """Apply the PoolManager's membership if it changed; while the manager is away keep the last one."""
        if self.pools is None:
            return
        try:
            membership = await asyncio.wait_for(self.pools.membership.remote(self._pools_version), self.probe_timeout_s)
        except (TimeoutError, *DEAD, RayTaskError) as e:
            log.debug("pool membership unavailable: %s", e)
            return
        if membership is not None:
            self.set_pools(membership)

    def set_pools(self, membership) -> None:
        """Join new workers (unhealthy until a probe introduces them to their peers), drop the ones that left
        (with what was learnt of them), flag the draining ones."""
        for role in membership.roles:
            pool, want = (self.prefill if role == "prefill" else self.decode), membership.pool(role)
            for wid in [w for w in pool if w not in want]:
                del pool[wid]
                for known in (self._info, self._incarnation, self._metadata):
                    known.pop(wid, None)
                log.info("worker %s left the %s pool", wid, role)
            for wid, handle in want.items():
                if wid not in pool:
                    pool[wid] = handle
                    self._info[wid] = WorkerInfo(wid, role, healthy=False)
                    log.info("worker %s joined the %s pool", wid, role)
        self._draining = membership.draining
        for wid, info in self._info.items():
            if info.draining != (wid in self._draining):
                self._info[wid] = dataclasses.replace(info, draining=wid in self._draining)
        self._pools_version = membership.version

    # ---- health and introductions ----------------------------------------------------------------
    async def _probe(self, wid: str, handle) -> bool:
        role = self._info[wid].role
        try:
            stats = await asyncio.wait_for(handle.stats.remote(), self.probe_timeout_s)
            if stats.problem is not None:
                if self._info[wid].healthy:
                    log.warning("worker %s is unhealthy: %s", wid, stats.problem)
                self._info[wid] = WorkerInfo(wid, role, healthy=False, incarnation=self._info[wid].incarnation)
                return False
            if self._incarnation.get(wid) != stats.incarnation:
                await asyncio.wait_for(self._introduce_new(wid, stats.incarnation), self.call_timeout_s)
                self._incarnation[wid] = stats.incarnation
        except (TimeoutError, *DEAD, RayTaskError, TransferError) as e:
            if not isinstance(e, (asyncio.TimeoutError, *DEAD)):
                log.warning("worker %s could not be introduced to its peers: %s", wid, _cause(e))
            self._info[wid] = WorkerInfo(wid, role, healthy=False, incarnation=self._info[wid].incarnation)
            return False
        load = stats.load
        self._info[wid] = WorkerInfo(
            wid,
            stats.role,
            True,
            load.running,
            load.waiting,
            load.kv_free_tokens,
            load.kv_usage,
            stats.incarnation,
            stats.max_slots,
            stats.kv_capacity_tokens,
            stats.kv_page_tokens,
            prefix=stats.prefix,
            fast_paths_active=stats.fast_paths_active,
            fast_path_fallbacks=stats.fast_path_fallbacks,
            draining=wid in self._draining,
        )
        return True

    async def _introduce_new(self, wid: str, incarnation: str) -> None:
        """A worker seen with a new incarnation: exchange transfer metadata with every peer before it serves."""
        if wid in self.prefill:
            md = await self.prefill[wid].transfer_metadata.remote()
            self._metadata[wid] = (incarnation, md)
            results = await asyncio.gather(
                *(d.add_peer.remote(wid, md) for d in self.decode.values()), return_exceptions=True
            )
            for did, r in zip(self.decode, results):
                if isinstance(r, BaseException):  # that decode worker is down: it gets every peer on its return
                    self._incarnation.pop(did, None)
            return
        decode = self.decode[wid]
        for pid, (_, md) in list(self._metadata.items()):
            await decode.add_peer.remote(pid, md)
        log.info(
            "decode worker %s (incarnation %s) introduced to %d prefill workers", wid, incarnation, len(self._metadata)
        )

    async def health_check(self) -> dict[str, bool]:
        # Prefill first: a decode worker that restarted at the same time then gets the fresh metadata.
        await self.sync_pools()
        verdicts: dict[str, bool] = {}
        for pool in (self.prefill, self.decode):
            alive = await asyncio.gather(*(self._probe(w, h) for w, h in pool.items()))
            verdicts.update(zip(pool, alive))
        return verdicts

    async def _still_holds(self, handle, incarnation: str) -> bool:
        """Is the worker that prefilled (this incarnation of it, not a restarted one) still alive?"""
        try:
            return await asyncio.wait_for(handle.ping.remote(), self.call_timeout_s) == incarnation
        except (TimeoutError, *DEAD, RayTaskError):
            return False

    async def _introduce_pair(self, prefill_id: str, decode_id: str, incarnation: str) -> None:
        known = self._metadata.get(prefill_id)
        if known is not None and known[0] == incarnation:
            md = known[1]
        else:
            md = await self.prefill[prefill_id].transfer_metadata.remote()
        await self.decode[decode_id].add_peer.remote(prefill_id, md)

    # ---- one request -----------------------------------------------------------------------------
    async def _generate_local(self, rid: str, prompt: list[int], params, decode_id: str):
        """Prefill and decode on one decode worker (router reason "local_prefill")."""
        decode, finished = self.decode[decode_id], False
        try:
            stream = decode.generate_local.options(num_returns="streaming").remote(rid, prompt, params, params.seed)
            async for item in _events(stream, decode_id):
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

    async def _open_decode(self, result, prompt, params, prefill_id: str, decode_id: str):
        """Start the decode stream; -> (stream, its first item: Transferred). Retries a race with a restart
        (PeerUnknown, once) and a full worker (DecodeOverloaded, for overload_retry_s)."""
        prefill, decode = self.prefill[prefill_id], self.decode[decode_id]
        deadline, delay, introduced = time.monotonic() + self.overload_retry_s, 0.05, False
        while True:
            stream = decode.decode.options(num_returns="streaming").remote(result, prompt, params)
            try:
                try:
                    item = await (await anext(stream))
                except RayTaskError as e:
                    raise _failure(e, decode_id) from None
            except DEAD as e:
                raise WorkerDied(decode_id, str(e)) from None
            except PeerUnknown:
                if introduced:
                    raise WorkerDied(
                        decode_id, "still lacks the prefill worker's metadata after an introduction"
                    ) from None
                introduced = True
                try:
                    await asyncio.wait_for(
                        self._introduce_pair(prefill_id, decode_id, result.incarnation), self.call_timeout_s
                    )
                except (TimeoutError, *DEAD, RayTaskError) as e:
                    if not await self._still_holds(prefill, result.incarnation):
                        raise WorkerDied(prefill_id, f"introducing it to {decode_id}: {_cause(e)}") from None
                    raise WorkerDied(decode_id, f"introducing {prefill_id}: {_cause(e)}") from None
                continue
            except DecodeOverloaded as e:
                if time.monotonic() + delay > deadline:
                    raise Overloaded(str(e)) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            except TransferError as e:
                # A pull fails when its source dies mid-transfer: report that as the prefill worker's death
                # (nothing was streamed yet, so the router retries elsewhere); else fail as is.
                if not await self._still_holds(prefill, result.incarnation):
                    raise WorkerDied(prefill_id, f"KV transfer failed: {e}") from None
                raise
            return stream, item

    async def generate(self, request: DispatchRequest, prefill_id: str, decode_id: str):
        rid, prompt, params = request.request_id, list(request.prompt_ids), request.params
        if prefill_id == decode_id and decode_id in self.decode:  # conditional disaggregation: no transfer
            async for ev in self._generate_local(rid, prompt, params, decode_id):
                yield ev
            return
        if prefill_id not in self.prefill or decode_id not in self.decode:  # left its pool since the placement
            raise WorkerDied(prefill_id if prefill_id not in self.prefill else decode_id, "it left its pool")
        prefill, decode = self.prefill[prefill_id], self.decode[decode_id]
        finished = False
        try:
            try:
                result = await prefill.prefill.remote(rid, prompt, params, params.seed)
            except DEAD as e:
                raise WorkerDied(prefill_id, str(e)) from None
            except RayTaskError as e:
                raise _failure(e, prefill_id) from None
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
                yield first
                return
            stream, item = await self._open_decode(result, prompt, params, prefill_id, decode_id)
            assert isinstance(item, Transferred), item
            yield first  # released only now: TTFT includes the transfer
            async for item in _events(stream, decode_id):
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
