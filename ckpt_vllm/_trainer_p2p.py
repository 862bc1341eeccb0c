"""A trainer round of the ``ckpt`` vLLM backend when the trainer's devices are not the engine's.

Selected by ``CkptTrainerInitInfo(p2p_services=[...])``. The trainer ranks are P2P owners only
(``ParameterServer(serve_p2p=True)``, no engine worker beside them): each registers its share, the
ranks gather metas, and rank 0 (the sender) hands the metas document to the engine's own PS world,
the ranks its workers started (managed mode, ``CKPT_ENGINE_SERVE``), through their services:

1. ``POST /v1/metas`` on every managed rank: the owners' metas (JSON; validated whole there);
2. ``POST /v1/checkpoints/{name}/update`` on every managed rank with ``ranks`` = all of them and
   ``update_url`` (the engine's ``/collective_rpc``, reached from the engine's host) on rank 0: the
   managed ranks read the owners' host memory over Mooncake (RDMA or TCP; each byte crosses between
   the hosts once, checked against the digest its owner took), broadcast it among themselves and
   feed their workers as a colocated update does;
3. the typed answer (``ServiceWorld``: the ``ckpt_core.errors`` class of the first failing rank) is
   the round's outcome, which every trainer rank learns in one exchange (:func:`agree_outcome`), so
   every rank returns the same result or raises the same error class with the same message. The
   owners keep their tensors registered until that exchange: nothing they serve is freed while the
   engine's PS world may still read it.

Every wait is bounded: each service request by the round's ``timeout_s`` (plus :data:`MARGIN_S`),
the other ranks' exchange by ``PS_COLLECTIVE_TIMEOUT_S``. Nothing crosses as pickle: the metas and
the answers are JSON.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ckpt_core import errors
from ckpt_core.client import ServiceWorld
from ckpt_core.errors import CkptError, ConfigError

from ._trainer_sender import translated

__all__ = ["EnginePull", "agree_outcome", "check_services", "MARGIN_S"]

log = logging.getLogger("ckpt_vllm")
MARGIN_S = 15.0   # beyond the round's timeout: the service's own answer after its update timed out


def check_services(services: Any) -> list[str]:
    """``p2p_services`` as a list of endpoints (Unix socket paths or http(s) URLs), rank 0 first."""
    given = [services] if isinstance(services, str) else services
    if not isinstance(given, Sequence) or not given or not all(isinstance(s, str) and s for s in given):
        raise ConfigError("p2p_services must be the engine's managed PS services, rank 0 first: a list of Unix "
                          f"socket paths or http(s)://host:port URLs, got {services!r}")
    for s in given:
        if not (s.startswith(("http://", "https://", "unix:")) or s.startswith("/")):
            raise ConfigError(f"p2p_services entry {s!r} is neither a Unix socket path nor an http(s) URL")
    return list(given)


class EnginePull:
    """Rank 0's requests to the engine's managed PS world: load the owners' metas, pull, answer.

    ``update_url``: the engine's ``/collective_rpc`` as the managed PS rank 0 reaches it (the
    service's policy must allow it: any loopback host by default, else ``engine-url=`` in
    ``CKPT_ENGINE_SERVE``). ``close()`` is idempotent.
    """

    def __init__(self, services: list[str], update_url: str, *, token: str | None, timeout_s: float) -> None:
        self.update_url, self.timeout_s = update_url, float(timeout_s)
        self.world = ServiceWorld(services, token=token, timeout=self.timeout_s, margin_s=MARGIN_S)
        self.ranks = list(range(self.world.world_size))

    def pull(self, doc: dict, name: str) -> dict:
        """The engine's PS world pulls checkpoint ``name`` of ``doc`` into the engine; its rank 0's result."""
        t0 = time.monotonic()
        self.world.call("POST", "/v1/metas", [doc] * len(self.ranks), timeout=self.timeout_s)
        left = max(1.0, self.timeout_s - (time.monotonic() - t0))
        result = self.world.update(name, update_url=self.update_url, ranks=self.ranks, timeout=left)
        result = dict(result or {})
        result.setdefault("seconds", {})["pull"] = time.monotonic() - t0
        return result

    def close(self) -> None:
        self.world.close()


def agree_outcome(ps, run) -> dict:
    """Every trainer rank's outcome of the round: ``run()`` on the sender (``run`` None elsewhere), its
    result or error told to every rank in one exchange (``ps.all_gather_json``). The sender raises its
    own error; the others the same class, with the same message. An exchange that fails (a trainer
    rank is gone) raises the sender's own error where it has one, else the exchange's."""
    outcome: dict[str, Any] = {}
    mine: CkptError | None = None
    if run is not None:
        try:
            outcome = {"result": run()}
        except Exception as exc:   # noqa: BLE001 - every rank raises it below
            mine = exc if isinstance(exc, CkptError) else translated("the P2P pull", "the engine's PS world", exc)
            if mine is not exc:
                mine.__cause__ = exc
            outcome = {"error": type(mine).__name__, "message": str(mine)}
    try:
        told = ps.all_gather_json(outcome)
    except CkptError as exc:
        if mine is not None:
            log.warning("trainer rank %d: the outcome could not be told to every rank: %s", ps.rank, exc)
            raise mine from exc
        raise
    sender: dict[str, Any] = next((t for t in told if t), {})
    if "error" in sender:
        if mine is not None:
            raise mine
        cls = getattr(errors, str(sender["error"]), None)
        if not (isinstance(cls, type) and issubclass(cls, CkptError)):
            cls = errors.RemoteWorkerError
        raise cls(str(sender["message"]))
    if "result" not in sender:
        raise errors.ConfigError("no trainer rank pulled the round (rank 0 is the sender)")
    return sender["result"]
