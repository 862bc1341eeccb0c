"""The trainer side of the ``ckpt`` backend of vLLM's weight-transfer API.

A trainer moves its weights into a vLLM server started with ``--weight-transfer-config
'{"backend": "ckpt"}'`` through vLLM's own trainer API; ckpt-engine's parameter server does the
transfer. Every trainer rank runs::

    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                  WeightTransferTrainerFactory)
    from ckpt_vllm.trainer import CkptTrainerInitInfo      # importing it registers "ckpt"

    engine = WeightTransferTrainerFactory.trainer_init(
        CkptTrainerInitInfo(rank=rank, world_size=world),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"), source=ModuleSource(model))
    for step in range(steps):
        train_step(model)
        engine.send_weights()    # returns once the engine serves exactly these weights
    engine.shutdown()

What runs where: every trainer rank is one parameter-server (PS) rank, in the trainer's process
(its default process group if one exists, else one made from ``master_addr``/``master_port``);
PS rank r feeds engine worker r, so the trainer has as many ranks as the engine has workers (one
vLLM server; several, with slices: R x T ranks for R replicas). Each round every rank registers
its share of the weights (``_trainer_source.py``: tensor i of a replicated source on rank i %
world; FSDP/TP shards as pieces, not gathered) into a reused pinned host pool, or, where the share
already lies on the PS's device (``on_device``, auto by default), in place on the device: the update then
copies it device-to-device into the engine's buffers, the bytes never leave the GPU; the ranks gather
metas, and one ``ParameterServer.update`` moves them; inside it rank 0 (the sender) posts vLLM's
routes through ``client``: ``/init_weight_transfer_engine`` (first round), ``/start_weight_update``,
``/update_weights`` (the engine workers then read the PS's buffers), ``/finish_weight_update``
with the weight version, and a prefix-cache reset. A failure anywhere, the sender's requests
included, reaches every rank as the same typed error (``ckpt_core.errors``) within
``timeout_s``; the PS world stays usable and the next round starts clean.

Trainer ranks whose devices are not the engine's (another host, or other devices of the engine's
host): ``p2p_services`` names the services of the PS ranks the engine's workers started themselves
(managed mode, ``CKPT_ENGINE_SERVE``). The trainer ranks then only own the weights
(``ParameterServer(serve_p2p=True)``, no engine beside them); rank 0 hands their metas to the
engine's PS world, which pulls them over Mooncake (``update(..., ranks=[...])``) into the engine,
and the typed outcome reaches every trainer rank (``_trainer_p2p.py``).

Options (``CkptTrainerInitInfo``): ``stage`` (the transfer lands in each worker's staging area
while the engine keeps generating; one short pause commits it), ``slices`` (each engine worker
receives only what its loaders read). Both need our worker extension on the server
(``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension``) and an HTTP endpoint
(``engine_url``, else the client's ``base_url``). vLLM 0.26's factory has an earlier form,
``WeightTransferTrainerFactory.trainer_init("ckpt", None, CkptTrainerInitInfo(rank=...), client=...,
source=...)``, and its clients' ``finish_weight_update()`` takes no weight version (none is set
there); without vLLM the classes still work, called directly
(``CkptTrainerWeightTransferEngine.trainer_init``).
"""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass
from typing import ClassVar

from ckpt_core import ParameterServer
from ckpt_core.errors import CheckpointFormatError, CkptError, ClosedError, ConfigError, DeviceResidentError

from ._trainer_p2p import EnginePull, agree_outcome, check_services
from ._trainer_sender import Sender, endpoint_of, own_http
from ._trainer_source import device_resident, round_tensors
from .plugin import BACKEND_NAME, register_trainer

__all__ = ["CkptTrainerInitInfo", "CkptTrainerWeightTransferEngine", "HAS_TRAINER_FACTORY"]

log = logging.getLogger("ckpt_vllm")
_CLIENT_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")

