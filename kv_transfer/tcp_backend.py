"""Dependency-free backend: the prefill worker serves page bytes over a plain TCP socket, the decode worker pulls.

Why TCP: it needs nothing beyond the standard library, works between any two hosts (shared memory would not),
and executes the very same `TransferPlan` as NIXL, so it doubles as the byte-identical reference.

Wire protocol (one connection per pulled request; a frame = 4-byte little-endian length + UTF-8 JSON):
  decode -> prefill  {"op": "read", "rid", "fingerprint", "ranges": [[group, src_offset, length], ...]}
  prefill -> decode  {"ok": true, "nbytes": N} then the N bytes of the ranges in order, or {"ok": false, "error"}
  decode -> prefill  {"op": "done"}   after the last byte landed (the prefill side may now free the pages)
A failed pull opens a short connection with {"op": "fail", "rid", "error"}. The server checks every requested
range lies inside pages exported for that request, so a peer can read nothing else. With a `token` (the
service's per-cluster secret, handed to both sides through Ray, never in the metadata) every request frame
must carry it ("token"), compared in constant time, or the connection is closed unanswered.
The listener binds `host`: loopback by default; the service passes the node's address on multi-node clusters.
Memory: pages are sent straight from the pool tensor and received straight into it (no staging copy) for CPU
pools; CUDA pools stage through host memory.
Metadata: JSON header with the advertised host and port (no payload); ship it through Ray like NIXL's.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import socket
import struct
import threading
import time

import torch

from engine.model.cache import CachePool
from kv_transfer.base import (
    TransferBackend,
    TransferError,
    TransferTicket,
    TransferTimeout,
    check_deadline,
    pack_metadata,
)
from kv_transfer.plan import TransferPlan, group_nbytes, page_bytes

log = logging.getLogger(__name__)
_MAX_FRAME = 64 << 20  # a read request lists ranges; anything larger is garbage


class _Refused(Exception):
    """A read request the server will not serve (unknown request, pages not exported, wrong layout)."""


def _send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None, what: str) -> None:
    """Fill `view` from `sock`; with a deadline each recv waits at most the time left."""
    pos = 0
    while pos < len(view):
        if deadline is not None:
            sock.settimeout(check_deadline(deadline, what))
        try:
            n = sock.recv_into(view[pos:])
        except TimeoutError:
            raise TransferTimeout(f"{what}: timed out after {pos} of {len(view)} bytes") from None
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {pos} of {len(view)} bytes")
        pos += n


def _recv_frame(sock: socket.socket, deadline: float | None, what: str) -> dict:
    head = bytearray(4)
    _recv_exact(sock, memoryview(head), deadline, what)
    (n,) = struct.unpack("<I", head)
    if n > _MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes is too large")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body), deadline, what)
    return json.loads(body)


class TcpBackend(TransferBackend):
    name = "tcp"

    def __init__(
        self,
        pool: CachePool,
        worker_name: str | None = None,
        lease_s: float = 120.0,
        on_release=None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        io_timeout_s: float = 60.0,
        token: str | None = None,
    ):
        """host/port: where to listen (port 0 = any free one). For peers on other hosts listen on the node's IP
        (e.g. ray.util.get_node_ip_address()) or on 0.0.0.0 with advertise_host set."""
        super().__init__(pool, worker_name, lease_s, on_release)
        # Flat byte views of each group tensor, made once (the TCP analogue of memory registration).
        self._bytes = {n: g.tensor.view(-1).view(torch.uint8) for n, g in pool.groups.items()}
        self._np = {n: b.numpy() for n, b in self._bytes.items() if b.device.type == "cpu"}
        self.io_timeout_s = io_timeout_s  # server side: a stuck decode peer cannot pin a thread forever
        self._token = (token or "").encode()
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (rid, error) from server threads to poll()
        self._server = socket.create_server((host, port))
        self._closed = threading.Event()
        self.address = (
            advertise_host or (socket.gethostbyname(socket.gethostname()) if host == "0.0.0.0" else host),
            self._server.getsockname()[1],
        )
        self._peers: dict[str, tuple[str, int]] = {}
        threading.Thread(target=self._accept_loop, name=f"kvx-tcp-{self.worker_name}", daemon=True).start()

    # ---- handshake ---------------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return pack_metadata(self._header(host=self.address[0], port=self.address[1]))

    def _add_peer(self, name: str, header: dict, payload: bytes) -> None:
        self._peers[name] = (str(header["host"]), int(header["port"]))

    def remove_peer(self, name: str) -> None:
        super().remove_peer(name)
        self._peers.pop(name, None)

    # ---- server (prefill side) ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # listening socket closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        rid = None
        with conn:
            conn.settimeout(self.io_timeout_s)
            try:
                req = _recv_frame(conn, None, "read request")
                if not hmac.compare_digest(str(req.get("token", "")).encode(), self._token):
                    log.warning("%s: refused a transfer request without the cluster token", self.worker_name)
                    return
                rid = str(req["rid"])
                if req["op"] == "fail":
                    self._events.put((rid, f"decode side failed the transfer: {req.get('error', '?')}"))
                    return
                views = self._check_read(req)
                try:
                    _send_frame(conn, {"ok": True, "nbytes": sum(len(v) for v in views)})
                    for v in views:
                        conn.sendall(v)
                finally:
                    self._end_read(rid)  # the pages have been read: a release may free them now
                if _recv_frame(conn, None, "confirmation").get("op") == "done":
                    self._events.put((rid, None))
                    return
                raise ConnectionError("expected a 'done' confirmation")
            except _Refused as e:  # a bad request: answer it, keep the export (the lease still runs)
                try:
                    _send_frame(conn, {"ok": False, "error": str(e)})
                except OSError:
                    pass
            except (OSError, TransferError, ValueError, KeyError, TypeError) as e:  # dead / stuck decode side
                if rid is not None and rid in self.exported():
                    self._events.put((rid, f"decode side disconnected before confirming: {e}"))

    def _check_read(self, req: dict) -> list[memoryview]:
        """The byte views a read request asks for, after checking they lie in the request's exported pages."""
        rid = str(req["rid"])
        if req.get("fingerprint") != self.fingerprint:
            raise _Refused(f"layout {req.get('fingerprint')} != {self.fingerprint}")
        export = self._begin_read(rid)  # pinned until _serve's _end_read: its lease cannot end under the read
        if export is None:
            raise _Refused(
                f"request {rid!r} is not exported by {self.worker_name} (never, released, or its lease "
                f"ends too soon to read)"
            )
        try:
            return self._views(rid, export, req["ranges"])
        except BaseException:
            self._end_read(rid)
            raise

    def _views(self, rid: str, export, ranges) -> list[memoryview]:
        views = []
        for name, off, length in ranges:
            if name not in self.pool.groups:
                raise _Refused(f"no cache group {name!r}")
            spec = self.pool.groups[name].spec
            pb, allowed = page_bytes(spec), set(export.table.get(name, ()))
            off, length = int(off), int(length)
            if off % pb or length % pb or length <= 0 or off + length > group_nbytes(spec):
                raise _Refused(f"group {name!r}: range ({off}, {length}) is not page-aligned or out of bounds")
            bad = {k % spec.num_pages for k in range(off // pb, (off + length) // pb)} - allowed
            if bad:
                raise _Refused(f"group {name!r}: pages {sorted(bad)} are not exported for request {rid!r}")
            if name in self._np:
                views.append(self._np[name][off : off + length].data)  # .data: the array's memoryview
            else:  # device memory: stage through the host
                views.append(self._bytes[name][off : off + length].cpu().numpy().data)
        return views

    def _confirmations(self) -> list[tuple[str, str | None]]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    # ---- client (decode side) ----------------------------------------------------------------------------
    def _connect(self, ticket: TransferTicket, deadline: float, what: str) -> socket.socket:
        addr = self._peers[ticket.source]
        try:
            return socket.create_connection(addr, timeout=check_deadline(deadline, what))
        except TimeoutError:
            raise TransferTimeout(f"{what}: connecting to {addr} timed out") from None
        except OSError as e:
            raise TransferError(f"{what}: cannot connect to {addr}: {e}") from e

    def _read(self, ticket: TransferTicket, plan: TransferPlan, deadline: float) -> None:
        what = f"TCP pull of request {ticket.request_id!r} from {ticket.source!r}"
        ranges = [(g.name, r) for g in plan.groups for r in g.ranges]
        with self._connect(ticket, deadline, what) as sock:
            try:
                _send_frame(
                    sock,
                    {
                        "op": "read",
                        "token": self._token.decode(),
                        "rid": ticket.request_id,
                        "fingerprint": ticket.fingerprint,
                        "ranges": [[n, r.src_offset, r.length] for n, r in ranges],
                    },
                )
                reply = _recv_frame(sock, deadline, what)
                if not reply.get("ok"):
                    raise TransferError(f"{what}: source refused: {reply.get('error')}")
                t0 = time.monotonic()
                for name, r in ranges:
                    if name in self._np:  # straight into the pool tensor
                        _recv_exact(sock, self._np[name].data[r.dst_offset : r.dst_offset + r.length], deadline, what)
                    else:
                        buf = bytearray(r.length)
                        _recv_exact(sock, memoryview(buf), deadline, what)
                        self._bytes[name][r.dst_offset : r.dst_offset + r.length].copy_(
                            torch.frombuffer(buf, dtype=torch.uint8)
                        )
                self._on_wire(time.monotonic() - t0)
                sock.settimeout(check_deadline(deadline, what))
                _send_frame(sock, {"op": "done"})
            except TimeoutError:
                raise TransferTimeout(f"{what}: timed out") from None
            except OSError as e:
                raise TransferError(f"{what}: connection failed: {e}") from e

    def _notify(self, ticket: TransferTicket, error: str) -> None:
        addr = self._peers.get(ticket.source)
        if addr is None:
            return
        try:  # bounded: a dead source must not delay the failure of the request
            with socket.create_connection(addr, timeout=1.0) as sock:
                sock.settimeout(1.0)
                _send_frame(
                    sock, {"op": "fail", "token": self._token.decode(), "rid": ticket.request_id, "error": error}
                )
        except OSError as e:
            log.info("could not report failed pull of %s to %s: %s", ticket.request_id, ticket.source, e)

    def close(self) -> None:
        super().close()
        self._closed.set()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self._server.close()
