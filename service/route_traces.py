"""Request traces in the Mooncake format for `dsv4 bench route`, and their reader.

A line: {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [ids of the prompt's
consecutive 512-token blocks]} -- equal ids are equal content, so requests whose ids start alike share that
prefix. Three generators, each a workload the routing docs name (docs/routing.md), seeded and reproducible:
- `chat`: multi-turn conversations; each turn's prompt is the previous turn's full blocks plus the answer
  and a new question; a few shared system prompts; turns separated by a think time.
- `system_prompts`: G groups x M requests sharing a long system prompt (Zipf popularity over groups), each
  with its own short question.
- `agentic`: tool-using agents in loops over a long shared context (tool definitions), each step adding
  a small tool result to the agent's own growing context.
What real conversation traffic adds (the three below; an unseen conversation trace was where the router fell to
83% of the pooled hit rate): long sessions whose prefix grows every turn, separated by heavy-tailed think
times, far more live sessions than one worker's cache holds, bursty arrivals, and heavy-tailed lengths.
- `long_sessions`: hundreds of concurrent sessions of 6-40 turns; each turn adds a heavy-tailed number of
  blocks (mostly 1-2, sometimes a pasted document); lognormal think times (seconds to minutes).
- `bursty`: sessions arriving in bursts (an on/off process: 8x the mean rate for short spells), over a few
  shared system prompts, each a short multi-turn chat.
- `heavy_tail`: a Pareto mix of prompt lengths: most requests short, a few huge documents asked several
  questions each, some minutes apart.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from service.route_sim import TraceRequest

BLOCK = 512
KINDS = ("chat", "system_prompts", "agentic", "long_sessions", "bursty", "heavy_tail")


class _Ids:
    def __init__(self):
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(t_ms: float, ids: list[int], out_len: int, rng: random.Random) -> dict:
    # The last block is partial: a prompt is rarely a whole number of blocks.
    return {
        "timestamp": round(t_ms, 3),
        "input_length": len(ids) * BLOCK - rng.randrange(1, BLOCK),
        "output_length": out_len,
        "hash_ids": ids,
    }


def chat(n: int = 3000, seed: int = 0, rate_per_s: float = 150.0, think_s: float = 8.0) -> list[dict]:
    """Conversations of 2-8 turns over 4 system prompts (2-6 blocks); ~n requests in all."""
    rng, ids = random.Random(seed), _Ids()
    systems = [ids.take(rng.randint(2, 6)) for _ in range(4)]
    out: list[dict] = []
    t = 0.0
    while len(out) < n:
        t += rng.expovariate(rate_per_s / 4.0) * 1000.0
        ctx, turn_t = list(rng.choice(systems)) + ids.take(1), t
        for _ in range(rng.randint(2, 8)):
            out.append(_request(turn_t, list(ctx), rng.randint(64, 700), rng))
            ctx = ctx + ids.take(rng.randint(1, 3))  # the answer and the next question
            turn_t += rng.expovariate(1 / think_s) * 1000.0  # think time
    return sorted(out[:n], key=lambda r: r["timestamp"])


def system_prompts(
    groups: int = 64, per_group: int = 16, seed: int = 0, rate_per_s: float = 120.0, zipf: float = 1.1
) -> list[dict]:
    """groups x per_group requests: a 4-block (2048-token) system prompt + a 1-block question."""
    rng, ids = random.Random(seed), _Ids()
    systems = [ids.take(4) for _ in range(groups)]
    weights = [1.0 / (k + 1) ** zipf for k in range(groups)]
    out, t = [], 0.0
    for _ in range(groups * per_group):
        t += rng.expovariate(rate_per_s) * 1000.0
        g = rng.choices(range(groups), weights)[0]
        out.append(_request(t, systems[g] + ids.take(1), rng.randint(32, 256), rng))
    return out


def agentic(agents: int = 96, steps: int = 12, seed: int = 0, rate_per_s: float = 60.0) -> list[dict]:
    """Agents over a 12-block shared tool context + a 2-block task, each step adding a 1-block result."""
    rng, ids = random.Random(seed), _Ids()
    tools = ids.take(12)
    out = []
    for _ in range(agents):
        t = rng.uniform(0, agents / rate_per_s * steps / 4) * 1000.0
        ctx = tools + ids.take(2)
        for _ in range(steps):
            out.append(_request(t, list(ctx), rng.randint(16, 200), rng))
            ctx = ctx + ids.take(1)
            t += rng.uniform(1.0, 6.0) * 1000.0  # the tool runs
    return sorted(out, key=lambda r: r["timestamp"])


def _pareto_blocks(rng: random.Random, alpha: float, lo: int, hi: int) -> int:
    return min(hi, int(lo * rng.paretovariate(alpha)))


def long_sessions(sessions: int = 360, seed: int = 0, rate_per_s: float = 3.0) -> list[dict]:
    """`sessions` conversations starting at rate_per_s, 6-40 turns each, prefix growing every turn."""
    rng, ids = random.Random(seed), _Ids()
    systems = [ids.take(rng.randint(2, 8)) for _ in range(6)]
    out: list[dict] = []
    t = 0.0
    for _ in range(sessions):
        t += rng.expovariate(rate_per_s) * 1000.0
        ctx, turn_t = list(rng.choice(systems)) + ids.take(rng.randint(1, 4)), t
        for _ in range(rng.randint(6, 40)):
            out.append(_request(turn_t, list(ctx), rng.randint(64, 900), rng))
            ctx = ctx + ids.take(_pareto_blocks(rng, 1.6, 1, 40))  # the answer, the next question, a paste
            turn_t += rng.lognormvariate(2.5, 1.0) * 1000.0  # think time: median 12 s, a long tail
    return sorted(out, key=lambda r: r["timestamp"])


def bursty(sessions: int = 900, seed: int = 0, rate_per_s: float = 12.0) -> list[dict]:
    """Sessions of 2-6 turns over 3 system prompts, arriving in on/off bursts (mean rate_per_s)."""
    rng, ids = random.Random(seed), _Ids()
    systems = [ids.take(rng.randint(3, 10)) for _ in range(3)]
    out: list[dict] = []
    t, burst_end, off_until = 0.0, 0.0, 0.0
    for _ in range(sessions):
        if t >= burst_end:  # a quiet spell, then a burst of ~2 s at 8x the mean rate
            off_until = t + rng.expovariate(1 / 12.0) * 1000.0
            burst_end = off_until + rng.uniform(1.0, 3.0) * 1000.0
            t = off_until
        t += rng.expovariate(rate_per_s * 8) * 1000.0
        ctx, turn_t = list(rng.choice(systems)) + ids.take(rng.randint(1, 6)), t
        for _ in range(rng.randint(2, 6)):
            out.append(_request(turn_t, list(ctx), rng.randint(32, 600), rng))
            ctx = ctx + ids.take(rng.randint(1, 4))
            turn_t += rng.lognormvariate(2.0, 0.8) * 1000.0
    return sorted(out, key=lambda r: r["timestamp"])


def heavy_tail(requests: int = 3000, seed: int = 0, rate_per_s: float = 20.0) -> list[dict]:
    """Pareto-sized prompts (1-160 blocks); a long one is a document asked 2-6 questions minutes apart."""
    rng, ids = random.Random(seed), _Ids()
    out: list[dict] = []
    t = 0.0
    while len(out) < requests:
        t += rng.expovariate(rate_per_s) * 1000.0
        doc = ids.take(_pareto_blocks(rng, 1.2, 1, 160))
        asks = rng.randint(2, 6) if len(doc) > 8 else 1
        q_t = t
        for _ in range(asks):
            out.append(_request(q_t, doc + ids.take(1), rng.randint(16, 400), rng))
            q_t += rng.lognormvariate(3.0, 1.0) * 1000.0
    return sorted(out[:requests], key=lambda r: r["timestamp"])


def make(kind: str, seed: int = 0, rate_per_s: float | None = None, size: int | None = None) -> list[dict]:
    """size: chat / heavy_tail requests, system_prompts groups, agentic agents, long_sessions / bursty sessions
    (None: the generator's default)."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}; choose one of {KINDS}")
    kw: dict = {"seed": seed}
    if rate_per_s is not None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        kw["rate_per_s"] = rate_per_s
    if size is not None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        kw[
            {
                "chat": "n",
                "system_prompts": "groups",
                "agentic": "agents",
                "long_sessions": "sessions",
                "bursty": "sessions",
                "heavy_tail": "requests",
            }[kind]
        ] = size
    generators: dict[str, Callable[..., list[dict]]] = {
        "chat": chat,
        "system_prompts": system_prompts,
        "agentic": agentic,
        "long_sessions": long_sessions,
        "bursty": bursty,
        "heavy_tail": heavy_tail,
    }
    return generators[kind](**kw)


def write(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(path: str | Path) -> list[TraceRequest]:
    """Mooncake-format JSONL -> TraceRequests; ValueError names the first bad line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = TraceRequest(
                float(row["timestamp"]),
                int(row["input_length"]),
                int(row.get("output_length", 0)),
                tuple(int(h) for h in row["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not a Mooncake trace line ({e})") from None
        if req.input_length < 1:
            raise ValueError(f"{path}:{i}: input_length must be >= 1, got {req.input_length}")
        out.append(req)
    if not out:
        raise ValueError(f"{path}: no requests")
    # A line with fewer ids than its length needs gets fresh (unshared) ids for the rest.
    fresh = max((h for r in out for h in r.hash_ids), default=-1) + 1
    for k, r in enumerate(out):
        short = -(-r.input_length // BLOCK) - len(r.hash_ids)
        if short > 0:
            out[k] = TraceRequest(
                r.timestamp_ms, r.input_length, r.output_length, r.hash_ids + tuple(range(fresh, fresh + short))
            )
            fresh += short
    return out