try:   # vLLM >= 0.26 has the trainer API; without it the classes stand alone (same behaviour)
    from vllm.distributed.weight_transfer.base import TrainerInitInfo as _InitBase
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine as _EngineBase
    HAS_TRAINER_FACTORY = True
except ImportError:
    HAS_TRAINER_FACTORY = False

    @dataclass
    class _InitBase:   # type: ignore[no-redef]
        """vLLM's ``TrainerInitInfo`` where the release lacks it: ``rank``, rank 0 sends."""
        backend: ClassVar[str]
        rank: int = 0

        @property
        def is_sender(self) -> bool:
            return self.rank == 0

    class _EngineBase:   # type: ignore[no-redef]
        def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
            self.client, self.source, self.is_sender = client, source, is_sender


@dataclass
class CkptTrainerInitInfo(_InitBase):
    """Trainer-side init info of the ``ckpt`` backend (the factory dispatches on ``backend``).

    ``rank``: this trainer rank (keyword, vLLM's contract); ``world_size``: trainer ranks (default:
    the default process group's size, else 1); ``timeout_s``: bound of each round, every wait
    included; ``engine_url``: the server's HTTP address, for the prefix-cache reset, ``stage`` and
    ``slices`` (default: the client's ``base_url``); ``stage``: stage, then commit under a
    ``commit_pause`` pause; ``slices``: record a slice plan from the engine and route by it;
    ``replicated``: named plain tensors are the same on every rank (else each rank holds its
    own); ``version_prefix``: round k makes weight version ``f"{version_prefix}-{k}"`` live;
    ``device``/``master_addr``/``master_port``/``max_bucket_gb``: the ParameterServer's.
    ``p2p_services``: the engine's managed PS services (``CKPT_ENGINE_SERVE``), rank 0 first (Unix socket
    paths or ``http(s)://host:port``): the trainer ranks are P2P owners and the engine's PS world pulls;
    ``service_token``: their bearer token (default ``CKPT_SERVICE_TOKEN``); ``p2p_update_url``: the
    engine's ``/collective_rpc`` as the managed PS reaches it (default: ``engine_url``/``base_url``'s).
    ``on_device``: register each round's share where it lies on the PS's device (``register_checkpoint(...,
    on_device=True)``: no copy to host, the update copies device-to-device into the engine's buffers; the
    trainer must not modify its weights until ``send_weights`` returns); False: copy it into the pinned host
    pool; None (auto): on when every tensor of this rank's share (each piece's local tensor) is a contiguous
    device tensor (not the CPU) on the PS's device and no ``p2p_services`` are used. Each rank decides for its
    own share; a rank that cannot register its share (True with a tensor elsewhere) fails the round on every
    rank alike.
    """

    backend: ClassVar[str] = BACKEND_NAME
    world_size: int | None = None
    timeout_s: float = 600.0
    engine_url: str | None = None
    stage: bool = False
    commit_pause: str = "keep"
    slices: bool = False
    reset_prefix_cache: bool = True
    replicated: bool = True
    version_prefix: str = "step"
    device: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_bucket_gb: float | None = None
    p2p_services: list[str] | str | None = None
    service_token: str | None = None
    p2p_update_url: str | None = None
    on_device: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"rank must be an int >= 0, got {self.rank!r}")
        if self.world_size is not None and (not isinstance(self.world_size, int) or self.rank >= self.world_size):
            raise ConfigError(f"world_size must be an int > rank ({self.rank}), got {self.world_size!r}")
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        if self.commit_pause not in ("keep", "wait", "abort"):
            raise ConfigError(f"commit_pause must be 'keep', 'wait' or 'abort', got {self.commit_pause!r}")
        if not isinstance(self.version_prefix, str) or not self.version_prefix or "@" in self.version_prefix:
            raise ConfigError(f"version_prefix must be a non-empty string without '@', got {self.version_prefix!r}")
        if self.on_device is not None and not isinstance(self.on_device, bool):
            raise ConfigError(f"on_device must be True, False or None (auto), got {self.on_device!r}")
        if self.p2p_services is not None:
            self.p2p_services = check_services(self.p2p_services)
            if self.stage or self.slices:
                raise ConfigError("p2p_services (the engine's PS world pulls) does not take stage or slices yet")
            if self.on_device:
                raise DeviceResidentError("on_device=True cannot go with p2p_services: the engine's PS world pulls "
                                          "over Mooncake from the trainer ranks' host memory")


