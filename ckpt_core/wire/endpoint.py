"""Whether a ZeroMQ endpoint is bound by anyone right now, as seen from the connecting side.

A ZeroMQ ``connect`` to an address nobody binds retries silently forever: an engine worker whose
parameter server gave the update up before the worker connected (its deadline passed, it was
stopped, its process died) would wait for its whole receive timeout. Each PS rank binds its handle
before its ``req_func`` runs, but every rank posts every rank's handle, so a worker may be told its
handle a little before its own rank bound it: ``PeerWatch.unbound`` (``wire/link.py``) believes an
endpoint gone when it saw it bound and then not, or never saw it bound for a grace of several
seconds. :func:`endpoint_bound` tells whether it is bound for
Unix-socket handles and answers ``None`` (cannot tell) for everything else, so that callers then
keep waiting exactly as before.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
import uuid

__all__ = ["endpoint_bound"]

PROC_UNIX = "/proc/net/unix"
_READ_BYTES = 1 << 20

_trust_lock = threading.Lock()
_trusted: dict[str, bool] = {}   # table path -> whether it lists a name bound here (checked once)


def endpoint_bound(handle: str) -> bool | None:
    """Whether ``handle``'s endpoint is bound by anyone right now: True, False, or None when this
    cannot be told (a transport other than ``ipc://``, no readable socket table). Never raises.

    - ``ipc://@name`` (an abstract Unix socket, Linux): ``@name`` is in the Path column of
      ``/proc/net/unix`` (this process's network namespace, the only one its connect can reach).
    - ``ipc:///path`` or ``ipc://relative/path``: no file there, or one that is not a socket: False.
      A socket file is not enough (ZeroMQ leaves it behind when its socket closes): its path must be
      in the same table too.

    "Not in the table" is believed only where the table lists a name this process binds for the
    purpose (once per process): a sandbox's table may be empty or partial.

    Example::

        endpoint_bound("ipc://@ckpt-u1-0")        # False once the PS rank closed its socket
        endpoint_bound("tcp://127.0.0.1:5555")     # None: cannot tell
    """
    try:
        if not isinstance(handle, str) or not handle.startswith("ipc://"):
            return None
        target = handle[len("ipc://"):]
        if not target or target == "*":
            return None
        if target.startswith("@"):
            return _in_table(target, PROC_UNIX)
        try:
            if not stat.S_ISSOCK(os.stat(target).st_mode):
                return False
        except FileNotFoundError:
            return False
        except (OSError, ValueError):   # no permission, a name the OS refuses: cannot tell
            return None
        found = {_in_table(name, PROC_UNIX) for name in (target, os.path.abspath(target))}
        return True if True in found else (None if None in found else False)
    except Exception:   # noqa: BLE001 - a probe must never fail the wait it serves
        return None


def _in_table(path: str, table: str) -> bool | None:
    """Whether ``path`` (``@name`` for an abstract name) is bound per ``table``; None: cannot tell.

    The kernel builds the table as it is read, a page or so per read: a socket closed elsewhere
    between two reads can shift a line out of sight. Absent is believed only when a second read
    agrees."""
    listed = _listed(path, table)
    if listed is None or listed:
        return listed
    listed = _listed(path, table)
    if listed is None or listed:
        return listed
    with _trust_lock:
        if table not in _trusted:
            _trusted[table] = _lists_own_name(table)
        trusted = _trusted[table]
    return False if trusted else None


def _listed(path: str, table: str) -> bool | None:
    """Whether ``path`` is in the table's Path column (each line's last field), or None when unreadable.

    Embedded NULs show as ``@``: a binder that passed the padded address length shows trailing ones."""
    chunks = []
    try:
        fd = os.open(table, os.O_RDONLY)
        try:
            while chunk := os.read(fd, _READ_BYTES):   # large reads: fewer places for a line to go missing
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError:
        return None
    text = b"".join(chunks)
    pattern = re.compile(rb" " + re.escape(path.encode("utf-8", "surrogateescape")) + rb"@*$", re.MULTILINE)
    return pattern.search(text) is not None


def _lists_own_name(table: str) -> bool:
    name = f"ckpt-endpoint-probe-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.bind("\0" + name)
            return bool(_listed("@" + name, table))
    except OSError:
        return False
