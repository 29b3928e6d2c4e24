"""service.frontdoor_client, the frontdoor bench's lean streaming client, against a raw asyncio HTTP server that splits
its writes anywhere (mid chunk-size line, mid event), keeps the connection alive between requests, answers an error
with a Content-Length body, or closes mid-response:
- the SSE events parsed after the response are the events sent, in order, whatever the splits;
- each event is stamped no earlier than the moment its last byte was written, and no later than the next write;
- two requests share one connection; a closed connection is reopened; a cut chunked response is an error.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
import time

import pytest

from service.frontdoor_client import (
    SO_TIMESTAMPNS,
    RawResponse,
    StreamingClient,
    _kernel_time,
    kernel_receive_times,
    sse_events,
    status_of,
)

EVENTS = [json.dumps({"choices": [{"text": t}]}).encode() for t in ("a", "b c", 'q"uote', "é")] + [b"[DONE]"]


def _chunked(events: list[bytes]) -> list[bytes]:
    """The SSE body as HTTP chunks, one an event, then the last chunk."""
    out = []
    for e in events:
        data = b"data: " + e + b"\n\n"
        out.append(b"%x\r\n%b\r\n" % (len(data), data))
    return [*out, b"0\r\n\r\n"]


class _Server:
    """Answers each request on a connection from a script of writes: (bytes, pause before the next write)."""

    def __init__(self, script):
        self.script = script  # (request number) -> list of (bytes, pause_s), or "close" after them
        self.connections = 0
        self.requests = 0  # over all connections: the script's request number
        self.write_times: list[tuple[bytes, float, float]] = []  # (bytes, before the write, after it)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length")
                )
                await reader.readexactly(length)
                writes, close = self.script(self.requests)
                self.requests += 1
                for data, pause in writes:
                    before = time.time()
                    writer.write(data)
                    await writer.drain()
                    self.write_times.append((data, before, time.time()))
                    await asyncio.sleep(pause)
                if close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def _split_everywhere(parts: list[bytes], step: int) -> list[bytes]:
    raw = b"".join(parts)
    return [raw[i : i + step] for i in range(0, len(raw), step)]


async def _serve(script):
    server = _Server(script)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    return server, srv, srv.sockets[0].getsockname()[1]


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_events_survive_any_split_and_are_stamped_by_their_last_byte(step):
    async def main():
        pieces = _split_everywhere([HEAD, *_chunked(EVENTS)], step)
        server, srv, port = await _serve(lambda n: ([(p, 0.002 if step > 1 else 0.0) for p in pieces], False))
        client = StreamingClient("127.0.0.1", port)
        try:
            first = await client.post_json("/v1/completions", {"prompt": [1]})
            second = await client.post_json("/v1/completions", {"prompt": [2]})
        finally:
            client.close()
            srv.close()
        return server, first, second

    server, first, second = asyncio.run(main())
    assert server.connections == 1  # keep-alive: both requests on one connection
    for resp in (first, second):
        assert status_of(resp) == 200
        events = sse_events(resp)
        assert [e.payload for e in events] == EVENTS
        assert [e.t for e in events] == sorted(e.t for e in events)
    if step == 1000:  # one write: every event arrived with it
        assert len({e.t for e in sse_events(first)}) == 1
    else:  # each event's stamp is no earlier than the write that completed it (the server's clock is ours)
        writes = server.write_times[: len(_split_everywhere([HEAD, *_chunked(EVENTS)], step))]
        raw = b"".join(w for w, _, _ in writes)
        for e in sse_events(first):
            end = raw.index(b"data: " + e.payload + b"\n\n") + len(e.payload) + 8
            k = next(k for k in range(len(writes)) if sum(len(w) for w, _, _ in writes[: k + 1]) >= end)
            assert e.t >= writes[k][2] - 0.001
            # the kernel received the event's last byte during that write (loopback: within the send), before the
            # loop read it
            if sys.platform.startswith("linux"):
                assert writes[k][1] - 0.001 <= e.t_kernel <= e.t
        # the kernel's own times, not only the fallback (the loop's), where the kernel stamps at all: CI's sandbox gave
        # some read no stamp (stop 50), so one kernel-stamped event of the two responses is what is asserted
        if kernel_receive_times():
            assert any(e.t_kernel < e.t for resp in (first, second) for e in sse_events(resp))


def test_a_read_takes_the_kernel_time_from_its_ancillary_data_else_the_loops():
    stamp = struct.pack("@qq", 1_700_000_000, 250_000_000)
    assert _kernel_time([(socket.SOL_SOCKET, SO_TIMESTAMPNS, stamp)], 5.0) == pytest.approx(1_700_000_000.25)
    assert _kernel_time([], 5.0) == 5.0  # no stamp (a sandbox's kernel): the loop's time
    assert _kernel_time([(socket.IPPROTO_IP, 1, stamp)], 5.0) == 5.0  # another option's data is not a time


def test_an_error_answer_with_a_length_and_a_reopened_connection():
    body = b'{"error": "busy"}'
    error = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body)

    async def main():
        server, srv, port = await _serve(
            lambda n: (
                ([(error, 0.0)], True) if n == 0 else ([(HEAD, 0.0), *((c, 0.0) for c in _chunked(EVENTS))], False)
            )
        )
        client = StreamingClient("127.0.0.1", port)
        try:
            failed = await client.post_json("/v1/completions", {})
            await asyncio.sleep(0.05)  # the server's close arrives
            ok = await client.post_json("/v1/completions", {})
        finally:
            client.close()
            srv.close()
        return server, failed, ok

    server, failed, ok = asyncio.run(main())
    assert status_of(failed) == 503 and failed.data.endswith(body)
    assert status_of(ok) == 200 and [e.payload for e in sse_events(ok)] == EVENTS
    assert server.connections == 2


def test_a_chunked_response_cut_short_is_an_error():
    async def main():
        server, srv, port = await _serve(lambda n: ([(HEAD, 0.0), (_chunked(EVENTS)[0], 0.01)], True))
        client = StreamingClient("127.0.0.1", port)
        try:
            with pytest.raises(ConnectionError):
                await client.post_json("/v1/completions", {})
        finally:
            client.close()
            srv.close()

    asyncio.run(main())


def test_a_malformed_status_line_is_a_value_error():
    with pytest.raises(ValueError, match="not an HTTP status line"):
        status_of(RawResponse(b"garbage\r\n\r\n", ((11, 0.0, 0.0),)))


def test_a_kept_alive_connection_closed_unanswered_is_retried_on_a_new_one():
    """HAProxy's old process closes its idle connections when it reloads: a request that met such a close got no byte
    back and is sent again, once, on a new connection."""

    async def main():
        answer = [(HEAD, 0.0), *((c, 0.0) for c in _chunked(EVENTS))]
        server, srv, port = await _serve(lambda n: (answer, False) if n != 1 else ([], True))
        client = StreamingClient("127.0.0.1", port)
        try:
            first = await client.post_json("/v1/completions", {})
            second = await client.post_json("/v1/completions", {})  # closed unanswered, then answered
        finally:
            client.close()
            srv.close()
        return server, first, second

    server, first, second = asyncio.run(main())
    assert [e.payload for e in sse_events(first)] == [e.payload for e in sse_events(second)] == EVENTS
    assert server.connections == 2 and server.requests == 3
