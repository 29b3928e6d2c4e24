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


def listening(port: int) -> list[str]:
    """Local addresses with a TCP socket in LISTEN state on `port` (IPv4 and IPv6 tables)."""
    out = []
    for name, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            host, hex_port = local.split(":")
            if state == _LISTEN and int(hex_port, 16) == port:
                addr = _addr(host, v6)
                out.append(addr.removeprefix("::ffff:") if "." in addr else addr)  # v4-mapped: the v4 address
    return out


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