_BASE_TAKES_CONFIG = "config" in inspect.signature(_EngineBase.__init__).parameters


class CkptTrainerWeightTransferEngine(_EngineBase):
    """Built by ``WeightTransferTrainerFactory.trainer_init`` on every trainer rank; see the module."""

    init_info_cls = CkptTrainerInitInfo

    def __init__(self, *, client, source, info: CkptTrainerInitInfo, ps: ParameterServer, config=None,
                 pull: EnginePull | None = None) -> None:
        # vLLM 0.26's base takes the backend's config first; 0.28's takes none
        base = {"config": config} if _BASE_TAKES_CONFIG else {}
        super().__init__(client=client, source=source, is_sender=info.is_sender, **base)
        self.info, self.ps = info, ps
        self.last_result: dict | None = None
        self._rounds = 0
        self._plan = None                  # the slice plan of the last round (reused while the engine holds it)
        self._staged: str | None = None    # the version stage_weights left for commit_weights
        self._sender = Sender(info) if info.is_sender else None
        self._pull = pull   # p2p_services, on the sender: the engine's PS world pulls (None otherwise)
        self._closed = False

    @classmethod
    def trainer_init(cls, init_info: CkptTrainerInitInfo, *, client, source=None,
                     config=None) -> "CkptTrainerWeightTransferEngine":
        """Start this rank's parameter server (a collective of the trainer ranks). Nothing is posted
        to the engine yet: the sender's first requests run inside the first round, where a failure
        reaches every rank alike. ``config``: passed by vLLM 0.26's form of the factory
        (``trainer_init(backend, config, init_info, ...)``); handed to that release's base class, else unused."""
        if not isinstance(init_info, CkptTrainerInitInfo):
            raise ConfigError(f"init_info must be a CkptTrainerInitInfo, got {type(init_info).__name__}")
        missing = [m for m in _CLIENT_METHODS if not callable(getattr(client, m, None))]
        if missing:
            raise ConfigError(f"client must be a VLLMWeightSyncClient; {type(client).__name__} lacks {missing}")
        if ((init_info.stage or init_info.slices) and endpoint_of(init_info, client) is None
                and own_http(client) is None):
            raise ConfigError("stage and slices need the server's HTTP address: set engine_url (or use a client "
                              "with a base_url, like vLLM's HTTPVLLMWeightSyncClient)")
        p2p = init_info.p2p_services is not None
        update_url = _p2p_update_url(init_info, client) if p2p else None
        import torch.distributed as dist

        joined = dist.is_available() and dist.is_initialized()
        world = init_info.world_size or (dist.get_world_size() if joined else 1)
        # P2P: owners only (no engine beside them): the engine's PS world reads their host memory
        ps = ParameterServer(rank=init_info.rank, world_size=world, device=init_info.device, auto_pg=not joined,
                             master_addr=init_info.master_addr, master_port=init_info.master_port,
                             max_bucket_gb=init_info.max_bucket_gb, serve_p2p=True if p2p else None)
        pull = None
        try:
            if p2p and init_info.is_sender:
                from ckpt_core.client import env_token

                pull = EnginePull(list(init_info.p2p_services or ()), str(update_url),
                                  token=init_info.service_token or env_token(), timeout_s=init_info.timeout_s)
            return cls(client=client, source=source, info=init_info, ps=ps, config=config, pull=pull)
        except BaseException:
            if pull is not None:
                pull.close()
            ps.close()
            raise

    def send_weights(self, weights=None) -> dict:
        """One round on every trainer rank: the engine then serves exactly ``weights`` (default:
        the ``source`` given at ``trainer_init``). Returns the PS's update result. With ``stage``,
        the round stages while the engine keeps serving, then commits."""
        return self._round(weights, commit=True)

    def stage_weights(self, weights=None) -> dict:
        """``stage=True`` only: the round's transfer into every worker's staging area (the engine
        keeps generating on its live weights); :meth:`commit_weights` makes it live."""
        if not self.info.stage:
            raise ConfigError("stage_weights needs CkptTrainerInitInfo(stage=True)")
        return self._round(weights, commit=False)

    def commit_weights(self):
        """Make the staged round live: the sender pauses the engine (``commit_pause``), reloads the
        staged weights, resets the prefix cache and resumes; a no-op on the other ranks (no collective:
        a failure is raised on the sender only). Returns the sender's ``UpdateReport``
        (``seconds["paused"]``: how long generation stood still)."""
        if self._closed:
            raise ClosedError("this CkptTrainerWeightTransferEngine was shut down")
        version, self._staged = self._staged, None
        if version is None:
            raise ConfigError("nothing is staged: call stage_weights first")
        return None if self._sender is None else self._sender.commit(self.client, version)

    def _round(self, weights, *, commit: bool) -> dict:
        if self._closed:
            raise ClosedError("this CkptTrainerWeightTransferEngine was shut down")
        self._rounds += 1
        version = f"{self.info.version_prefix}-{self._rounds}"
        try:
            mine, local = round_tensors(self.source if weights is None else weights, self.ps.rank,
                                        self.ps.world_size, replicated=self.info.replicated), None
        except Exception as exc:   # noqa: BLE001 - raised by _register, once every rank learnt of it
            mine, local = None, exc
        # gather_metas agrees on the name: on the ranks' layouts too (an unreadable source: nobody's)
        # (P2P: one name per layout, so the engine's PS world replaces the metas it loaded last round)
        label = f"{self.info.version_prefix}-p2p" if self.info.p2p_services is not None else version
        name = f"{label}@{mine.layout if mine is not None else 'unreadable'}"
        self._register(name, None if mine is None else mine.tensors, local)
        failed = True
        try:
            _check_covered(self.ps.tensor_specs(name), None if mine is None else mine.expected)
            if self.info.p2p_services is not None:
                self.last_result = self._pulled(name, version)
            else:
                plan = self._share_plan(name) if self.info.slices else None
                self.last_result = self._update(name, version, plan, commit)
                self._staged = None if commit or not self.info.stage else version
            failed = False
        finally:
            self._drop(name, failed)
        log.info("trainer rank %d: weight version %s sent (%.3f s)", self.ps.rank, version,
                 self.last_result["seconds"]["total"])
        return self.last_result

    def _drop(self, name: str, failed: bool) -> None:
        """Unregister the round's checkpoint. After a failed round a failure here (a PS whose groups broke
        with the round) is logged only: the round's own error is the one every rank raises."""
        try:
            if name in self.ps.checkpoints():
                self.ps.unregister_checkpoint(name)
        except CkptError as exc:
            if not failed:
                raise
            log.warning("trainer rank %d: after the failed round, %s could not be unregistered: %s", self.ps.rank,
                        name, exc)

    def _pulled(self, name: str, version: str) -> dict:
        """A P2P round: the sender has the engine's PS world pull ``name``; every rank gets the outcome."""
        pull, sender, client = self._pull, self._sender, self.client
        run = None
        if pull is not None and sender is not None:
            def run() -> dict:
                result = pull.pull(self.ps.get_metas(), name)
                http = sender.http(client)
                if http is not None:   # vLLM's own weight version (a server without the route: skipped)
                    http.set_weight_version(version)
                return result
        result = agree_outcome(self.ps, run)
        result.setdefault("seconds", {}).setdefault("total", result["seconds"].get("pull", 0.0))
        return result

    def _update(self, name: str, version: str, plan, commit: bool) -> dict:
        """The PS update; inside it (in a thread of the PS) the sender posts vLLM's routes."""
        ended = threading.Event()   # the update is over: a sender still waiting for an answer posts nothing more
        sender, client = self._sender, self.client

        def req_func(handles):
            if sender is not None:
                sender.round(client, handles, version, None if plan is None else plan.digest, ended, commit)
        try:
            return self.ps.update(name, req_func, timeout=self.info.timeout_s, slices=plan)
        finally:
            ended.set()

    def _register(self, name: str, tensors: dict | None, local: Exception | None) -> None:
        """Register this rank's share and gather every rank's metas. A rank that could not read its
        share (``local``) or register it still joins the gather, which then fails on every rank
        (its checkpoint is missing, or its name differs): nobody is left waiting."""
        if local is None:
            try:
                on_device = self._on_device(tensors or {})
                self.ps.register_checkpoint(name, named_tensors=tensors, use_shared_memory_pool=not on_device,
                                            on_device=on_device, on_device_digest=False)   # full updates only
            except Exception as exc:   # noqa: BLE001 - raised below, after every rank learnt of it
                local = exc
        try:
            self.ps.gather_metas(name)
        except CkptError as agreed:
            if name in self.ps.checkpoints():
                self.ps.unregister_checkpoint(name)
            if local is not None:   # the same error as every rank's, saying why this rank is the cause
                first = f"{agreed.args[0] if agreed.args else agreed}; this rank could not register its tensors: " \
                        f"{type(local).__name__}: {local}"
                agreed.args = (first, *agreed.args[1:])
                raise agreed from local
            raise
        if local is not None:   # never expected: the gather cannot succeed without this rank's checkpoint
            raise local

    def _on_device(self, tensors: dict) -> bool:
        """Whether this round's share is registered on the device (``on_device``; None: auto)."""
        if self.info.on_device is not None:
            return self.info.on_device
        if self.info.p2p_services is not None:
            return False
        return device_resident(tensors, self.ps.backend.device(self.ps.device_index))

    def _share_plan(self, name: str):
        plan, error = None, None
        if self._sender is not None:
            try:
                plan = self._sender.http(self.client).slice_plan(self.ps.tensor_specs(name), reuse=self._plan)
            except Exception as exc:   # noqa: BLE001 - every rank raises it (share_slice_plan)
                error = f"{type(exc).__name__}: {exc}"
        self._plan = self.ps.share_slice_plan(plan, src=0, error=error)
        return self._plan

    def shutdown(self) -> None:
        """Close this rank's parameter server (and the sender's HTTP client). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._sender is not None:
                self._sender.close()
            if self._pull is not None:
                self._pull.close()
        finally:
            self.ps.close()


def _p2p_update_url(info: CkptTrainerInitInfo, client) -> str:
    """The engine's ``/collective_rpc`` that the managed PS rank 0 posts the handles to."""
    if info.p2p_update_url:
        return info.p2p_update_url
    base = endpoint_of(info, client)
    if not base:
        raise ConfigError("p2p_services needs the engine's URL as its managed PS reaches it: set p2p_update_url "
                          "(e.g. http://127.0.0.1:8000/collective_rpc), engine_url, or use a client with a base_url")
    return base.rstrip("/") + "/collective_rpc"


def _check_covered(specs: dict, expected: list[str] | None) -> None:
    """Every tensor of the source's metadata was registered by some rank (the same verdict on
    every rank: the gathered metas and, through the checkpoint's name, ``expected`` are agreed)."""
    if expected is None:
        return
    missing = [n for n in expected if n not in specs]
    if missing:
        raise CheckpointFormatError(f"no trainer rank registered {len(missing)} tensor(s) of the source's metadata "
                                    "(held_names() must cover the model)", tensor=missing[0])


register_trainer()
