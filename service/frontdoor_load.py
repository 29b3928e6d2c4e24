"""The load side of `dsv4 bench frontdoor`: streaming HTTP clients (raw SSE over aiohttp) and /proc CPU accounting.

Each client loops: POST /v1/completions (token-id prompt carrying a unique tag, stream=true), stamp every
received chunk with time.time() (the synthetic workers stamp their yields on the same host clock), until the
level's deadline. Then a level's record says, per stream, what text arrived and when, so the bench can check
order and loss and subtract the workers' emit times.

CPU: the service's processes are this driver's descendants (a local Ray cluster: GCS, raylet, and every worker
process under it), grouped by the title Ray gives each actor process (`ray::RouterActor`, `ray::ServeReplica:...`,
`ray::ProxyActor`); user + system time from /proc/PID/stat. The synthetic workers and the client are left out.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

# process title prefix -> component; order matters (first match)
COMPONENTS = (
    ("ray::RouterActor", "router"),
    ("ray::ServeReplica", "ingress"),
    ("ray::ProxyActor", "proxy"),
    ("ray::ServeController", "serve_controller"),
    ("ray::Synthetic", "synthetic"),
    ("ray::HAProxyManager", "haproxy"),
)
SERVICE = ("router", "ingress", "proxy", "haproxy", "serve_controller", "ray_daemons")


@dataclass(frozen=True)
class StreamRecord:
    tag: tuple
    text: str
    recv: tuple  # time.time() per received character (one token each): the kernel's receive time where known
    error: str | None = None
    recv_seen: tuple = ()  # the lean client: when its loop read each character (recv is the kernel's time)


@dataclass(frozen=True)
class Level:
    """One load level as the client saw it: its streams, the window [t0, t_end] (time.time()), its own loop lag."""

    records: list[StreamRecord]
    t0: float
    t_end: float
    client_lag_ms: tuple[float, ...]


def tag_prompt(n: int, letter_id: int, width: int = 5) -> list[int]:
    """A unique token-id prompt for request n: BOS then n in base 26 as letters."""
    digits = []
    for _ in range(width):
        n, d = divmod(n, 26)
        digits.append(letter_id + d)
    return [0, *reversed(digits)]


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "dsv4", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


class _Stream:
    """One request's record as its SSE chunks come in, whichever client read them."""

    def __init__(self, prompt: list[int]):
        self.tag = tuple(prompt)
        self.text: list[str] = []
        self.recv: list[float] = []
        self.seen: list[float] = []

    def take(self, payload: str | bytes, t: float, t_seen: float | None = None) -> str | None:
        """One `data:` payload received at t (read by the client's loop at t_seen, the lean client) -> its error."""
        chunk = json.loads(payload)
        if "error" in chunk:
            return str(chunk["error"])
        piece = chunk["choices"][0].get("text") or ""
        self.text.append(piece)
        self.recv.extend([t] * len(piece))
        if t_seen is not None:
            self.seen.extend([t_seen] * len(piece))
        return None

    def record(self, error: str | None = None) -> StreamRecord:
        return StreamRecord(self.tag, "".join(self.text), tuple(self.recv), error, tuple(self.seen))


async def _one(session, url: str, prompt: list[int], max_tokens: int) -> StreamRecord:
    stream = _Stream(prompt)
    try:
        async with session.post(url, json=_body(prompt, max_tokens)) as resp:
            if resp.status != 200:
                return StreamRecord(stream.tag, "", (), f"HTTP {resp.status}")
            async for raw in resp.content:  # one line at a time
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if (error := stream.take(line[6:], time.time())) is not None:
                    return stream.record(error)
    except Exception as e:  # noqa: BLE001 - recorded as this stream's error
        return stream.record(f"{type(e).__name__}: {e}")
    return stream.record()


async def _one_raw(client, prompt: list[int], max_tokens: int) -> StreamRecord:
    """`_one` on the lean client (service.frontdoor_client): the same record, the events parsed after the response,
    received at the kernel's time (the loop's kept as recv_seen)."""
    from service.frontdoor_client import sse_events, status_of

    stream = _Stream(prompt)
    try:
        resp = await client.post_json("/v1/completions", _body(prompt, max_tokens))
        if (status := status_of(resp)) != 200:
            return StreamRecord(stream.tag, "", (), f"HTTP {status}")
        for event in sse_events(resp):
            if event.payload == b"[DONE]":
                continue
            if (error := stream.take(event.payload, event.t_kernel, event.t)) is not None:
                return stream.record(error)
    except Exception as e:  # noqa: BLE001 - recorded as this stream's error
        return stream.record(f"{type(e).__name__}: {e}")
    return stream.record()


CLIENTS = ("raw", "aiohttp")


