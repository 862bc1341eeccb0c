"""Which TCP sockets this process listens on (Linux ``/proc``): for the P2P store's exposure log
and for tests that check that ``close()`` left nothing listening."""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["listening_sockets"]


def _inodes(pid) -> set[int]:
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:   # closed meanwhile
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = struct.unpack("<4I", raw)   # /proc prints IPv6 as four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words)), int(port, 16)


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket of process ``pid`` in the LISTEN state, sorted;
    ``0.0.0.0`` and ``::`` mean every interface. ``[]`` where /proc cannot be read."""
    mine, out = _inodes(pid), set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[9]) in mine:
                out.add(_address(fields[1]))
    return sorted(out)
