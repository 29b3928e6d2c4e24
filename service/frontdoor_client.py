"""The frontdoor bench's lean streaming client: raw HTTP/1.1 on a non-blocking socket, parsed after the response.

Why not aiohttp: the load client shares the bench machine's 2 cores with the service it measures, and every receive
time it stamps includes its own delay. aiohttp's line reader and a json.loads a chunk run on the client's loop while
the tokens arrive (more work a chunk than stamping and keeping the bytes; not measured apart: one pair at 1 x 96 / 128
read p50 3.7 / 4.0 ms with aiohttp, 2.2 / 2.2 with this client), so the client both slows the service (a core it
takes) and inflates the latency it reports (a loop that runs late). This client's hot path is one recvmsg a read: the
bytes appended, this loop's time.time() and the kernel's receive time (SO_TIMESTAMPNS) kept beside them. The chunked framing and the SSE events
are parsed when the response is over, each event stamped by the read that completed it, as a wrk-style load
generator would. The kernel's time is what the service added (its bytes in this machine's socket), free of this
client's own scheduling; the loop's time is what this client saw. A keep-alive connection per client, reopened when
the server closes it.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import socket
import struct
import sys
import time
from dataclasses import dataclass

LAST_CHUNK = b"\r\n0\r\n\r\n"  # a chunked body's end (after headers or a chunk's CRLF); JSON in SSE escapes CR/LF


@dataclass(frozen=True)
class RawResponse:
    """One response's bytes as they arrived: `data` the whole response (head included), `marks[i] = (end, t, t_kernel)`
    the bytes data[:end] were read by this loop at time.time() t, their last segment received by the kernel at
    t_kernel (t where the kernel gives no time)."""

    data: bytes
    marks: tuple[tuple[int, float, float], ...]


@dataclass(frozen=True)
class SSEEvent:
    """One `data:` event of an SSE body: its payload (after "data: ") and when its last byte arrived: read by this
    client's loop (t), received by the kernel (t_kernel: the same read's last segment, so never earlier than the event's
    own last byte; t where the kernel gives no time)."""

    payload: bytes
    t: float
    t_kernel: float


# The kernel's receive time of each read (SO_TIMESTAMPNS: the skb's arrival, CLOCK_REALTIME as time.time()), so a
# stamp does not wait for this client's loop to run: Linux only (Python names no constant for it; 35 on Linux).
SO_TIMESTAMPNS: int | None = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform.startswith("linux") else None)
_ANCILLARY = socket.CMSG_SPACE(16)  # one struct timespec


def _kernel_time(ancillary: list, fallback: float) -> float:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("@qq", data[:16])
            return sec + nsec * 1e-9
    return fallback


def kernel_receive_times() -> bool:
    """Whether this machine's kernel stamps received bytes (SO_TIMESTAMPNS on a loopback TCP read). Sandboxes such as
    gVisor accept the option and give no time, so it is probed, not assumed; without it every t_kernel is the loop's."""
    if SO_TIMESTAMPNS is None:
        return False
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            with socket.create_connection(server.getsockname()) as sender:
                receiver, _ = server.accept()
                with receiver:
                    receiver.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                    sender.sendall(b"x")
                    receiver.settimeout(5.0)
                    _, ancillary, _, _ = receiver.recvmsg(16, _ANCILLARY)
    except OSError:  # no such option, or no loopback to probe on: the loop's times
        return False
    return _kernel_time(ancillary, -1.0) != -1.0