async def run_level(
    base_url: str,
    streams: int,
    seconds: float,
    max_tokens: int,
    letter_id: int,
    first_tag: int,
    ramp_s: float = 0.0,
    client: str = "raw",
) -> Level:
    """`streams` clients loop requests until `seconds` pass (in-flight ones finish).

    ramp_s: the clients start one by one over this long before t0 (the level's window is [t0, t0 + seconds]). Closed-
    loop clients with equal requests that start at once stay in step: every request of a level ends on one engine
    step and all are sent again at once, a burst of new requests on the ingress every request's duration (measured:
    100-200 ms episodes of 15-90 ms per token every 0.8 s at 32 streams) that steady traffic does not have. Spread over
    one request's duration, their starts stay spread.

    client: "raw" (service.frontdoor_client: a keep-alive connection a client, bytes stamped as they arrive, parsed
    after each response) or "aiohttp" (its line reader, a chunk parsed as it arrives, on the loop while the tokens do)."""
    import aiohttp  # a dependency of Ray Serve

    from service.frontdoor_client import StreamingClient

    if client not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, got {client!r}")
    records: list[StreamRecord] = []
    counter = iter(range(first_tag, first_tag + 10**7))
    url = f"{base_url}/v1/completions"
    host, port = urlsplit(base_url).hostname or "127.0.0.1", urlsplit(base_url).port or 80
    connector = aiohttp.TCPConnector(limit=streams + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        start = time.time()
        t0 = start + ramp_s
        deadline = t0 + seconds

        async def loop(i: int):
            await asyncio.sleep(start + ramp_s * i / streams - time.time())
            raw = StreamingClient(host, port) if client == "raw" else None
            try:
                while time.time() < deadline:
                    prompt = tag_prompt(next(counter), letter_id)
                    if raw is not None:
                        records.append(await _one_raw(raw, prompt, max_tokens))
                    else:
                        records.append(await _one(session, url, prompt, max_tokens))
            finally:
                if raw is not None:
                    raw.close()

        lag: list[float] = []
        ticker = asyncio.create_task(_loop_lag(lag))
        try:
            await asyncio.gather(*(loop(i) for i in range(streams)))
        finally:
            ticker.cancel()
        return Level(records, t0, deadline, tuple(lag))


LAG_TICK_S = 0.002


async def _loop_lag(out: list[float]) -> None:
    """How late this loop wakes a 2 ms sleep, in ms, for as long as it runs: the client's own delay, which a receive
    time (and so the added latency) includes."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        out.append((time.perf_counter() - t - LAG_TICK_S) * 1e3)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _component(pid: int) -> str | None:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for prefix, name in COMPONENTS:
        if cmd.startswith(prefix):
            return name
    if "raylet" in cmd or "gcs_server" in cmd:
        return "ray_daemons"
    if os.path.basename(cmd.split(" ", 1)[0]) == "haproxy":  # the HAProxy processes its manager starts
        return "haproxy"
    return "other"


def _cpu(pid: int) -> float:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_component(root: int | None = None) -> dict[str, float]:
    """CPU seconds so far of root's descendants (default: this process's), by component."""
    kids, out = _children(), dict[str, float]()
    stack = list(kids.get(root or os.getpid(), []))
    while stack:
        pid = stack.pop()
        stack.extend(kids.get(pid, []))
        name = _component(pid)
        if name is not None:
            out[name] = out.get(name, 0.0) + _cpu(pid)
    return out


def _env_of(pid: int, names: tuple[str, ...]) -> dict[str, str]:
    try:
        raw = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError:
        return {}
    pairs = (item.split("=", 1) for item in raw.split("\0") if "=" in item)
    return {k: v for k, v in pairs if k in names}


def env_by_component(names: tuple[str, ...], components: tuple[str, ...], root: int | None = None) -> dict:
    """component -> the variables of `names` set in its processes' environment (those of its first live process):
    which Serve switches the proxy and ingress replicas actually run with."""
    kids, out = _children(), dict[str, dict[str, str]]()
    stack = list(kids.get(root or os.getpid(), []))
    while stack:
        pid = stack.pop()
        stack.extend(kids.get(pid, []))
        name = _component(pid)
        if name in components and name not in out:
            out[name] = _env_of(pid, names)
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per component; a process that ended in between is missing from `after` (clamped at 0)."""
    return {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) for k in set(before) | set(after)}


# `dsv4 bench frontdoor --warmup-seconds`: an untimed level right after each deploy, its prompts tagged from here on
# (apart from the timed levels' level x 100,000 + ...). The first seconds of a deploy carry one-time work that steady
# serving does not: each replica's first requests open its links to the routers and to the prefill and decode actors
# (until then prefills and placements go through Ray), HAProxy reloads with the new replicas, Serve's controller and
# proxy settle. Measured on the 2-core box (2026-12-07, 1 replica, 64 streams, 6 s levels): the first level after a
# deploy read p99 8.0 and 24.9 ms, the levels after it 4.6-7.1 ms.
WARMUP_TAG = 900_000_000
