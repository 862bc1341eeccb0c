"""Faults injected into a PS rank process (through ``PsWorld``'s ``call`` command) to end an update
at a chosen state of the stock worker's handshake (tests/integration/test_compat_stock_abort.py)."""

from __future__ import annotations

import time

from ckpt_core.errors import TransportError


def fail_next_ipc_alloc(ps, rank: int, hold_until_connected: bool = False) -> None:
    """This rank's next IPC buffer allocation fails, as on a device out of memory: the rank fails
    before its handshake. ``hold_until_connected``: it reports that only once its stock worker has
    connected, so the worker is connected and still waits for its buffer handle when the abort comes."""
    ctx = ps._ctx
    original_alloc, original_handshake = ps.backend.alloc_ipc, ctx.handshake

    def alloc(nbytes, index, name):
        del ps.backend.alloc_ipc   # once: the next update allocates normally
        raise TransportError(f"injected: no device memory for {nbytes} bytes on rank {rank}")

    def handshake(link, hello, publish, **kwargs):
        del ctx.handshake
        deadline = time.monotonic() + 60
        while not link.watch.seen:
            assert time.monotonic() < deadline, "the stock worker never connected"
            link.watch.drain()
            time.sleep(0.01)
        return original_handshake(link, hello, publish, **kwargs)

    ps.backend.alloc_ipc = alloc
    if hold_until_connected:
        ctx.handshake = handshake
    assert original_alloc is not None


def fail_after_buffer(ps, rank: int, name: str) -> None:
    """This rank fails right after its stock worker mapped the buffer (a source check that finds the
    checkpoint changed): the worker is connected, holds the buffer and waits for a bucket."""
    ckpt = ps._catalog.checkpoints[name]

    def problem():
        del ckpt.source_problem
        return f"injected: the checkpoint changed on rank {rank} after the handshake"

    ckpt.source_problem = problem
