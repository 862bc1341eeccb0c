"""The vLLM worker extension: pull one update from the colocated parameter-server rank.

Staging (``_staged.py``) and what the update paths share (``_sessions.py``, re-exported here for
the ``ckpt`` weight-transfer backend) live beside it.

Start vLLM with ``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension`` (and
``VLLM_SERVER_DEV_MODE=1`` for ``/collective_rpc``); the requester then calls
``update_weights_from_ipc`` on every worker through ``/collective_rpc``. vLLM mixes this class
into its worker and refuses to start if any attribute name collides with the worker's own, so
every helper here is prefixed ``_ckpt_``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ckpt_core.devices import local_device_key
from ckpt_core.errors import ConfigError
from ckpt_core.ops.cache import BoundedCache
from ckpt_core.wire.worker import DEFAULT_TIMEOUT_S

from ._live import settle
from ._reload import LiveWrites, ReloadSession
from ._sessions import (  # noqa: F401
    Refused,
    abort_sessions,
    agree_on_handle,
    answered_together,
    device_kind_index,
    drafter_target,
    finish_sessions,
    live_layout,
    new_sessions,
    receive_into,
    refuse_together,
    reset_derived_caches,
    worker_device,
)
from ._staged import StagedWeights

if TYPE_CHECKING:
    import zmq

    from ckpt_core.planning.slices import SliceKey

    from ._direct import DirectMap

__all__ = ["VllmColocateWorkerExtension", "worker_device", "drafter_target", "receive_into", "agree_on_handle"]

log = logging.getLogger("ckpt_vllm")


def _tensor_specs(tensors) -> dict[str, tuple[str, tuple[int, ...]]]:
    from ckpt_core.checkpoint.safetensors import WIRE_DTYPES

    if not isinstance(tensors, dict) or not tensors:
        raise ConfigError("ckpt_slice_plan needs {name: [dtype, shape]} of the checkpoint's tensors")
    out = {}
    for name, spec in tensors.items():
        if (not isinstance(spec, (list, tuple)) or len(spec) != 2 or spec[0] not in WIRE_DTYPES
                or not all(isinstance(d, int) and d >= 0 for d in spec[1])):
            raise ConfigError(f"ckpt_slice_plan: tensor {name!r} must be [dtype code, shape], got {spec!r}")
        out[str(name)] = (spec[0], tuple(spec[1]))
    return out


def _slice_rank(worker: Any) -> int:
    """This worker's tensor-parallel rank; slices need one pipeline stage and no drafter."""
    from vllm.distributed import get_tensor_model_parallel_rank

    pc = worker.vllm_config.parallel_config
    if getattr(pc, "pipeline_parallel_size", 1) != 1 or drafter_target(worker) is not None:
        raise ConfigError("slice plans need pipeline parallel size 1 and no MTP drafter: update without slices")
    return int(get_tensor_model_parallel_rank())


# Slice plans installed in this worker process (``ckpt_use_slice_plan``), by digest; the extension's
# updates and the ``ckpt`` weight-transfer backend (``transfer_engine.py``) both apply them.
_SLICE_PLANS: BoundedCache[str, Any] = BoundedCache(4)


def agree_on_slices(zmq_handles: dict, kind: str, index: int, digest: str):
    """This worker's installed plan ``digest``, once every worker has it and is fed by the PS rank of
    its own tensor-parallel rank (the handles come in PS-rank order): all load (or stage) by it, or
    none (the last worker raises ConfigError, the others raise ``Refused``). The position is what the
    poster says; the receive loop then checks what the PS says it routed (``ReplayPlan.route``)."""
    problem = None
    replay = _SLICE_PLANS.get(str(digest))
    key = local_device_key(kind, index)
    position = list(zmq_handles).index(key) if isinstance(zmq_handles, dict) and key in zmq_handles else -1
    if replay is None:
        problem = f"slice plan {str(digest)[:12]} is not installed on this worker (ckpt_use_slice_plan)"
    elif position != replay.rank.rank:
        problem = (f"the worker of tensor-parallel rank {replay.rank.rank} would receive the slices of PS rank "
                   f"{position}: each PS rank must feed the engine rank of its number")
    refused = refuse_together(problem, f"slice plan {str(digest)[:12]}")
    if refused is not None:
        raise Refused(refused)
    return replay


