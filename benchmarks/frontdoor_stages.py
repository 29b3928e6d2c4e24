"""`python -m benchmarks.frontdoor_stages`: CPU of the front door's per-token stages, each alone.

Where `dsv4 bench frontdoor` measures the whole token path, this splits off the stages one can time in isolation:
- a Ray streaming item: an async actor yields `--streams` streams of TokenEvents at `--rate` items/s each (as the
  decode worker does, one event an item), read in this process as the ingress replica reads them; CPU per item of
  the producer's process and of this one (/proc, user + system, every thread), for the generator's own reading
  (`async for ref in stream: await ref`, two fetches an item) and `service.ray_items.next_item` (one fetch);
- a token over a token feed (service.token_feed): one stream carries a tuple of every stream's event a step (`--rate`
  steps/s), demultiplexed into the `--streams` requests' queues, each read by its own task as the ingress replica's
  consumers do; CPU per token (event) of the producer's process and of this one;
- the SSE rendering of one completion / chat chunk (pydantic model + model_dump_json) and `TextStream.add` (one
  token's detokenisation), CPU per call in a loop.
Prints a markdown table; nothing is written to BENCHMARKS.md (the frontdoor section's reading quotes it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from service.ray_cluster import init_ray


@dataclass(frozen=True)
class StageCost:
    stage: str
    calls: int
    us_per_call: float  # this process (the reader / the renderer)
    producer_us_per_call: float | None = None  # the producer actor's process (Ray items only)


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _producer_class():
    import ray

    actor: Any = ray.remote(num_cpus=0, max_concurrency=10_000)  # type: ignore[call-overload]

    @actor
    class TokenProducer:
        def pid(self) -> int:
            return os.getpid()

        async def tokens(self, n: int, rate: float):
            from engine.execution.request import TokenEvent

            start = time.monotonic()
            for k in range(n):
                delay = start + (k + 1) / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                yield TokenEvent("r", 70 + k % 26, 0.0, k == n - 1, "length" if k == n - 1 else None, ())

        def configure(self, steps: int, rate: float, streams: int) -> None:
            self.feed_steps, self.feed_rate, self.feed_streams = steps, rate, streams

        def renew_feed(self, feed_id: str) -> bool:
            return True  # the reader's keeper renews the lease; this producer's feed ends with the reader anyway

        async def token_feed(self, feed_id: str, lease_s: float | None = None):
            """As DecodeWorker.token_feed: `()`, then a step's events of every stream (request r0, r1, ...) an item."""
            from engine.execution.request import TokenEvent

            yield ()
            start, n = time.monotonic(), self.feed_steps
            for k in range(n):
                delay = start + (k + 1) / self.feed_rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                done = k == n - 1
                yield tuple(
                    TokenEvent(f"r{i}", 70 + k % 26, 0.0, done, "length" if done else None, ())
                    for i in range(self.feed_streams)
                )
            await asyncio.sleep(3600)  # a feed stays open; the reader cancels it

    return TokenProducer


async def _read_feed(producer, streams: int, n: int) -> int:
    from service.token_feed import TokenFeeds

    feeds = TokenFeeds(transport="ray")  # this stage is the Ray feed's item (the TCP feed is not measured here)
    # together: each registers its queue before the first awaits the feed's opening (no event comes before)
    queues = await asyncio.gather(*(feeds.subscribe("w", producer, f"r{i}") for i in range(streams)))

    async def one(queue) -> int:
        count = 0
        while count < n:
            count += len(await queue.get())
        return count

    try:
        return sum(await asyncio.gather(*(one(q) for q in queues)))
    finally:
        await feeds.close()


async def _read_all(producer, streams: int, n: int, rate: float, once: bool) -> int:
    from service.ray_items import END, next_item

    async def one() -> int:
        stream = producer.tokens.options(num_returns="streaming").remote(n, rate)
        count = 0
        if once:
            while await next_item(stream) is not END:
                count += 1
        else:
            async for ref in stream:
                await ref
                count += 1
        return count

    return sum(await asyncio.gather(*(one() for _ in range(streams))))


