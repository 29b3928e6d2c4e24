"""Prefix cache over all five V4 cache kinds: shared history pages + state snapshots at aligned boundaries.

V4's caches are of two kinds, and a reused prefix needs both:
- history (append-only): `kv{r}` compressed KV and `index` keys. Once a request has computed position B,
  the entries of windows closed before B never change, so whole pages below B are shared by refcount
  (`PageAllocator.hold_cached`): a request that reuses the prefix gets the same page ids in its table.
- state (overwritten as the request advances): the `swa` ring, `state4` / `index_state` compressor rings.
  A hit can only resume at a position where this state was *snapshotted*: the request's fixed pages are
  copied into a slot of the `SnapshotStore` right after the step that ended exactly there, and copied back
  into the new request's own fixed pages on a hit. `state{r}` of non-overlapping compressors (r > 4) is not
  snapshotted: at a multiple of r every window is closed, and the next one reads only positions >= B.

Blocks. A block is `block_tokens` consecutive tokens, the LCM of every compress ratio and of every history
group's page span, so a block boundary closes every window and ends on a page of every history group (no
page straddles a boundary: sharing never exposes a row the new request would write). Block k is named by a
chained blake2b hash of (seed, block 0..k's token ids); the seed covers the model config, the cache format
and the block size, so two caches of different formats never share a name. A node holds block k's history
pages (one cache reference each) and optionally one snapshot (the state at the block's end).

Where snapshots are taken (decisions; the issue leaves them open). The state at a request's snapshot point
must exist after some step. Either the scheduler ends a prefill chunk there, or -- when the chunk runs on
past the point and has computed every ring row the snapshot holds (positions [point - ring, point) of each
snapshotted ring, all inside the chunk) -- the step also writes those rows into staging pages (extra ring
writes in engine.model.batch.build_step), copied into a store slot after the step: an 8K prompt then runs as one
step, not 7936 + 256 tokens. One such in-step snapshot a request a step (a second point in the chunk ends
it); without free fixed pages for the staging, the chunk ends at the point as before. The points:
- every `snapshot_interval` tokens of the prompt (EngineCore's default: the step's token budget, at least
  DEFAULT_SNAPSHOT_INTERVAL, so the points fall where full prefill chunks end anyway);
- the prompt's last block boundary (and the one before the last token, for an identical repeat);
- the end of the longest cached *history* this prompt matched, when it is past the snapshot the request
  resumes from: the first two requests sharing a system prompt create a resume point where they diverge;
- every block boundary crossed while decoding (one page copy per block): the next turn of a chat resumes
  at the last one.
A request asking for prompt logprobs is never served from cache (its prompt must be run to score it).

Eviction. Nodes form chains (a node's parent is the block before it). Unreferenced pages are evicted LRU
by leaf nodes (a leaf's ancestors stay, so every surviving node still has its whole prefix) when a pool
group is short (`CachePool.grow` calls `reclaim`). Snapshots have their own LRU over the store's slots.
Pages only the cache holds count as free in every pool figure (`CachePool.available`).

Hash digest. `digest()` holds the hashes of nodes with a snapshot (at most the store's slot count): a
worker publishes it with the seed and block size, and the router hashes a prompt the same way
(`block_hashes`) to see how many of its tokens the worker would serve from cache.

Not thread-safe: owned by the engine thread, like the scheduler.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.execution.block_hash import block_hashes
from engine.execution.request import Request
from engine.handoff import PrefixDigest
from engine.model.cache import CachePool

DEFAULT_SNAPSHOT_INTERVAL = 2048  # tokens (rounded up to whole blocks)


@dataclass(frozen=True)
class PrefixCacheConfig:
    """snapshots: slots of the snapshot store (0 = four per concurrent request); snapshot_interval: tokens
    between the prompt's snapshot points (0 = DEFAULT_SNAPSHOT_INTERVAL), rounded up to whole blocks."""

    enabled: bool = True
    snapshots: int = 0
    snapshot_interval: int = 0

    def __post_init__(self):
        if self.snapshots < 0 or self.snapshot_interval < 0:
            raise ValueError(
                f"snapshots and snapshot_interval must be >= 0, got {self.snapshots}, {self.snapshot_interval}"
            )