class VllmColocateWorkerExtension(StagedWeights):
    """Mixed into vLLM's worker by ``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension``.

    Example (what :class:`ckpt_vllm.VllmClient` sends)::

        POST /collective_rpc {"method": "update_weights_from_ipc",
                              "args": [{"CPU-<machine>-0": "ipc://@ckpt-..."}]}
    """

    # This worker's own state, set by the RPCs below (declared only, see StagedWeights)
    _ckpt_live_layout: dict
    _ckpt_live_version: str | None
    _ckpt_live_since: float
    _ckpt_recordings: BoundedCache[SliceKey, dict]   # ckpt_slice_plan's results by the engine's key
    _ckpt_zmq_ctx: zmq.Context
    _ckpt_direct: DirectMap | None   # where a direct=True full update copies each tensor (``_direct.py``)

    @answered_together("the update")
    def update_weights_from_ipc(self, zmq_handles: dict[str, str], timeout: float | None = None,
                                stage: str | None = None, stage_device_bytes: int = 0,
                                version: str | None = None, slices: str | None = None, deltas: bool = False,
                                direct: bool = False) -> dict:
        """Receive one update from the PS rank colocated with this worker; returns its timings.

        ``zmq_handles`` maps device keys to handles (the PS's ``req_func`` argument as a dict);
        this worker picks its own. Raises (and keeps serving the previous weights for every
        layer not yet processed) when a tensor is missing, has the wrong shape, or the PS aborts; the
        workers then agree on what the engine holds (``_live.py``): when none had written into its live
        model, the live version stays and the error says that nothing was loaded; when any had, no
        worker reports a live version and the error says the model may hold a mix (push a full update).

        ``stage="v8"``: stage instead (see :meth:`commit_staged_weights`): the buckets are copied
        into a staging area (device memory up to ``stage_device_bytes``, then pinned host memory)
        while the engine keeps serving its current weights; a stage replaces one staged before.
        ``version`` names the weights an update makes live (see :meth:`ckpt_weight_versions`).
        ``slices``: the digest of the slice plan installed with :meth:`ckpt_use_slice_plan` that the
        PS routes this update by (this worker then receives only its slices, see ``_slices.py``).
        ``deltas=True``: this update may be a delta (``ParameterServer.update(..., delta=True)``) of
        the ``version`` this worker holds, and a full one is kept in host memory as the next delta's
        base (``_delta.py``, docs/deltas.md); needs ``version``. With ``stage`` a delta is staged and
        applied by :meth:`commit_staged_weights`; with ``slices``
        each worker maps its boxes, and a sliced delta (staged or not) is scattered or reloaded by layer
        (docs/deltas.md).
        ``direct=True``: once this worker recorded where this plan's tensors land (its first such update,
        which goes the usual way), the tensors of layers that read them verbatim are copied straight into
        the live model and only the other layers are reloaded (``_direct.py``, docs/vllm.md "Direct full
        updates"); the result's ``direct`` says which way it went. Not with ``stage``, ``slices`` or ``deltas``.

        Every RPC of this extension that can fail answers alike on every worker: the last worker
        raises the first failing worker's error, the others return ``{"refused": ...}``
        (``_sessions.answer_together``), so vLLM's next call reads its own replies.
        """
        kind, index = worker_device(self)
        handle = agree_on_handle(zmq_handles, kind, index)
        if handle is None:   # another worker lacks its handle; the last worker raised for all
            return {"refused": "a worker of this engine has no ZeroMQ handle; no worker loads anything"}
        try:
            replay = agree_on_slices(zmq_handles, kind, index, slices) if slices is not None else None
        except Refused as refused:
            return refused.refused
        if direct and (stage is not None or replay is not None or deltas):
            raise ConfigError("direct=True takes a plain full update: not with stage=, slices= or deltas= "
                              "(docs/vllm.md, Direct full updates)")
        if deltas and stage is not None:   # a staged delta (of whole tensors or by slices): applied by the commit
            return self._ckpt_stage(handle, kind, index, str(stage), int(stage_device_bytes),
                                    float(timeout or DEFAULT_TIMEOUT_S), replay, deltas=True)
        wait = float(timeout or DEFAULT_TIMEOUT_S)
        if deltas:
            if not version:
                raise ConfigError("deltas=True needs version= (docs/deltas.md)")
            return settle(self, "the update", lambda writes: self._ckpt_update_deltas(
                handle, kind, index, wait, version, replay, writes))
        if stage is not None:
            self._ckpt_drop_held()
            return self._ckpt_stage(handle, kind, index, str(stage), int(stage_device_bytes), wait, replay)
        if direct:
            return settle(self, "the update", lambda writes: self._ckpt_update_direct(
                handle, kind, index, wait, version, writes))
        return settle(self, "the update", lambda writes: self._ckpt_update_plain(
            handle, kind, index, wait, version, replay, writes))

    def _ckpt_update_plain(self, handle: str, kind: str, index: int, timeout: float, version: str | None,
                           replay, writes: LiveWrites) -> dict:
        """A plain full update (``replay``: the slice plan it is routed by, or None)."""
        self._ckpt_drop_held()
        sessions = new_sessions(self, replay, writes)
        result = receive_into(sessions, self._ckpt_zmq_context(), handle, kind, index, timeout=timeout, replay=replay)
        self._ckpt_made_live(live_layout(sessions, replay), version)
        if replay is not None:
            result["slices"] = {"plan": replay.digest, "rank": replay.rank.rank}
        log.info("ckpt update on %s: %d tensors, %.1f MB in %.3f s", result["device_key"], result["tensors"],
                 result["bytes"] / 1e6, result["seconds"]["total"])
        return result

    def _ckpt_drop_held(self) -> None:
        """Weights from another path than a delta's: no delta applies to them any more (a plain update
        that fails before any worker wrote gets the held version back, ``_live.settle``)."""
        delta_rx = getattr(self, "_ckpt_delta_rx", None)   # _delta.receive_with_deltas's
        if delta_rx is not None:
            delta_rx.held = None

    def _ckpt_update_deltas(self, handle: str, kind: str, index: int, timeout: float, version: str,
                            replay=None, writes: LiveWrites | None = None) -> dict:
        """An update with ``deltas=True``: a full one (kept as the next delta's base) or a delta (``_delta.py``);
        ``replay``: the slice plan it is routed by (each worker its boxes)."""
        from ._delta import receive_with_deltas

        result, sessions = receive_with_deltas(self, self._ckpt_zmq_context(), handle, index, timeout=timeout,
                                               version=version, replay=replay, writes=writes)
        # a delta leaves the checkpoint layout as it was
        layout = live_layout(sessions, replay) if sessions else getattr(self, "_ckpt_live_layout", {})
        self._ckpt_made_live(layout, version)
        if replay is not None:
            result["slices"] = {"plan": replay.digest, "rank": replay.rank.rank}
        return dict(result, device_key=local_device_key(kind, index))

    def _ckpt_update_direct(self, handle: str, kind: str, index: int, timeout: float, version: str | None,
                            writes: LiveWrites | None = None) -> dict:
        """A full update with ``direct=True`` (``_direct.py``)."""
        from ._direct import receive_direct

        self._ckpt_drop_held()
        result, kept = receive_direct(self, self._ckpt_zmq_context(), handle, index, timeout=timeout, writes=writes)
        self._ckpt_made_live(kept.layout() if kept is not None else {}, version)
        self._ckpt_direct = kept   # after _ckpt_made_live, which drops it
        fig = result["direct"]
        key = local_device_key(kind, index)
        if fig["path"] == "direct":
            log.info("ckpt update on %s: direct %d tensors (%.1f MB, %.3f s), reloaded %d layers (%d tensors); "
                     "%.3f s in all", key, fig["direct_tensors"], fig["direct_bytes"] / 1e6, fig["copy_s"],
                     fig["reloaded_layers"], fig["reload_tensors"], result["seconds"]["total"])
        else:
            log.info("ckpt update on %s: %d tensors, %.1f MB reloaded in %.3f s (not direct: %s)", key,
                     result["tensors"], result["bytes"] / 1e6, result["seconds"]["total"], fig["why"])
        return dict(result, device_key=key)

    @answered_together("recording the slice plan")
    def ckpt_slice_plan(self, tensors: dict) -> dict:
        """Record which part of each checkpoint tensor this worker's loaders read (``_slices.py``).

        ``tensors``: ``{name: [dtype code, shape]}`` of the checkpoint (``ParameterServer.tensor_specs``).
        Returns ``{"key", "rank", "recording", "whole"}``: the engine's (model, layout, version) key,
        this worker's tensor-parallel rank, its ``RankSlices`` as JSON, and why each tensor sent whole
        is. Nothing is loaded: the live layers are put back afterwards. Recorded once per key; a
        later call with the same key returns the same recording.
        """
        from ckpt_core.planning.slices import rank_to_json

        from ._compat import reload_api
        from ._slices import record, slice_key, tied_aliases

        specs = _tensor_specs(tensors)
        rank = _slice_rank(self)
        model = self.model_runner.model
        key = slice_key(model, self.model_config, self.vllm_config.parallel_config, specs)
        recorded_before: BoundedCache[SliceKey, dict] | None = getattr(self, "_ckpt_recordings", None)
        if recorded_before is None:
            recorded_before = self._ckpt_recordings = BoundedCache(4)
        cached = recorded_before.get(key)
        if cached is not None:   # once per (model, layout, vLLM version): the loaders do not change
            return cached
        aliases = tied_aliases(model)
        session = ReloadSession(model, self.model_config, label="model (slice recording)")
        session.begin()
        try:
            recorded, whole = record(model, specs, self.device, rank=rank, aliases=aliases,
                                     skip_params=reload_api().skip_load_tensors)
        finally:
            session.abort(quiet=True)
        result = {"key": {"model": key.model, "layout": key.layout, "engine": key.engine}, "rank": rank,
                  "recording": rank_to_json(recorded), "whole": whole}
        return recorded_before.put(key, result)

    @answered_together("installing the slice plan")
    def ckpt_use_slice_plan(self, plan: dict) -> dict:
        """Install a slice plan merged from every worker's recording (``VllmClient.slice_plan``):
        checked whole (``planning.slices.check_plan``) and refused unless it was recorded for this
        engine's model, layout and vLLM version. Returns its digest and this worker's bytes."""
        from ckpt_core.planning.slices import plan_from_json

        from ._slices import ReplayPlan, check_installed, slice_key

        problem = None
        try:
            parsed = plan_from_json(plan)
            rank = _slice_rank(self)
            specs = {n: (d, tuple(s)) for n, (d, s, _) in parsed.tensors.items()}
            check_installed(parsed.key, slice_key(self.model_runner.model, self.model_config,
                                                  self.vllm_config.parallel_config, specs))
        except Exception as exc:   # noqa: BLE001 - a malformed plan: every worker reaches the agreement below
            problem = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
        refused = refuse_together(problem, "the slice plan")
        if refused is not None:
            return refused
        _SLICE_PLANS.put(parsed.digest, ReplayPlan(parsed.digest, parsed.key, parsed.rank(rank), parsed.tensors))
        return {"plan": parsed.digest, "rank": rank, "bytes": parsed.rank_bytes(rank),
                "whole_bytes": parsed.whole_bytes()}

    def ckpt_holds_slice_plan(self, digest: str) -> bool:
        """Whether this worker holds the slice plan of that digest (installed, not evicted since)."""
        return str(digest) in _SLICE_PLANS

    def _ckpt_made_live(self, layout: dict, version: str | None) -> None:
        reset_derived_caches(self)
        # weights made live by any other path drop the direct map (conservatively: they reload in place,
        # but the map is cheap to record again and is only ever used as recorded); the direct path sets it after
        self._ckpt_direct = None
        self._ckpt_live_layout = dict(layout)
        self._ckpt_live_version = version
        self._ckpt_live_since = time.time()
        self._ckpt_mixed = False

    def _ckpt_forget_live(self, mixed: bool = False) -> None:
        """The model may no longer hold the live version whole (an update or commit that failed once a
        worker of the engine began writing, ``_live.settle``: ``mixed``; an update through the ``ckpt``
        backend's routes, which name no version): no version is live and no delta base is held until a full
        update of the extension; the direct map is kept (it describes the model, not its weights)."""
        reset_derived_caches(self)
        self._ckpt_drop_held()
        self._ckpt_live_version = None
        self._ckpt_live_since = time.time()
        self._ckpt_mixed = mixed

    def ckpt_state_digests(self) -> dict[str, list]:
        """``{name: [dtype, shape, sha256]}`` of everything this worker's model reads in its
        forward pass: parameters, buffers, derived kernel tensors and a probe of each linear
        layer (:func:`ckpt_vllm._digest.state_digests`). Compare with a cold load of the same
        checkpoint in the same vLLM: ``POST /collective_rpc {"method": "ckpt_state_digests"}``.
        """
        from ._digest import state_digests

        return state_digests(self.model_runner.model, dtype=getattr(self.model_config, "dtype", None))

    def _ckpt_zmq_context(self):
        # One context per worker process, for its lifetime. No destroy hook on purpose: a hook
        # name that a future vLLM worker also defines would stop vLLM from starting.
        import zmq

        ctx = getattr(self, "_ckpt_zmq_ctx", None)
        if ctx is None:
            ctx = self._ckpt_zmq_ctx = zmq.Context()
        return ctx
