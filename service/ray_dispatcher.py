"""RayDispatcher: the router's view of the Ray actor pools of PrefillWorker and DecodeWorker (their published state,
health and transfer introductions), and the router's Dispatcher over them.

What workers publish is the router's only state about them: each health probe reads every worker's `WorkerStats`
(load, admission capacity, prefix digest, incarnation, problem) into `WorkerInfo`, so any router replica that probes
the same workers places requests the same way, and a new replica starts from the first probe.

Healing: Ray restarts a dead actor (new process, new incarnation, empty transfer peers). A worker is
reported healthy only once it can serve: the health probe that first sees a new incarnation introduces
it to every peer it transfers with (a new prefill's metadata goes to every decode worker; a new decode
worker gets every prefill worker's metadata) and only then marks it healthy. Several routers probing the same
workers introduce them several times; an introduction is idempotent (`DecodeWorker.add_peer`).

Engine health: a worker whose stats report a problem (its engine loop ended, or a step stalled:
engine.runtime.health) is unhealthy, and so is one whose stats call does not answer within `probe_timeout_s`
(a stopped or wedged process).

generate(): one placement through service.ray_stream (prefill, transfer, decode stream; its errors), for the
router's own `Generate` RPC. On the service's path the ingress replica runs the same code itself
(service.direct_path) and the router only places.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator

from ray.exceptions import RayTaskError

from engine.execution.request import TokenEvent
from kv_transfer.base import TransferError
from router.dispatch import DispatchRequest, WorkerDied, WorkerInfo
from service.ray_items import DEAD, cause
from service.ray_stream import RayStreamer, Workers

log = logging.getLogger(__name__)


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
        self.streamer = RayStreamer(call_timeout_s, overload_retry_s, self.known_metadata)
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
                log.warning("worker %s could not be introduced to its peers: %s", wid, cause(e))
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

    def known_metadata(self, prefill_id: str, incarnation: str) -> bytes | None:
        """The transfer metadata fetched when this incarnation of the prefill worker was introduced, if it was."""
        known = self._metadata.get(prefill_id)
        return known[1] if known is not None and known[0] == incarnation else None

    def handles(self) -> dict:
        """{worker id: actor handle} of both pools, as they are now (a group restart replaces handles)."""
        return {**self.prefill, **self.decode}

    # ---- one request -----------------------------------------------------------------------------
    def generate(self, request: DispatchRequest, prefill_id: str, decode_id: str) -> AsyncGenerator[TokenEvent, None]:
        pool = self.decode if prefill_id == decode_id and decode_id in self.decode else self.prefill
        if prefill_id not in pool or decode_id not in self.decode:  # left its pool since the placement
            raise WorkerDied(prefill_id if prefill_id not in pool else decode_id, "it left its pool")
        workers = Workers(prefill_id, pool[prefill_id], decode_id, self.decode[decode_id])
        return self.streamer.run_placement(request, workers)