def block_tokens(pool: CachePool) -> int:
    """Tokens of one prefix block: LCM of the compress ratios and the history groups' page spans."""
    spans = [g.spec.page_rows * g.spec.tokens_per_row for g in pool.groups.values() if not g.spec.fixed]
    return math.lcm(*spans, *pool.cfg.ratios) if spans else 1


def snapshot_groups(specs) -> list[str]:
    """The fixed groups a snapshot copies: all but `state{r}` of non-overlapping compressors (r > 4), whose
    windows are all closed at a block boundary (the next one reads only positions >= the boundary)."""
    return [s.name for s in specs if s.fixed and not (s.name.startswith("state") and s.name != "state4")]


def snapshot_store_bytes(specs, slots: int) -> int:
    """Device bytes of a SnapshotStore of `slots` slots over these CacheGroupSpecs (for memory planning)."""
    names = set(snapshot_groups(specs))
    return slots * sum(len(s.layers) * s.page_rows * s.width * s.dtype.itemsize for s in specs if s.name in names)


# Fixed pages (a request's SWA ring / compressor states) an engine with a prefix cache holds beyond one per
# running request (engine.loading.load.load_engine: CacheConfig.staging_pages): the in-chunk snapshots stage
# there. Without spare pages an engine running its full max_num_seqs cut every long prompt at its snapshot
# point: two prefill steps where one does (the H200 slice with one request: an 8K prompt as 7936 + 256 tokens,
# 2141 kernels instead of 1181). Held requests (prefill-side hand-offs) may still take them: staging then
# falls back to the cut.
STAGING_PAGES = 2


def default_snapshot_slots(config: PrefixCacheConfig, max_requests: int) -> int:
    return config.snapshots or 4 * max_requests


def hash_seed(pool: CachePool) -> bytes:
    """8 bytes naming the model config, cache format and block size: blocks of other formats never match."""
    cache = pool.cache_config
    ident = repr(
        (
            sorted(vars(pool.cfg).items()),
            cache.kv_cache_dtype,
            cache.index_cache_dtype,
            block_tokens(pool),
            {n: (str(g.spec.dtype), g.spec.width) for n, g in pool.groups.items()},
        )
    )
    return hashlib.blake2b(ident.encode(), digest_size=8).digest()


