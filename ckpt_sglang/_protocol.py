"""What our SGLang client and our loader inside SGLang's scheduler say to each other.

SGLang runs user code inside its scheduler process at one place: a custom weight loader, named
at start (``--custom-weight-loader ckpt_sglang.staging.load``) and called by
``/update_weights_from_tensor`` with ``load_format`` set to that name, as
``loader(model, named_tensors)``. Its answer is fixed ("Success"), and an exception there ends
the scheduler (SGLang quits the server), so the loader never raises and answers on a socket of
its own:

1. The client binds a ZeroMQ PULL socket (``ipc://@ckpt-sglang-reply-<id>``: same host, as the
   IPC buffers of an update are) and posts ``/update_weights_from_tensor`` whose one named tensor
   is ``COMMAND_TENSOR``: the UTF-8 bytes of a JSON command (``encode_command``: the op, its
   fields, the server's ``tp_size`` and the client's ``timeout``), one copy per tensor-parallel
   rank of the server.
2. The loader on every rank decodes it (``decode_command``: format, version, op and fields
   checked), agrees with the other TP ranks (``_agree.py``, over SGLang's own TP group: every
   rank reaches the same outcome), does the op, and PUSHes one JSON reply (``reply``) with its TP
   rank: ``ok``, the op's ``result`` or an ``error`` and its type. Nothing else is ever sent back.
3. The client collects one reply per rank (``ReplySocket.collect``) within its timeout; a rank
   that does not answer is an ``UpdateTimeoutError`` naming the op, two replies from one rank a
   ``ProtocolError``.

SGLang unpickles the ``serialized_named_tensors`` it is given (its ``SafeUnpickler``, torch
types only). So the client *encodes* one pickle here: a list of one ``(str, uint8 tensor)``
pair, made with the standard pickler (its tensor's bytes travel by value). Our side never
unpickles anything; the replies are JSON.
"""

from __future__ import annotations

import base64
import json
import pickle
import uuid
from typing import Any

from ckpt_core.errors import ConfigError, ProtocolError, RemoteWorkerError, UpdateTimeoutError

__all__ = ["LOADER", "PROBE_LOADER", "COMMAND_TENSOR", "OPS", "encode_command", "decode_command", "ReplySocket"]

LOADER = "ckpt_sglang.staging.load"     # what --custom-weight-loader must name
PROBE_LOADER = "ckpt_sglang.probe.load"   # reads the model (state digests); named beside LOADER
COMMAND_TENSOR = "ckpt_sglang.command"
FORMAT, VERSION = "ckpt-sglang/command", 1
OPS = ("stage", "commit", "load", "drop", "state", "digests")   # the last one: PROBE_LOADER's
MAX_REPLY = 1 << 20


def encode_command(op: str, reply: str, tp_size: int, **fields: Any) -> list[str]:
    """``serialized_named_tensors`` for ``/update_weights_from_tensor``: one base64 payload per TP rank."""
    import torch

    if op not in OPS:
        raise ConfigError(f"unknown op {op!r}; one of {OPS}")
    body = json.dumps({"format": FORMAT, "version": VERSION, "op": op, "reply": reply, "tp_size": int(tp_size),
                       **fields}).encode()
    tensor = torch.frombuffer(bytearray(body), dtype=torch.uint8).clone()
    payload = base64.b64encode(pickle.dumps([(COMMAND_TENSOR, tensor)])).decode()
    return [payload] * int(tp_size)


def decode_command(named_tensors) -> dict:
    """The command a loader was given; ``ProtocolError`` for anything else."""
    items = list(named_tensors)
    if len(items) != 1 or items[0][0] != COMMAND_TENSOR:
        names = [n for n, _ in items][:4]
        raise ProtocolError(f"expected one tensor {COMMAND_TENSOR!r}, got {len(items)} ({names})")
    tensor = items[0][1]
    try:
        cmd = json.loads(bytes(tensor.detach().cpu().contiguous().numpy().tobytes()).decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"the command tensor is not JSON: {exc}") from exc
    if not isinstance(cmd, dict) or cmd.get("format") != FORMAT or cmd.get("version") != VERSION:
        raise ProtocolError(f"not a {FORMAT} v{VERSION} command")
    if cmd.get("op") not in OPS or not isinstance(cmd.get("reply"), str):
        raise ProtocolError(f"bad command: op {cmd.get('op')!r}, reply {cmd.get('reply')!r}")
    return cmd


def loader_tp_rank() -> int:
    """Loader side: this scheduler's TP rank, as its replies name it."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:   # noqa: BLE001 - outside a published SGLang context: one rank
        return 0


def reply(ctx, address: str, message: dict, timeout_s: float = 10.0) -> None:
    """Loader side: send one JSON reply (best effort; the client times out if it never arrives)."""
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(address)
        sock.send(json.dumps(message, default=str).encode())
    finally:
        sock.close()


class ReplySocket:
    """Client side: the PULL socket one op's replies come back on; ``close()`` is idempotent."""

    def __init__(self):
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY)
        self.address = f"ipc://@ckpt-sglang-reply-{uuid.uuid4().hex}"
        self._sock.bind(self.address)

    def collect(self, op: str, ranks: int, timeout_s: float, where: str) -> list[dict | None]:
        """Each TP rank's result, in rank order (an op's dict, or None: ``drop`` with nothing staged);
        a failing rank raises ``RemoteWorkerError`` (the loader's error type and message, all failing
        ranks named)."""
        import time

        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < ranks:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                raise UpdateTimeoutError(f"{where}: {op}: {ranks - len(got)} of {ranks} rank(s) did not answer "
                                         f"within {timeout_s:g} s (is the server started with "
                                         f"--custom-weight-loader {LOADER}?)")
            try:
                msg = json.loads(self._sock.recv(self._zmq.NOBLOCK).decode())
                rank = int(msg["tp_rank"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                raise ProtocolError(f"{where}: {op}: a reply that is not ours ({exc})") from exc
            if rank in got:   # e.g. a loader that could not find its TP group answers as rank 0 everywhere
                raise ProtocolError(f"{where}: {op}: TP rank {rank} answered twice (last: {msg.get('error_type')}: "
                                    f"{msg.get('error')})")
            got[rank] = msg
        failed = [m for _, m in sorted(got.items()) if not m.get("ok")]
        if failed:
            first = failed[0]
            raise RemoteWorkerError(f"{where}: {op} failed on TP rank(s) {[m['tp_rank'] for m in failed]}: "
                                    f"{first.get('error_type')}: {first.get('error')}", rank=first["tp_rank"],
                                    remote_traceback=first.get("traceback"))
        return [m.get("result") for _, m in sorted(got.items())]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "ReplySocket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
