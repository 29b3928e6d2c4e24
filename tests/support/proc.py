"""What the kernel says about sockets and processes (Linux /proc), for tests that check what really listens
and what is left running. No psutil: the socket table and the process list are plain files."""

from __future__ import annotations

import os
import socket
import struct

_LISTEN = "0A"


def _addr(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    words = struct.unpack(">4I", raw)  # four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", w) for w in words))


def _listen_table() -> dict[str, tuple[str, int]]:
    """Socket inode -> (local address, port) of every TCP socket in LISTEN state (IPv4 and IPv6 tables)."""
    out = {}
    for name, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            host, hex_port = local.split(":")
            if state == _LISTEN:
                addr = _addr(host, v6)
                out[inode] = (addr.removeprefix("::ffff:") if "." in addr else addr, int(hex_port, 16))  # v4-mapped
    return out


def listening(port: int) -> list[str]:
    """Local addresses with a TCP socket in LISTEN state on `port` (IPv4 and IPv6 tables)."""
    return [addr for addr, p in _listen_table().values() if p == port]


def listeners(pids) -> dict[int, list[tuple[str, int]]]:
    """pid -> the (address, port) its TCP sockets listen on, for those of `pids` that listen at all."""
    table, out = _listen_table(), {}
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone, or an fd closed between the listing and the readlink
            continue
        found = [table[link[8:-1]] for link in links if link.startswith("socket:[") and link[8:-1] in table]
        if found:
            out[pid] = found
    return out


def descendants(roots) -> set[int]:
    """`roots` and every live process below them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read() if entry.isdigit() else ""
        except OSError:
            continue
        if stat:
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    out, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def pids_with_cmdline(text: str) -> list[int]:
    """Live processes whose command line contains `text` (e.g. a Ray session's directory)."""
    want, pids = text.encode(), []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and want in open(f"/proc/{entry}/cmdline", "rb").read():
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def session_pids(sid: int) -> list[int]:
    """Processes still alive in session `sid` (start a child with start_new_session=True: its pid is the sid)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            pids.append(int(entry))
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far (all its threads)."""
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pids_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has name=value (children inherit it, whatever session they start)."""
    want, pids = f"{name}={value}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if want in env and state != "Z":
            pids.append(int(entry))
    return pids
