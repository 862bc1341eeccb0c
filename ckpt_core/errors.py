"""The one exception hierarchy of ckpt-engine.

Every error that bad input, a peer, a file or the configuration can cause is a
subclass of :class:`CkptError`. Third-party errors are translated at one seam
with ``raise ... from``. Each class also derives from the builtin that
checkpoint-engine raises in the same situation (it asserts on misuse, raises
``RuntimeError`` for an unknown checkpoint or a remote failure, ``ValueError``
for bad files), so ``except`` clauses written for it keep catching.
"""

from __future__ import annotations

__all__ = [
    "CkptError",
    "ConfigError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "TransportError",
    "UpdateTimeoutError",
    "ProtocolError",
    "RemoteWorkerError",
    "DeltaBaseError",
    "DeviceResidentError",
    "ClosedError",
]


class CkptError(Exception):
    """Base of every error raised by ckpt-engine."""


class ConfigError(CkptError, ValueError, AssertionError):
    """Invalid argument, setting or environment variable, or API misuse (the reference asserts)."""


class CheckpointFormatError(CkptError, ValueError):
    """A checkpoint file or tensor set is malformed (corrupt header, bad offsets, wrong sizes)."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        where = []
        if path:
            where.append(f"file {path!r}")
        if tensor:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path = path
        self.tensor = tensor


class CheckpointNotFoundError(CkptError, KeyError, RuntimeError):
    """An operation named a checkpoint that is not registered (the reference: RuntimeError)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return str(self.args[0]) if self.args else ""


class TransportError(CkptError, RuntimeError):
    """Moving bytes failed: a collective, an IPC buffer, a socket, a peer went away."""

    pending: object = None   # a transfer still in flight when it was raised (a P2P read's future), or None


class UpdateTimeoutError(TransportError, TimeoutError):
    """A wait ran past its deadline. The message names what was awaited."""


class ProtocolError(CkptError, ValueError):
    """A message on the PS <-> worker wire is malformed, foreign or out of order."""


class RemoteWorkerError(CkptError, RuntimeError):
    """An engine worker (or a PS rank) failed; carries the rank and the remote traceback text."""

    def __init__(self, message: str, *, rank: int | None = None, device_key: str | None = None,
                 remote_traceback: str | None = None):
        head = message
        if rank is not None:
            head = f"[rank {rank}] {head}"
        if device_key:
            head = f"{head} (device {device_key})"
        if remote_traceback:
            head = f"{head}\n--- remote traceback ---\n{remote_traceback.rstrip()}"
        super().__init__(head)
        self.rank = rank
        self.device_key = device_key
        self.remote_traceback = remote_traceback


class DeltaBaseError(ConfigError):
    """A delta update whose base is not the version the engines hold (a skipped or replayed
    version, a restarted engine), or whose base is not registered: refused before anything is written."""


class DeviceResidentError(ConfigError):
    """A checkpoint registered on the device (``on_device=True``) asked for what needs host bytes (a
    delta, P2P serving or pulls), or tensors that cannot be registered in place (another device,
    not contiguous): refused before anything is kept or moved."""


class ClosedError(CkptError, RuntimeError):
    """An object was used after close()."""
