"""The channel between verl's two sides within one weight sync: a key-value store served by
trainer rank 0 (torch's ``TCPStore``: plain bytes, JSON values, never pickle).

Per round (one ``prepare`` of the master: a fresh round id), the keys are:

``{round}/metas``   trainer rank 0 sets it once the trainer ranks registered and gathered the
                    round's weights: ``{"name", "doc"}`` (the P2P metas document, ckpt_core's
                    ``get_metas()``), or ``{"error": ...}`` when the trainer side failed first;
                    every rollout worker waits for it.
``{round}/done``    a counter every rollout worker adds 1 to once its weights arrived.
``{round}/error``   the first failure of any rollout worker (``{"error": ...}``), kept first.

Trainer ranks keep their weights registered until every rollout worker counted itself done or
one reported an error; rollout workers wait for the metas. Every wait has a deadline, and a store
whose server (trainer rank 0) died is a ``TransportError`` at the next call.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from ckpt_core import errors
from ckpt_core.errors import CkptError, RemoteWorkerError, TransportError, UpdateTimeoutError

POLL_S = 0.02


def encode_error(exc: BaseException, where: str) -> dict:
    """An error as plain data: its class (when it is one of ckpt_core's) and where it happened."""
    kind = type(exc).__name__ if isinstance(exc, CkptError) and type(exc).__name__ in errors.__all__ \
        else "RemoteWorkerError"
    text = str(exc) if isinstance(exc, CkptError) else f"{type(exc).__name__}: {exc}"
    return {"type": kind, "message": f"{where}: {text}"}


def decode_error(data: dict) -> CkptError:
    """The same typed error on this side (a class of ckpt_core.errors, looked up by name only)."""
    kind = data.get("type") if isinstance(data, dict) else None
    cls = getattr(errors, kind, None) if kind in errors.__all__ else None
    message = str(data.get("message", "")) if isinstance(data, dict) else repr(data)
    return (cls if cls is not None else RemoteWorkerError)(message)


class Rendezvous:
    """One side's handle on the store; ``serve=True`` on trainer rank 0 (port 0: a free one)."""

    def __init__(self, addr: str, port: int, *, serve: bool, timeout_s: float):
        self.addr, self.timeout_s = addr, timeout_s
        try:
            self._store = dist.TCPStore(addr, port, is_master=serve, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:
            what = "serve" if serve else "reach"
            raise TransportError(f"cannot {what} the verl rendezvous store at {addr}:{port}: {exc}") from exc
        self.port = self._store.port

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.addr, self.port

    def _call(self, op: str, *args):
        try:
            return getattr(self._store, op)(*args)
        except (RuntimeError, OSError) as exc:   # DistNetworkError / DistStoreError
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            kind = UpdateTimeoutError if "imeout" in text or "imed out" in text else TransportError
            raise kind(f"verl rendezvous store {self.addr}:{self.port}: {op}({args[0]!r}) failed "
                       f"(trainer rank 0 serves it: did it die?): {text}") from exc

    # -- trainer side ------------------------------------------------------------
    def publish_metas(self, round_id: str, name: str, doc: dict) -> None:
        self._call("set", f"{round_id}/metas", json.dumps({"name": name, "doc": doc}))

    def publish_trainer_error(self, round_id: str, exc: BaseException, where: str) -> None:
        self._call("compare_set", f"{round_id}/metas", "", json.dumps({"error": encode_error(exc, where)}))

    def wait_rollouts(self, round_id: str, rollouts: int, timeout_s: float) -> None:
        """Until every rollout worker counted itself done; a reported error is raised as its type."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._call("check", [f"{round_id}/error"]):
                raise decode_error(json.loads(self._call("get", f"{round_id}/error")))
            done = self._call("add", f"{round_id}/done", 0)
            if done >= rollouts:
                return
            if time.monotonic() >= deadline:
                raise UpdateTimeoutError(f"{rollouts - done} of {rollouts} rollout worker(s) did not report "
                                         f"within {timeout_s:.0f} s (a rollout process died or hangs)")
            time.sleep(POLL_S)

    def forget(self, round_id: str) -> None:
        for key in ("metas", "done", "error"):
            self._call("delete_key", f"{round_id}/{key}")

    # -- rollout side ------------------------------------------------------------
    def wait_metas(self, round_id: str, timeout_s: float) -> tuple[str, dict]:
        key = f"{round_id}/metas"
        deadline = time.monotonic() + timeout_s
        while not self._call("check", [key]):   # polled: the store's own wait cannot be given a deadline per call
            if time.monotonic() >= deadline:
                raise UpdateTimeoutError(f"the trainer side published no weights within {timeout_s:.0f} s "
                                         f"(waiting for {key!r})")
            time.sleep(POLL_S)
        try:
            msg = json.loads(self._call("get", key))
        except ValueError as exc:
            raise errors.ProtocolError(f"{key!r} is not JSON") from exc
        if not isinstance(msg, dict):
            raise errors.ProtocolError(f"{key!r} is not a JSON object")
        if "error" in msg:
            raise decode_error(msg["error"])
        if not isinstance(msg.get("name"), str) or not isinstance(msg.get("doc"), dict):
            raise errors.ProtocolError(f"{key!r} lacks a checkpoint name or a metas document")
        return msg["name"], msg["doc"]

    def report_done(self, round_id: str) -> None:
        self._call("add", f"{round_id}/done", 1)

    def report_error(self, round_id: str, exc: BaseException, where: str) -> None:
        self._call("compare_set", f"{round_id}/error", "", json.dumps(encode_error(exc, where)))