class SnapshotStore:
    """Slots holding copies of one request's fixed pages (the state groups), on the pool's device.

    tensors[group]: [layers, slots * page_rows, width] like the group's own tensor, so a copy is one slice.
    """

    def __init__(self, pool: CachePool, groups: Sequence[str], slots: int):
        self.pool, self.groups, self.slots = pool, tuple(groups), slots
        self.tensors = {}
        for name in self.groups:
            t = pool.groups[name].tensor
            self.tensors[name] = torch.zeros(
                t.shape[0], slots * pool.groups[name].spec.page_rows, t.shape[2], dtype=t.dtype, device=t.device
            )
        self._free = list(range(slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def save(self, slot: int, pages: dict) -> None:
        """Copy a request's fixed pages (group -> [page]) into `slot`."""
        for name in self.groups:
            rows = self.pool.groups[name].spec.page_rows
            p = pages[name][0]
            self.tensors[name][:, slot * rows : (slot + 1) * rows].copy_(
                self.pool.groups[name].tensor[:, p * rows : (p + 1) * rows]
            )

    def restore(self, slot: int, pages: dict) -> None:
        """Copy `slot` into a request's own fixed pages (group -> [page])."""
        for name in self.groups:
            rows = self.pool.groups[name].spec.page_rows
            p = pages[name][0]
            self.pool.groups[name].tensor[:, p * rows : (p + 1) * rows].copy_(
                self.tensors[name][:, slot * rows : (slot + 1) * rows]
            )


class Node:
    """Block k of some prefix: its history pages (group -> page ids), its end position, maybe a snapshot."""

    __slots__ = ("key", "parent", "children", "pages", "end", "snapshot", "stamp")

    def __init__(self, key: int, parent: int | None, pages: dict, end: int):
        self.key, self.parent, self.pages, self.end = key, parent, pages, end
        self.children = 0
        self.snapshot: int | None = None
        self.stamp = 0


@dataclass
class Hit:
    """What a lookup found: the chain of nodes to share (block 0..), resume position, snapshot slot."""

    chain: list[Node]
    history_end: int  # end of the longest matched history (>= resume)

    @property
    def resume(self) -> int:
        return self.chain[-1].end if self.chain else 0


@dataclass
class PrefixStats:
    """Token counters since start: prompt tokens looked up, and those served from cache."""

    query_tokens: int = 0
    hit_tokens: int = 0
    requests: int = 0
    hit_requests: int = 0
    snapshots_taken: int = 0
    snapshots_in_step: int = 0  # of those, kept from staging pages inside a longer chunk
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, pool: CachePool, config: PrefixCacheConfig | None = None, max_requests: int = 64):
        self.pool = pool
        self.config = config or PrefixCacheConfig()
        self.block = block_tokens(pool)
        self.seed = hash_seed(pool)
        interval = self.config.snapshot_interval or DEFAULT_SNAPSHOT_INTERVAL
        self.interval = -(-interval // self.block) * self.block
        self.history = [n for n, g in pool.groups.items() if not g.spec.fixed]
        state = snapshot_groups([g.spec for g in pool.groups.values()])
        self.store = SnapshotStore(pool, state, default_snapshot_slots(self.config, max_requests))
        self.spans = {n: pool.groups[n].spec.page_rows * pool.groups[n].spec.tokens_per_row for n in self.history}
        self.nodes: dict[int, Node] = {}
        self.stats = PrefixStats()
        self._clock = 0
        self._leaves: list[tuple[int, int]] = []  # heap of (stamp, key), stale entries skipped
        self._snap_lru: OrderedDict[int, None] = OrderedDict()
        self._pinned: set[int] = set()
        self._plans: dict[str, _Plan] = {}
        self.version = 0  # bumped whenever the set of resumable blocks changes (digest republish)
        # (positions, page rows) of each snapshotted ring: slot = position % positions (engine.model.batch._ring_write)
        window = pool.cfg.sliding_window
        self.rings = {
            n: (window if n == "swa" else pool.groups[n].spec.page_rows, pool.groups[n].spec.page_rows) for n in state
        }
        self.ring_span = max((r for r, _ in self.rings.values()), default=0)
        pool.reclaimer = self

    # ---- hashing ------------------------------------------------------------------------------
    def _hashes(self, req: Request, upto_tokens: int) -> list[int]:
        """Block hashes of req.all_tokens[:upto_tokens] (cached on the request's plan)."""
        plan = self._plan(req)
        want = upto_tokens // self.block
        if len(plan.hashes) < want:
            tokens = req.token_slice(0, want * self.block)
            parent = plan.hashes[-1].to_bytes(8, "little") if plan.hashes else None
            plan.hashes.extend(block_hashes(tokens, self.block, self.seed, len(plan.hashes), parent))
        return plan.hashes[:want]

    def _plan(self, req: Request) -> _Plan:
        plan = self._plans.get(req.request_id)
        if plan is None or plan.request is not req:
            plan = self._plans[req.request_id] = _Plan(req)
        return plan

    # ---- admission ----------------------------------------------------------------------------
    def lookup(self, req: Request) -> Hit:
        """Longest cached prefix of the prompt that ends at a snapshot, leaving >= 1 token to compute."""
        n = len(req.prompt)
        chain, best, history_end = [], 0, 0
        if self.config.enabled and not req.params.prompt_logprobs:
            for key in self._hashes(req, n):
                node = self.nodes.get(key)
                if node is None:
                    break
                chain.append(node)
                history_end = node.end
                if node.snapshot is not None and node.end <= n - 1:
                    best = len(chain)
        return Hit(chain[:best], history_end)

    def attach(self, req: Request, hit: Hit) -> None:
        """Share the hit's history pages into req's table and pin the chain (before `CachePool.grow`)."""
        for name in self.history:
            pages = [p for node in hit.chain for p in node.pages[name]]
            if pages:
                self.pool.groups[name].allocator.incref(pages)
                req.pages.setdefault(name, []).extend(pages)
        self._pinned.update(node.key for node in hit.chain)

    def detach(self, req: Request, hit: Hit) -> None:
        """Admission failed after `attach`: give the shared pages back."""
        self._pinned.difference_update(node.key for node in hit.chain)
        self.pool.free(req.pages)

    def commit(self, req: Request, hit: Hit) -> None:
        """req's pages are all allocated: restore the snapshot, skip the cached tokens, plan snapshot points."""
        self._pinned.difference_update(node.key for node in hit.chain)
        resume = hit.resume
        if hit.chain:
            last = hit.chain[-1]
            assert last.snapshot is not None  # a hit's chain ends at a snapshotted block (lookup)
            self.store.restore(last.snapshot, req.pages)
            self._touch(hit.chain)
            req.num_computed = resume
            req.cached_tokens = resume
            self.stats.hit_requests += 1
        self.stats.requests += 1
        self.stats.query_tokens += len(req.prompt)
        self.stats.hit_tokens += resume
        plan = self._plan(req)
        plan.registered = resume // self.block
        if self.config.enabled:
            plan.points = self._points(len(req.prompt), resume, hit.history_end)

    def _points(self, n: int, resume: int, history_end: int) -> list[int]:
        b = self.block
        pts = set(range(self.interval, n + 1, self.interval))
        pts.update({n // b * b, (n - 1) // b * b, history_end})
        return sorted(p for p in pts if p > resume)

    # ---- scheduling ---------------------------------------------------------------------------
    def cut(self, req: Request, start: int, num_tokens: int) -> tuple[int, int]:
        """A prefill chunk [start, start + num_tokens) -> (its length, in-step snapshot point or 0).

        The first snapshot point inside the chunk is taken in the step when the chunk computes every ring row
        it needs and staging pages are free (module docstring); the chunk then ends at the next point inside
        it, if any. Otherwise the chunk ends at the first point. The scheduler runs every chunk it cuts."""
        plan = self._plans.get(req.request_id)
        if plan is None:
            return num_tokens, 0
        self._unstage(plan)  # (staging a failed step left behind)
        snap = 0
        for p in plan.points:
            if start < p < start + num_tokens:
                if not snap and p - start >= self.ring_span and self._stage(plan, p):
                    snap = p
                    continue
                return p - start, snap
        return num_tokens, snap

    def staging(self, req: Request) -> dict[str, int] | None:
        """The staging page of each snapshotted group for req's in-step snapshot this step (None: none)."""
        plan = self._plans.get(req.request_id)
        return None if plan is None or plan.pending is None else plan.pending[1]

    def _stage(self, plan: _Plan, point: int) -> bool:
        pages: dict[str, int] = {}
        for name in self.rings:
            alloc = self.pool.groups[name].allocator
            if not alloc.can_allocate(1):
                for n, page in pages.items():
                    self.pool.groups[n].allocator.free([page])
                return False
            pages[name] = alloc.allocate(1)[0]
        plan.pending = (point, pages)
        return True

    def _unstage(self, plan: _Plan) -> None:
        if plan.pending is not None:
            for name, page in plan.pending[1].items():
                self.pool.groups[name].allocator.free([page])
            plan.pending = None

    def on_computed(self, req: Request) -> None:
        """After a step: register the request's newly completed blocks; snapshot when it stands on a point."""
        if not self.config.enabled:
            return
        plan = self._plan(req)  # an imported request (decode side) gets one here: its pages hold the prompt
        done = req.num_computed
        full = done // self.block
        if full > plan.registered:
            hashes = self._hashes(req, full * self.block)
            for k in range(plan.registered, full):
                self._register(req, hashes, k)
            plan.registered = full
        if plan.pending is not None and done >= plan.pending[0]:  # the step wrote the point's rings to staging
            point, pages = plan.pending
            taken = self.stats.snapshots_taken
            self._snapshot(req, self._hashes(req, point)[-1], {name: [page] for name, page in pages.items()})
            self.stats.snapshots_in_step += self.stats.snapshots_taken - taken
            self._unstage(plan)
        if done and done % self.block == 0 and (done in plan.points or done > len(req.prompt)):
            self._snapshot(req, self._hashes(req, done)[-1])

    def forget(self, req: Request) -> None:
        """The request left the engine (finished, aborted, handed off): drop its plan (and staging pages)."""
        plan = self._plans.get(req.request_id)
        if plan is not None and plan.request is req:
            self._unstage(plan)
            del self._plans[req.request_id]

    def _register(self, req: Request, hashes: list[int], k: int) -> None:
        if hashes[k] in self.nodes:
            return
        first = k  # an ancestor may have been evicted meanwhile: re-insert it from req's own pages
        while first and hashes[first - 1] not in self.nodes:
            first -= 1
        for j in range(first, k + 1):
            self._insert(req, hashes, j)

    def _insert(self, req: Request, hashes: list[int], k: int) -> None:
        pages = {}
        for name in self.history:
            span = self.spans[name]
            pages[name] = req.pages[name][k * self.block // span : (k + 1) * self.block // span]
            self.pool.groups[name].allocator.hold_cached(pages[name])
        parent = hashes[k - 1] if k else None
        node = Node(hashes[k], parent, pages, (k + 1) * self.block)
        if parent is not None:
            self.nodes[parent].children += 1
        self.nodes[node.key] = node
        self._touch([node])

    def _snapshot(self, req: Request, key: int, pages: dict | None = None) -> None:
        """Keep the state at block `key`'s end: req's fixed pages (pages: staging pages holding it instead)."""
        node = self.nodes.get(key)
        if node is None:
            return
        if node.snapshot is not None:
            self._snap_lru.move_to_end(key)
            return
        slot = self.store.take()
        if slot is None:
            victim = next((k for k in self._snap_lru if k not in self._pinned), None)
            if victim is None:
                return
            self._drop_snapshot(self.nodes[victim])
            slot = self.store.take()
            assert slot is not None  # the dropped snapshot's slot went back to the store
        self.store.save(slot, req.pages if pages is None else pages)
        node.snapshot = slot
        self._snap_lru[key] = None
        self.version += 1
        self.stats.snapshots_taken += 1

    # ---- eviction -----------------------------------------------------------------------------
    def _touch(self, nodes: list[Node]) -> None:
        self._clock += 1
        for node in nodes:
            node.stamp = self._clock
            if not node.children:
                heapq.heappush(self._leaves, (node.stamp, node.key))
            if node.snapshot is not None:
                self._snap_lru.move_to_end(node.key)
        if len(self._leaves) > 2 * len(self.nodes) + 64:
            self._leaves = [(n.stamp, n.key) for n in self.nodes.values() if not n.children]
            heapq.heapify(self._leaves)

    def _drop_snapshot(self, node: Node) -> None:
        assert node.snapshot is not None  # callers drop snapshotted nodes only
        self.store.give(node.snapshot)
        node.snapshot = None
        self._snap_lru.pop(node.key, None)
        self.version += 1

    def _evict(self, node: Node) -> None:
        for name, pages in node.pages.items():
            self.pool.groups[name].allocator.release_cached(pages)
        if node.snapshot is not None:
            self._drop_snapshot(node)
        del self.nodes[node.key]
        self.stats.evicted_blocks += 1
        parent = self.nodes.get(node.parent) if node.parent is not None else None
        if parent is not None:
            parent.children -= 1
            if not parent.children:
                heapq.heappush(self._leaves, (parent.stamp, parent.key))

    def _pop_leaf(self) -> Node | None:
        skipped, found = [], None
        while self._leaves:
            stamp, key = heapq.heappop(self._leaves)
            node = self.nodes.get(key)
            if node is None or node.stamp != stamp or node.children:
                continue
            if key in self._pinned:
                skipped.append((stamp, key))
                continue
            found = node
            break
        for item in skipped:
            heapq.heappush(self._leaves, item)
        return found

    def reclaim(self, need: dict[str, int]) -> None:
        """Evict least recently used leaf blocks until every group in `need` has that many free pages."""
        groups = self.pool.groups
        while not all(groups[n].allocator.can_allocate(k) for n, k in need.items()):
            node = self._pop_leaf()
            if node is None:
                return
            self._evict(node)

    def clear(self) -> None:
        """Evict everything not pinned (tests, shutdown): every page only the cache held becomes free."""
        while (node := self._pop_leaf()) is not None:
            self._evict(node)

    # ---- what the worker publishes ----------------------------------------------------------
    def digest(self) -> PrefixDigest:
        """The resumable blocks as a worker publishes them (engine thread; the result is immutable)."""
        return PrefixDigest(
            block_tokens=self.block, seed=self.seed, hashes=frozenset(self._snap_lru), version=self.version
        )

    @property
    def cached_blocks(self) -> int:
        return len(self.nodes)


class _Plan:
    """Per-request prefix bookkeeping: its block hashes, blocks registered, snapshot points, staging."""

    __slots__ = ("request", "hashes", "registered", "points", "pending")

    def __init__(self, request: Request):
        self.request = request
        self.hashes: list[int] = []
        self.registered = 0
        self.points: list[int] = []
        self.pending: tuple[int, dict[str, int]] | None = None  # this step's in-step snapshot: (point, staging)
