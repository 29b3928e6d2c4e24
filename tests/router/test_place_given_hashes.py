"""`Place` with the prompt's block hashes computed by the caller (router.prompt_hashes.IngressHasher, as the ingress
does) places every request exactly where a `Place` without them does, on the workers' digests and on the router's own
estimate; hashes in another scheme are ignored (the router hashes the prompt itself, as for an old client).

Two real gRPC routers side by side over the same workers (a static dispatcher: four colocated workers publishing
digests, or none); each request goes to both, one with hashes and one without."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from engine.execution.block_hash import block_hashes
from engine.handoff import PrefixDigest
from router.client import RouterClient
from router.dispatch import WorkerInfo
from router.policy import ESTIMATE_SEED, PolicyConfig, RoutingPolicy
from router.prompt_hashes import HashScheme, IngressHasher, PromptHashes
from router.server import RouterServer

BLOCK, SEED = 16, b"digseed1"
RNG = random.Random(0)
DOCS = [[RNG.randrange(2, 30000) for _ in range(6 * BLOCK)] for _ in range(3)]


class StaticDispatcher:
    """Four colocated workers; with digests, w0..w2 cache 2..6 blocks of one document each, w3 nothing."""

    def __init__(self, digests: bool):
        self.infos = [
            WorkerInfo(
                f"w{i}",
                "colocated",
                True,
                kv_free_tokens=1 << 20,
                incarnation="1",
                prefix=self._digest(DOCS[i][: (2 + 2 * i) * BLOCK] if i < 3 else []) if digests else None,
            )
            for i in range(4)
        ]

    @staticmethod
    def _digest(tokens: list[int]) -> PrefixDigest:
        return PrefixDigest(
            block_tokens=BLOCK, seed=SEED, hashes=frozenset(block_hashes(tokens, BLOCK, SEED)), version=1
        )

    def workers(self):
        return list(self.infos)

    async def health_check(self):
        return {w.worker_id: True for w in self.infos}


class Routers:
    """Two routers (same policy config, same workers) on one event-loop thread."""

    def __init__(self, digests: bool):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.servers = [
            RouterServer(StaticDispatcher(digests), RoutingPolicy(PolicyConfig("cache_aware")), health_interval_s=3600)
            for _ in range(2)
        ]
        ports = [self.run(s.start("127.0.0.1", 0)) for s in self.servers]
        self.clients = [RouterClient(f"127.0.0.1:{p}", timeout_s=30) for p in ports]

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self):
        for c in self.clients:
            c.close()
        for s in self.servers:
            self.run(s.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)


def prompts() -> list[list[int]]:
    """Documents asked about, cut at every few blocks (hits of every depth), and unrelated prompts."""
    rng = random.Random(1)
    out = []
    for k in range(24):
        doc = DOCS[k % 3]
        cut = rng.randrange(1, len(doc))
        out.append(doc[:cut] + [rng.randrange(2, 30000) for _ in range(rng.randrange(1, 40))])
        if k % 5 == 0:
            out.append([rng.randrange(2, 30000) for _ in range(rng.randrange(1, 90))])
    return out


@pytest.mark.parametrize("digests", [True, False], ids=["digests", "estimate"])
def test_place_with_given_hashes_places_as_without(digests):
    routers = Routers(digests)
    plain, hashing = routers.clients
    ingress = IngressHasher()
    try:
        sent = 0
        for i, prompt in enumerate(prompts()):
            want = plain.place(prompt, request_id=f"a{i}")
            given = ingress.hashes(prompt)
            if i == 7 and given is not None:  # a stale scheme: ignored, the router hashes the prompt itself
                given = PromptHashes(HashScheme(given.scheme.block_tokens * 2, given.scheme.seed), given.hashes)
            sent += given is not None
            got = hashing.place(prompt, request_id=f"b{i}", hashes=given)
            ingress.learn(got.hash_scheme)
            assert (got.prefill_worker, got.prefill_reason, got.cached_tokens) == (
                want.prefill_worker,
                want.prefill_reason,
                want.cached_tokens,
            ), (i, len(prompt))
            assert got.decode_worker == want.decode_worker
        placed = {p.prefill_worker for p in (plain.place(d + [1]) for d in DOCS)}
        assert len(placed) > 1  # the placements depend on the prompts (not one worker for everything)
        assert sent == len(prompts()) - 1  # every request after the first carried hashes
        assert ingress.scheme == (
            HashScheme(BLOCK, SEED) if digests else HashScheme(PolicyConfig().block_size, ESTIMATE_SEED)
        )
        # The router given hashes named only what it was not given usably: the first prompt and the stale one.
        policy = routers.servers[1].policy
        hasher = next(iter(policy._index.hashers.values())) if digests else policy._estimate_hasher
        first_and_stale = [prompts()[0], prompts()[7]]
        assert 0 < hasher.hashed_blocks <= sum(len(p) // hasher.block for p in first_and_stale)
    finally:
        routers.close()
