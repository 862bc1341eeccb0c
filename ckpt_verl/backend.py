"""ckpt-engine as a verl checkpoint engine: backend ``ckpt``, loaded by verl through
``custom_backend_module``, no change to verl::

    actor_rollout_ref.rollout.checkpoint_engine.backend=ckpt
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=ckpt_verl.backend
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.ckpt.timeout_s=300   # optional

What runs where (verl's calls, in the order its ``CheckpointEngineManager`` makes them):

* **Trainer workers** (verl's actor group, ``is_master`` on rank 0) form one parameter-server
  (PS) world over the actor's own process group. ``send_weights`` walks verl's generator of full
  tensors (every rank walks all of it: producing a weight is collective there), keeps tensor i on
  trainer rank i % T, copies it into the PS's reused host pool (``register_checkpoint``), and the
  ranks gather metas; trainer rank 0 then publishes the P2P metas document and every trainer rank
  keeps its share registered (and served to P2P readers) until every rollout worker has its weights.
* **Rollout workers** (verl's ``CheckpointEngineWorker``, one per rollout device) form one PS
  world per rollout replica, over the process group verl made for them. ``receive_weights`` pulls
  the round as a P2P update (ckpt_core's ``update(..., ranks=[...])``): each bucket is read once
  from the trainer ranks' host memory (Mooncake: RDMA, else TCP) by one worker of the replica and
  broadcast to the others, into each PS rank's IPC buffer, pipelined; the buckets are yielded to
  verl's rollout (vLLM, SGLang ...), which loads them (``_receive.py``).
* The two sides meet in a small store served by trainer rank 0 (``_rendezvous.py``): the metas
  document one way, each rollout worker's verdict the other. A failure on either side (a bad
  tensor, a dead trainer or rollout process, a timeout) ends the round with a typed error of
  ``ckpt_core.errors`` on every worker within ``timeout_s`` (plus a few seconds of grace).

Needs verl (the ``verl`` extra: verified with verl 0.9.1) and Mooncake (the ``p2p`` extra) in both
sides' processes. Importing ``ckpt_core`` never imports this module or verl.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Any

import torch.distributed as dist

from ckpt_core import ParameterServer
from ckpt_core.errors import CkptError, ClosedError, ConfigError

from . import BACKEND_NAME
from ._plan import take_share, topology
from ._receive import BucketStream
from ._rendezvous import Rendezvous

try:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
except ImportError as exc:   # an optional dependency: say which
    raise ImportError(f"ckpt_verl needs verl (the 'verl' extra; verified with verl 0.9.1): {exc}") from exc

__all__ = ["BACKEND_NAME", "CkptCheckpointEngine"]
CHECKPOINT = "verl-weights"   # one name per world: each round registers it anew and frees it at its end
GRACE_S = 10.0                # trainers wait this much past the rollout's own deadline for its verdict
GiB = float(1 << 30)
log = logging.getLogger("ckpt_verl")


@CheckpointEngineRegistry.register(BACKEND_NAME)
class CkptCheckpointEngine(CheckpointEngine):
    """verl's ``CheckpointEngine`` on ckpt-engine's pipeline; see the module docstring.

    ``bucket_size`` (verl's ``update_weights_bucket_megabytes``, in bytes): the largest bucket
    (the PS sizes its ring of buckets from free device memory, at most this); ``is_master``: verl
    sets it on trainer rank 0; ``timeout_s``: bound of every wait of a round; ``device``: the
    device kind (default: cuda where present, else cpu); ``host``: the address trainer rank 0's
    store is reached at (default ``MASTER_ADDR``, which verl sets to that rank's node).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0,
                 device: str | None = None, host: str | None = None) -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ConfigError(f"bucket_size must be a positive number of bytes, got {bucket_size!r}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.bucket_size, self.is_master, self.timeout_s = bucket_size, bool(is_master), float(timeout_s)
        self.device, self.host = device, host
        self.ps: ParameterServer | None = None
        self.last_result: dict | None = None
        self._served: Rendezvous | None = None   # trainer rank 0: the store it serves
        self._store: Rendezvous | None = None
        self._role: dict | None = None           # init_process_group's arguments
        self._last_round: str | None = None      # trainer rank 0: the round whose store keys go next
        self._closed = False

    # -- verl's topology calls ------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Plain data for ``build_topology``; the master adds its store and a fresh round id."""
        self._check_open()
        meta: dict[str, Any] = {"backend": BACKEND_NAME}
        if self.is_master:
            if self._served is None:
                addr = self.host or os.environ.get("MASTER_ADDR") or "127.0.0.1"
                self._served = Rendezvous(addr, 0, serve=True, timeout_s=self.timeout_s)
            addr, port = self._served.endpoint
            meta["master"] = {"addr": addr, "port": port, "round": secrets.token_hex(8)}
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Pure: each worker's ``init_process_group`` arguments (trainers first, as verl orders them)."""
        return topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(self, *, side: str, rank: int, trainers: int, rollouts: int, master: dict) -> None:
        """Meet the round's store; the first time (or after a round broke the groups), start this
        worker's PS rank over the process group verl made for its side (a collective of that group)."""
        self._check_open()
        if side not in ("trainer", "rollout"):
            raise ConfigError(f"side must be 'trainer' or 'rollout', got {side!r}")
        endpoint = (str(master["addr"]), int(master["port"]))
        if self._served is not None and self._served.endpoint == endpoint:
            self._store = self._served
        elif self._store is None or self._store.endpoint != endpoint:
            self._store = Rendezvous(*endpoint, serve=False, timeout_s=self.timeout_s)
        self._role = {"side": side, "rank": rank, "trainers": trainers, "rollouts": rollouts,
                      "round": str(master["round"])}
        if self.ps is None:
            self.ps = self._start_ps(side, rank, trainers)

    def _start_ps(self, side: str, rank: int, trainers: int) -> ParameterServer:
        if not dist.is_initialized():
            raise ConfigError(f"the {side} worker has no torch.distributed process group: verl's actor workers and "
                              "CheckpointEngineWorker make one; the PS ranks of each side live in it")
        if side == "trainer" and (dist.get_world_size(), dist.get_rank()) != (trainers, rank):
            raise ConfigError(f"trainer rank {rank} of {trainers} sits in process group rank "
                              f"{dist.get_rank()} of {dist.get_world_size()}: they must be the actor group")
        return ParameterServer(rank=dist.get_rank(), world_size=dist.get_world_size(), auto_pg=False,
                               device=self.device, max_bucket_gb=self.bucket_size / GiB,
                               serve_p2p=side == "trainer")

    def finalize(self) -> None:
        """Nothing to free per round: the round's checkpoint and buffers were released at its end;
        the PS's process groups and host pool are kept for the next round (``close()`` frees them)."""

    # -- the round --------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict:
        """Trainer side: register this rank's share of ``weights`` and keep it served until every
        rollout worker has the round (or one failed: its typed error is raised here)."""
        role, ps, store = self._round_state("trainer")
        t0 = time.perf_counter()
        mine, local = await take_share(weights, role["rank"], role["trainers"])
        count, nbytes = len(mine), sum(t.numel() * t.element_size() for t in mine.values())
        if role["rank"] == 0 and self._last_round is not None:   # every trainer is past that round's waits
            _quietly(store.forget, self._last_round)
        try:
            await asyncio.to_thread(self._register, ps, mine, local)
            if role["rank"] == 0:
                self._last_round = role["round"]
                store.publish_metas(role["round"], CHECKPOINT, ps.get_metas())
            await asyncio.to_thread(store.wait_rollouts, role["round"], role["rollouts"], self.timeout_s + GRACE_S)
        except BaseException as exc:
            if role["rank"] == 0:
                self._last_round = role["round"]
                _quietly(store.publish_trainer_error, role["round"], exc, "trainer rank 0")
            self._after_failure(exc)
            raise
        finally:
            if self.ps is not None and CHECKPOINT in self.ps.checkpoints():
                self.ps.unregister_checkpoint(CHECKPOINT)
        seconds = time.perf_counter() - t0
        log.info("trainer rank %d: step %s sent, %d tensors, %.3f GiB from this rank in %.3f s", role["rank"],
                 global_steps, count, nbytes / GiB, seconds)
        return {"ckpt_engine/send_s": seconds, "ckpt_engine/rank_bytes": nbytes}

    def _register(self, ps: ParameterServer, mine: dict, local: Exception | None) -> None:
        """Register, then gather metas; a rank that failed locally still joins the gather, which then
        fails on every trainer rank alike (nobody is left waiting in the collective)."""
        if local is None:
            try:
                ps.register_checkpoint(CHECKPOINT, named_tensors=mine, use_shared_memory_pool=True)
                mine.clear()   # copied into the PS's pool: the host copies can go now
            except Exception as exc:   # noqa: BLE001 - raised below, once every rank learnt of it
                local = exc
        try:
            ps.gather_metas(CHECKPOINT)
        except CkptError as agreed:
            if local is not None:
                raise agreed from local
            raise
        if local is not None:   # not expected: gather_metas fails without this rank's checkpoint
            raise local

    async def receive_weights(self, global_steps: int | None = None):
        """Rollout side: yield the round's ``(name, tensor)`` as its buckets arrive (views valid until
        the next bucket is asked for); then tell the trainers. A failure is raised here as well."""
        role, ps, store = self._round_state("rollout")
        where = f"rollout worker {role['rank']}"
        stream = items = None
        try:
            name, doc = await asyncio.to_thread(store.wait_metas, role["round"], self.timeout_s)
            ps.load_metas(doc)
            stream = BucketStream(ps, name, self.timeout_s).start()
            items = stream.__aiter__()
            async for item in items:
                yield item
        except BaseException as exc:
            _quietly(store.report_error, role["round"], exc, where)
            self._after_failure(exc)
            raise
        finally:
            if items is not None:
                await items.aclose()   # stops the update if the rollout left early (its error is agreed)
        store.report_done(role["round"])
        self.last_result = stream.result
        log.info("%s: step %s received, %d buckets", where, global_steps, stream.buckets)

    # -- lifecycle ------------------------------------------------------------------------
    def _round_state(self, side: str):
        self._check_open()
        role = self._role
        if role is None or self.ps is None:
            raise ConfigError(f"call init_process_group before {'send' if side == 'trainer' else 'receive'}_weights")
        if role["side"] != side:
            raise ConfigError(f"this worker is on verl's {role['side']} side; it cannot "
                              f"{'send' if side == 'trainer' else 'receive'} weights")
        return role, self.ps, self._store

    def _after_failure(self, exc: BaseException) -> None:
        """A round that broke the PS's process groups (a peer died) leaves a PS that cannot move
        weights again: close it; the next init_process_group starts a new one."""
        if getattr(exc, "groups_broken", False) and self.ps is not None:
            ps, self.ps = self.ps, None
            _quietly(ps.close)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this CkptCheckpointEngine is closed")

    def close(self) -> None:
        """Free the PS (host memory, buffers, process groups it made). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.ps is not None:
            self.ps.close()
            self.ps = None
        self._store = self._served = None


def _quietly(fn, *args) -> None:
    """Best effort (reporting a failure that is being raised anyway)."""
    try:
        fn(*args)
    except Exception as exc:   # noqa: BLE001
        log.warning("%s failed while reporting an earlier failure: %s", getattr(fn, "__name__", fn), exc)