class _Connection:
    """One keep-alive HTTP/1.1 connection: a request at a time; the response's bytes and arrival times kept raw (each
    read: its end offset, this loop's time.time() and the kernel's receive time of its last segment)."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock, self.loop = sock, loop
        self.buf = bytearray()
        self.marks: list[tuple[int, float, float]] = []
        self.done: asyncio.Future | None = None
        self.lost = False
        self._head_end = -1
        self._length = -1  # Content-Length of a non-chunked response; -1: chunked or not known yet
        self.kernel_stamps = False
        if SO_TIMESTAMPNS is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                self.kernel_stamps = True
            except OSError:
                pass  # no kernel times: each read's falls back to the loop's
        loop.add_reader(sock.fileno(), self._readable)

    @classmethod
    async def open(cls, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await loop.sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return cls(sock, loop)

    def _readable(self) -> None:
        while not self.lost:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(1 << 16, _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._closed(e)
                return
            if not data:
                self._closed(None)
                return
            now = time.time()
            self.buf += data
            self.marks.append((len(self.buf), now, _kernel_time(ancillary, now)))
            if self.done is not None and not self.done.done() and self._complete():
                self.done.set_result(None)

    def _closed(self, exc: BaseException | None) -> None:
        self.close()
        if self.done is not None and not self.done.done():
            if self._head_end >= 0 and self._length < 0 and not self.buf.endswith(LAST_CHUNK):
                # a close-delimited or cut response: an error if it was chunked and unfinished
                self.done.set_exception(ConnectionError("connection closed mid-response"))
            else:
                self.done.set_result(None)

    def close(self) -> None:
        if not self.lost:
            self.lost = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()

    def _complete(self) -> bool:
        if self._head_end < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            self._head_end = end + 4
            head = bytes(self.buf[: self._head_end]).lower()
            if b"transfer-encoding: chunked" not in head:
                self._length = _content_length(head)
        if self._length >= 0:
            return len(self.buf) >= self._head_end + self._length
        return self.buf.endswith(LAST_CHUNK)

    async def request(self, raw: bytes) -> RawResponse:
        self.buf, self.marks, self._head_end, self._length = bytearray(), [], -1, -1
        self.done = self.loop.create_future()
        await self.loop.sock_sendall(self.sock, raw)
        await self.done
        return RawResponse(bytes(self.buf), tuple(self.marks))


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


class StreamingClient:
    """A client's connection to host:port, opened on first use and again after the server closes it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._conn: _Connection | None = None

    async def post_json(self, path: str, body: dict) -> RawResponse:
        """POST `body` as JSON; the response as it arrived. A kept-alive connection that the server closed before
        answering a byte (HAProxy's old process closes its idle connections when it reloads) is retried once on a
        new connection, as HTTP clients do with a stale connection."""
        payload = json.dumps(body).encode()
        raw = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        reused = self._conn is not None and not self._conn.lost
        resp = await self._send(raw)
        if not resp.data and reused:
            resp = await self._send(raw)
        return resp

    async def _send(self, raw: bytes) -> RawResponse:
        if self._conn is None or self._conn.lost:
            self._conn = await _Connection.open(self.host, self.port)
        try:
            return await self._conn.request(raw)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None


def status_of(resp: RawResponse) -> int:
    """The response's HTTP status code (ConnectionError if none came, ValueError on a malformed status line)."""
    if not resp.data:
        raise ConnectionError("the connection closed before any response byte")
    line = resp.data.split(b"\r\n", 1)[0].split(b" ")
    if len(line) < 2 or not line[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP status line: {resp.data[:40]!r}")
    return int(line[1])


def sse_events(resp: RawResponse) -> list[SSEEvent]:
    """The `data:` events of a response's SSE body (chunked or not), each stamped with the arrival of its last byte."""
    data = resp.data
    head_end = data.find(b"\r\n\r\n") + 4
    if head_end < 4:
        return []
    body, raw_at = (
        _dechunk(data, head_end)
        if b"transfer-encoding: chunked" in data[:head_end].lower()
        else (
            data[head_end:],
            [(0, head_end, len(data) - head_end)],
        )
    )
    ends = [m[0] for m in resp.marks]
    events: list[SSEEvent] = []
    start = 0
    while (stop := body.find(b"\n\n", start)) >= 0:
        for line in body[start:stop].split(b"\n"):
            if line.startswith(b"data: "):
                raw_end = _raw_offset(raw_at, stop + 1) + 1  # the event's "\n\n" arrived with its second byte
                _, t, t_kernel = resp.marks[bisect.bisect_left(ends, raw_end)]
                events.append(SSEEvent(line[6:], t, t_kernel))
        start = stop + 2
    return events


def _dechunk(data: bytes, pos: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """A chunked body's bytes and its segments (body offset, raw offset, size)."""
    parts: list[bytes] = []
    segments: list[tuple[int, int, int]] = []
    size_total = 0
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            break
        size = int(data[pos:eol].split(b";", 1)[0], 16)
        if size == 0:
            break
        parts.append(data[eol + 2 : eol + 2 + size])
        segments.append((size_total, eol + 2, size))
        size_total += size
        pos = eol + 2 + size + 2
    return b"".join(parts), segments


def _raw_offset(segments: list[tuple[int, int, int]], body_offset: int) -> int:
    """Where body byte `body_offset` sits in the raw response."""
    i = bisect.bisect_right([s[0] for s in segments], body_offset) - 1
    body_start, raw_start, _ = segments[i]
    return raw_start + body_offset - body_start