def ray_item_costs(streams: int, items: int, rate: float, rounds: int) -> list[StageCost]:
    """Per reading mode, the median over `rounds` of CPU per item (reader, producer); a warm-up round first."""
    import ray

    started = not ray.is_initialized()
    if started:
        init_ray(tempfile.mkdtemp(prefix="dsv4-bench-metrics-"))  # retries a start that misses Ray's deadline
    try:
        producer = _producer_class().remote()
        pid = ray.get(producer.pid.remote())
        asyncio.run(_read_all(producer, streams, max(1, items // 4), rate, once=False))  # warm-up
        samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(rounds):
            for once in (False, True):
                mine, theirs = time.process_time(), _proc_cpu(pid)
                got = asyncio.run(_read_all(producer, streams, items, rate, once))
                assert got == streams * items, (got, streams * items)
                samples[once].append(((time.process_time() - mine) / got, (_proc_cpu(pid) - theirs) / got))
        out = []
        for once, label in (
            (False, "Ray item, generator's own read (2 fetches)"),
            (True, "Ray item, next_item (1 fetch)"),
        ):
            reader = sorted(s[0] for s in samples[once])[len(samples[once]) // 2]
            prod = sorted(s[1] for s in samples[once])[len(samples[once]) // 2]
            out.append(StageCost(label, streams * items * rounds, reader * 1e6, prod * 1e6))
        feed: list[tuple[float, float]] = []
        for _ in range(rounds):
            ray.get(producer.configure.remote(items, rate, streams))
            mine, theirs = time.process_time(), _proc_cpu(pid)
            got = asyncio.run(_read_feed(producer, streams, items))
            assert got == streams * items, (got, streams * items)
            feed.append(((time.process_time() - mine) / got, (_proc_cpu(pid) - theirs) / got))
        reader, prod = (sorted(f[i] for f in feed)[len(feed) // 2] for i in (0, 1))
        label = f"token over a feed ({streams} requests an item)"
        out.append(StageCost(label, streams * items * rounds, reader * 1e6, prod * 1e6))
        return out
    finally:
        if started:
            ray.shutdown()


def render_costs(calls: int) -> list[StageCost]:
    from engine.execution.sampling_params import SamplingParams
    from engine.loading.make_model import default_model_dir
    from engine.loading.tokenizer import load_tokenizer
    from service import openai_protocol as P
    from service.http_stream import sse
    from service.openai_job import Job
    from service.text_stream import TextStream

    tok = load_tokenizer(default_model_dir())
    job = Job("cmpl-x", [0, 1], SamplingParams(max_new_tokens=8), TextStream(tok, [], False, True), 0.0, 0.0)
    name = (lambda t: tok.decode([t], False)) if tok else str
    cmpl = P.CompletionRender(P.CompletionRequest(model="m", prompt=[0, 1], stream=True), "m", name)
    chat_req = P.ChatCompletionRequest(model="m", messages=[P.ChatMessage(role="user", content="hi")], stream=True)
    chat = P.ChatRender(chat_req, "m", name)
    text = TextStream(tok, [], False, True)
    out = []
    for label, call in (
        ("SSE chunk, completions (pydantic)", lambda i: sse(cmpl._chunk(job, "a")).encode()),
        ("SSE chunk, completions (pre-rendered: served)", lambda i: cmpl.piece(job, 70, 0.0, "a")),
        ("SSE chunk, chat (pydantic)", lambda i: sse(chat._chunk(job, P.DeltaMessage(content="a"))).encode()),
        ("SSE chunk, chat (pre-rendered: served)", lambda i: chat.piece(job, 70, 0.0, "a")),
        ("TextStream.add (one token)", lambda i: text.add(70 + i % 26, False)),
    ):
        start = time.process_time()
        for i in range(calls):
            call(i)
        out.append(StageCost(label, calls, (time.process_time() - start) / calls * 1e6))
    return out


def table(rows: list[StageCost]) -> str:
    lines = ["| stage | calls | CPU us / call (reader / here) | producer CPU us / call |", "|---|---|---|---|"]
    for r in rows:
        prod = f"{r.producer_us_per_call:.0f}" if r.producer_us_per_call is not None else "-"
        lines.append(f"| {r.stage} | {r.calls} | {r.us_per_call:.1f} | {prod} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[StageCost]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--items", type=int, default=200, help="items a stream")
    p.add_argument("--rate", type=float, default=50.0, help="items/s a stream (the bench's token rate)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two reading modes")
    p.add_argument("--render-calls", type=int, default=20_000)
    args = p.parse_args(argv)
    rows = ray_item_costs(args.streams, args.items, args.rate, args.rounds) + render_costs(args.render_calls)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
