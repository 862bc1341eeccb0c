"""Requester: drive a vLLM server's side of an update over HTTP (TCP or a Unix socket).

Two paths, same result:

- ``extension`` (any vLLM with ``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension``):
  one ``POST /collective_rpc`` calling ``update_weights_from_ipc`` on every worker.
- ``backend`` (vLLM with the weight-transfer API and ``--weight-transfer-config
  '{"backend": "ckpt"}'``): ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``.

Both then reset the prefix cache, whose KV blocks were computed with the old weights. Both need
``VLLM_SERVER_DEV_MODE=1`` on the server. Errors are ckpt_core's: ``UpdateTimeoutError``,
``TransportError`` (cannot connect), ``RemoteWorkerError`` (the server answered an error, its
text attached), ``ConfigError`` (a route is missing: dev mode off, or no weight-transfer API).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable

from ckpt_core.engines.base import Requester, UpdateReport, mixed_weight_version
from ckpt_core.engines.http import Phases
from ckpt_core.engines.requests import group_handles
from ckpt_core.errors import ConfigError, RemoteWorkerError, TransportError

from ._stage_polls import prepare_staged, wait_staged

if TYPE_CHECKING:
    from ckpt_core.planning.slices import SlicePlan

__all__ = ["VllmClient", "UpdateReport", "PATHS"]

PATHS = ("extension", "backend")
PAUSE_MODES = ("abort", "wait", "keep")
# vLLM's executor stops reading the workers' replies at its deadline and leaves them to answer the
# next call: its deadline must outlast the workers' own (a worker whose PS gave the update up before
# it connected waits out its timeout, and every worker answers together, at the slowest one).
EXECUTOR_MARGIN_S = 60.0


def _check_update(path: str, start: bool, finish: bool, pause: str | None, stage: str | None,
                  version: str | None, deltas: bool) -> None:
    """What :meth:`VllmClient.update` refuses before anything is posted."""
    if deltas and (path != "extension" or (version is None and stage is None)):
        raise ConfigError("deltas=True takes the extension path and needs version= (a delta names its base by "
                          "it; a staged one, stage=): docs/deltas.md")
    if stage is not None:
        if path != "extension" or pause is not None or not (start and finish):
            raise ConfigError("a staged update takes the extension path, whole, without a pause "
                              "(the engine keeps serving while it stages; commit() pauses)")
        return
    _check_parts(path, start, finish, pause)


def _check_parts(path: str, start: bool, finish: bool, pause: str | None) -> None:
    """An update's path, and whether it may be one part of a checkpoint spread over several."""
    if path not in PATHS:
        raise ConfigError(f"path must be one of {PATHS}, got {path!r}")
    if not (start and finish) and path != "backend":
        raise ConfigError("start=False / finish=False (one checkpoint over several updates) needs path='backend'")
    if not (start and finish) and pause is None:
        raise ConfigError("spreading a checkpoint over several updates needs a pause (pause='wait', "
                          "'abort' or 'keep'): between the parts the model cannot serve")


class VllmClient(Requester):
    """HTTP client of one vLLM server (an :class:`~ckpt_core.engines.base.EngineClient`). Thread-safe;
    ``close()`` is idempotent.

    Example::

        with VllmClient("http://127.0.0.1:8000") as client:
            client.wait_ready(timeout=300)
            ps.update("step-7", client.req_func(rank=ps.rank, path="extension", pause="wait"))
            print(client.last_report)
    """

    READY_ROUTE = "/health"

    def __init__(self, endpoint: str = "http://127.0.0.1:8000", *, uds: str | None = None,
                 timeout: float = 600.0, connect_timeout: float = 10.0):
        super().__init__(endpoint, uds=uds, timeout=timeout, connect_timeout=connect_timeout)

    def not_served(self, path: str) -> str:
        extra = "" if path == "/collective_rpc" else " and a weight-transfer config"
        return f"start vLLM with VLLM_SERVER_DEV_MODE=1{extra}"

    # -- readiness -----------------------------------------------------------------
    def healthy(self, timeout: float = 5.0) -> bool:
        """True if ``GET /health`` answers 200 within ``timeout`` seconds; never raises a transport error."""
        try:
            return self._request("GET", "/health", timeout=timeout).status_code == 200
        except (TransportError, RemoteWorkerError, ConfigError):
            return False

    # -- calls -------------------------------------------------------------------
    def collective_rpc(self, method: str, args: list | tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """Call ``method`` on every worker; returns one result per worker.

        A call that failed or was refused on any worker is answered by every worker in the same
        call (the last one raises, vLLM answers an error: ``RemoteWorkerError``; the others return
        ``{"refused": ...}``, ``ckpt_vllm._sessions.answer_together``). Replies marked refused
        without an error (an executor that reads every reply before raising) raise the same error."""
        wait = self.timeout if timeout is None else float(timeout)
        body = {"method": method, "args": list(args), "kwargs": kwargs or {}, "timeout": wait}
        reply = self._post("/collective_rpc", body, timeout=wait + 30.0)  # the server times out first
        results = (reply or {}).get("results", [])
        refused = [(i, r) for i, r in enumerate(results) if isinstance(r, dict) and "refused" in r]
        if refused:
            raise RemoteWorkerError(f"{self.where}: {method} was refused by worker(s) {[i for i, _ in refused]}: "
                                    f"{refused[0][1].get('error_type', 'error')}: {refused[0][1]['refused']}")
        return results

    def reset_prefix_cache(self, *, running: bool = False) -> bool:
        """Drop cached KV blocks; False when vLLM refused (blocks still held). ``running``: also
        preempt running requests (they are recomputed, with the weights now loaded)."""
        reply = self._post("/reset_prefix_cache", params={"reset_running_requests": "true"} if running else None)
        return bool((reply or {}).get("success", True))

    def ensure_prefix_cache_reset(self, timeout: float = 30.0) -> None:
        """Reset the prefix cache, or raise: a stale entry makes a cached prompt answer from old weights.

        Running requests hold blocks, and vLLM then refuses a plain reset (it only logs that):
        they are preempted and recomputed (their KV was computed with the old weights anyway).
        Retried until ``timeout`` while vLLM still refuses (KV transfers in flight).
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.reset_prefix_cache(running=True):
                    return
                last = "success=false"
            except RemoteWorkerError as exc:   # vLLM raises when the forced reset fails too
                last = str(exc)
            if time.monotonic() > deadline:
                raise RemoteWorkerError(f"{self.where} refused to reset its prefix cache for {timeout:g} s "
                                        f"({last}): cached prompts would answer from the old weights")
            time.sleep(0.2)

    def pause(self, mode: str = "wait") -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._post("/pause", params={"mode": mode})

    def resume(self) -> None:
        self._post("/resume")

    def is_paused(self) -> bool:
        reply = self._request("GET", "/is_paused").json()
        return bool(reply.get("is_paused") if isinstance(reply, dict) else reply)

    # -- updates -------------------------------------------------------------------
    def update(self, handles, *, path: str = "extension", timeout: float | None = None,
               pause: str | None = None, init_info: dict | None = None,
               start: bool = True, finish: bool = True, stage: str | None = None,
               stage_device_bytes: int = 0, version: str | None = None, prepare: bool = False,
               slices: str | None = None, deltas: bool = False, direct: bool = False) -> UpdateReport:
        """Make the server pull one update; ``handles``: ``[(device_key, zmq_handle)]`` or a dict.

        ``pause``: pause generation around the update ("wait" lets running requests finish,
        "abort" drops them, "keep" freezes them); None leaves traffic running (requests then
        see the new weights from the next engine step on, and running ones are recomputed).

        One checkpoint spread over several PS updates (backend path only): the first call with
        ``finish=False``, the middle ones with ``start=False, finish=False``, the last with
        ``start=False``. The completeness check then runs at the last call's
        ``/finish_weight_update``; a pause is required (between the parts the model is half
        reloaded) and lasts from the first call to the last, or to the first failure.

        On any failure the server is resumed and the weight update ended (old weights serve
        for every layer not yet processed); the original error is raised, with a failing
        cleanup added as a note.

        ``stage="v8"`` stages the update instead (:meth:`stage`, with ``prepare``); :meth:`commit`
        switches to it. ``version``: the weight version this update makes live (the workers record it; vLLM's
        ``/update_weight_version`` is set where the server has it).
        ``slices``: a plan from :meth:`slice_plan` (or its digest) that the PS update routes by
        (either path, staged or not): each worker then receives only its slices.
        ``deltas``: the PS update may be a delta of the version the workers hold
        (``ParameterServer.update(..., delta=True)``; a full one is kept as the next delta's base):
        extension path, with ``version`` (or ``stage``); docs/deltas.md.
        ``direct``: once the workers recorded where this plan's tensors land (the first such update,
        loaded the usual way), tensors of layers that read them verbatim are copied straight into the
        live model, the other layers reloaded: extension path, a plain full update (docs/vllm.md,
        "Direct full updates"); ``report.workers[i]["direct"]`` says which way each worker went.
        """
        slices = getattr(slices, "digest", slices)
        _check_update(path, start, finish, pause, stage, version, deltas)
        if direct and (path != "extension" or stage is not None or slices is not None or deltas):
            raise ConfigError("direct=True takes the extension path and a plain full update (not staged, sliced or a "
                              "delta): docs/vllm.md, Direct full updates")
        if stage is not None:
            return self.stage(handles, stage, timeout=timeout, device_bytes=stage_device_bytes, prepare=prepare,
                              slices=slices, deltas=deltas)
        wait = self.timeout if timeout is None else float(timeout)
        report = UpdateReport(path=path)
        extra = {**({"slices": str(slices)} if slices is not None else {}), **({"deltas": True} if deltas else {}),
                 **({"direct": True} if direct else {})}
        self._update_phases(report, dict(handles), wait, extra, pause=pause, init_info=init_info, start=start,
                            finish=finish, version=version)
        return self._record(report)

    def _update_phases(self, report: UpdateReport, handles: dict, wait: float, extra: dict, *, pause: str | None,
                       init_info: dict | None, start: bool, finish: bool, version: str | None) -> None:
        """:meth:`update`'s phases into ``report``: pause, load (either path), prefix cache, version,
        resume; on failure, what was begun is undone and the error raised."""
        path = report.path
        phases = Phases()
        phases.seconds = report.seconds
        t0 = time.perf_counter()
        # what a failure must undo: a pause (even one that failed half-way), an open weight update
        # (and "posted": /update_weights was posted, so vLLM's weight version must not keep the old name)
        undo = {"resume": False, "finish": path == "backend" and not start,   # begun by an earlier call
                "posted": False}
        try:
            if pause is not None and start:
                undo["resume"] = True
                phases.run("pause", self.pause, pause)
            if path == "extension":
                named = {"version": str(version)} if version is not None else {}
                report.workers = phases.run("update", self.collective_rpc, "update_weights_from_ipc", [handles],
                                            {"timeout": wait, **named, **extra}, timeout=wait + EXECUTOR_MARGIN_S)
            else:
                self._backend_update(phases, undo, {"zmq_handles": handles, "timeout_s": wait, **extra},
                                     init_info=init_info, start=start, finish=finish)
            if finish:
                phases.run("reset_prefix_cache", self.ensure_prefix_cache_reset)
                if version is not None:
                    phases.run("weight_version", self.set_weight_version, str(version))
        except BaseException as exc:
            if undo["finish"]:   # vLLM's workers stay "in a weight update" until a finish: end it (the
                # failed part was aborted on every worker; nothing is left to load)
                self._cleanup(exc, "finish_weight_update", lambda: self._post("/finish_weight_update"))
            if version is not None and (path == "extension" or undo["posted"]):   # before generation resumes
                # the backend's routes do not say whether a layer was reloaded: once /update_weights was
                # posted, a mix is assumed (docs/vllm.md: layers processed before a failure hold new weights)
                self._cleanup(exc, "weight_version", lambda: self._mark_mixed(str(version), assume=path == "backend"))
            if pause is not None or undo["resume"]:
                self._cleanup(exc, "resume", self.resume)
            raise
        if pause is not None and finish:
            phases.run("resume", self.resume)
        report.seconds["total"] = time.perf_counter() - t0

    def _backend_update(self, phases: Phases, undo: dict, info: dict, *, init_info: dict | None,
                        start: bool, finish: bool) -> None:
        """The native weight-transfer routes: init, start, the update, finish (the parts this call has)."""
        if init_info is not None:
            phases.run("init", self._post, "/init_weight_transfer_engine", {"init_info": init_info})
        if start:
            phases.run("start", self._post, "/start_weight_update")
            undo["finish"] = True
        info["check_complete"] = start and finish
        undo["posted"] = True
        try:
            phases.run("update", self._post, "/update_weights", {"update_info": info}, timeout=info["timeout_s"] + 30.0)
        except RemoteWorkerError:
            undo["finish"] = False   # the workers answered: each ended vLLM's weight update (transfer_engine.py)
            raise
        if finish:
            undo["finish"] = False   # a failed finish ends the weight update itself
            phases.run("finish", self._post, "/finish_weight_update")

    def slice_plan(self, tensors: dict, *, reuse=None) -> "SlicePlan":
        """Record, on every worker, which part of each tensor its loaders read; merge, check
        (``planning.slices.check_plan``: no hole, no overlap, not empty) and install the plan on
        every worker; returns it, for ``ParameterServer.update(..., slices=plan)`` and
        ``update(..., slices=plan.digest)``. ``tensors``: ``ParameterServer.tensor_specs(name)``.
        Record again for another checkpoint layout, parallel layout or vLLM version.

        ``reuse``: a plan this engine was given before; returned as it is, without recording or
        installing anything, when it is of these tensors and every worker still holds it (a plan
        of a large model is tens of MB of JSON, seconds to merge, check and install)."""
        from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
        from ckpt_core.planning.slices import SliceKey, merge_ranks, plan_to_json, rank_from_json

        if reuse is not None and self._still_holds(reuse, tensors):
            return reuse
        specs = {n: [d, list(s)] for n, (d, s) in dict(tensors).items()}
        results = self.collective_rpc("ckpt_slice_plan", [specs])
        keys = {json.dumps(r.get("key"), sort_keys=True) for r in results}
        if len(keys) != 1:
            raise ConfigError(f"the workers of {self.where} recorded slice plans for different keys: {sorted(keys)}")
        key = SliceKey(**results[0]["key"])
        itemsized = {n: (d, tuple(s), WIRE_DTYPES[d].itemsize) for n, (d, s) in specs.items()}
        plan = merge_ranks(key, itemsized, [rank_from_json(r["recording"]) for r in results])
        self.collective_rpc("ckpt_use_slice_plan", [plan_to_json(plan)])
        self.last_slice_whole = [r.get("whole", {}) for r in results]
        return plan

    def _still_holds(self, plan, tensors: dict) -> bool:
        same = {n: (d, tuple(s)) for n, (d, s) in dict(tensors).items()} == {
            n: (d, tuple(s)) for n, (d, s, _) in plan.tensors.items()}
        return same and all(self.collective_rpc("ckpt_holds_slice_plan", [plan.digest]))

    # -- staged updates ----------------------------------------------------------------
    def stage(self, handles, version: str, *, timeout: float | None = None, device_bytes: int = 0,
              prepare: bool = False, prepare_step_bytes: int = 512 << 20, slices=None,
              deltas: bool = False) -> UpdateReport:
        """Receive an update into every worker's staging area while the server keeps serving.

        ``device_bytes``: device memory each worker may stage into (beyond it: pinned host
        memory). Nothing live changes; a failed stage frees the area. Staging again replaces it.

        ``prepare``: then turn the staged tensors into the engine's kernel format, a few layers per
        short RPC between engine steps (``prepare_step_bytes`` each), so that the commit is one
        device copy. It needs as much device memory again as the model's weights until the
        commit; a model whose processing does more than fill its tensors (vLLM-CPU, quantized KV
        caches) is not prepared and its commit reloads (``report.workers``' ``prepare`` says why).

        ``slices``: the plan (or its digest) the PS update routes by (:meth:`slice_plan`): each worker
        stages only its slices, and :meth:`commit` applies them through the same reload path as a
        sliced update (such a stage is never prepared).

        ``deltas``: the PS update may be a delta (``ParameterServer.update(..., delta=True)``) of the
        version the workers hold: its payloads are staged, and :meth:`commit` applies them as an
        update applies a delta (docs/deltas.md); such a stage is never prepared.
        """
        slices = getattr(slices, "digest", slices)
        wait = self.timeout if timeout is None else float(timeout)
        report = UpdateReport(path="stage")
        phases = Phases()
        phases.seconds = report.seconds
        phases.run("start", self.collective_rpc, "update_weights_from_ipc", [dict(handles)],
                   {"timeout": wait, "stage": str(version), "stage_device_bytes": int(device_bytes),
                    **({"slices": str(slices)} if slices is not None else {}),
                    **({"deltas": True, "version": str(version)} if deltas else {})}, timeout=wait)
        report.workers = phases.run("stage", self._wait_staged, str(version), wait)
        if prepare:
            prepared = phases.run("prepare", self._prepare_staged, str(version), int(prepare_step_bytes), wait)
            for worker, state in zip(report.workers, prepared):
                worker["prepare"] = state
        return self._record(report)

    def _rpc(self, timeout: float):
        return lambda method, args, kwargs: self.collective_rpc(method, args, kwargs, timeout=min(timeout, 60.0))

    def _wait_staged(self, version: str, timeout: float, poll_s: float = 0.02) -> list[dict]:
        """Poll the workers' stage threads until every one is done (``_stage_polls.wait_staged``);
        on a worker's failure or after ``timeout`` the stage is dropped and the error raised."""
        return wait_staged(self._rpc(timeout), version, timeout, where=self.where, poll_s=poll_s,
                           give_up=lambda exc: self._cleanup(exc, "drop_staged", self.drop_staged))

    def _prepare_staged(self, version: str, step_bytes: int, timeout: float) -> list[dict]:
        return prepare_staged(self._rpc(timeout), version, step_bytes, timeout, where=self.where)[0]

    def commit(self, version: str, *, pause: str = "keep", timeout: float | None = None) -> UpdateReport:
        """Switch the server to the staged ``version``: pause (``keep``: running requests freeze and
        resume on the new weights), load the staged tensors through the reload path, reset the
        prefix cache, set vLLM's weight version where the server has that route, resume.

        ``report.seconds["paused"]`` is how long generation stood still. A version that is not
        staged on every worker is a ``RemoteWorkerError`` (ConfigError on the worker) and changes
        nothing; the server is resumed on every failure.
        """
        if pause not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {pause!r}")
        wait = self.timeout if timeout is None else float(timeout)
        report = UpdateReport(path="commit")
        phases = Phases()
        phases.seconds = report.seconds
        t0 = time.perf_counter()
        try:
            phases.run("pause", self.pause, pause)
            report.workers = phases.run("commit", self.collective_rpc, "commit_staged_weights", [str(version)],
                                        timeout=wait)
            phases.run("reset_prefix_cache", self.ensure_prefix_cache_reset)
            phases.run("weight_version", self.set_weight_version, str(version))
        except BaseException as exc:
            self._cleanup(exc, "weight_version", lambda: self._mark_mixed(str(version)))
            self._cleanup(exc, "resume", self.resume)
            raise
        phases.run("resume", self.resume)
        report.seconds["paused"] = time.perf_counter() - t0
        report.seconds["total"] = report.seconds["paused"]
        return self._record(report)

    def drop_staged(self) -> list:
        """Free every worker's staging area; returns what each held (None where nothing was)."""
        return self.collective_rpc("drop_staged_weights")

    def weight_versions(self) -> list[dict]:
        """Per worker: the live version (and since when, unix time) and what is staged. After an update
        or commit the workers agree on ``live``: a failed one that any worker had begun writing leaves
        none live on every worker (docs/vllm.md, "What a failed update leaves")."""
        return self.collective_rpc("ckpt_weight_versions")

    def live_version(self) -> str | None:
        """The version this engine holds live: the one every worker reports; None when any reports none
        (a failed update may have left a mix: push a full update) or the workers differ."""
        lives = {w.get("live") for w in self.weight_versions()}
        return lives.pop() if len(lives) == 1 else None

    def _mark_mixed(self, version: str, assume: bool = False) -> None:
        """After a failed update or commit to ``version``: where the workers report that one of them had
        begun writing (``mixed``: a mix of two versions may serve), or ``assume`` (the backend's routes,
        which do not say), vLLM's own weight version, which its outputs carry, becomes
        :func:`~ckpt_core.engines.base.mixed_weight_version` instead of the old version's name until a
        full update succeeds."""
        if assume or any(w.get("mixed") for w in self.weight_versions()):
            self.set_weight_version(mixed_weight_version(version))

    def set_weight_version(self, version: str) -> bool:
        """vLLM's own weight version (``/update_weight_version``, reported on outputs); False where
        the server has no such route (older vLLM)."""
        try:
            self._post("/update_weight_version", {"new_version": str(version)})
        except ConfigError:
            return False
        return True

    def req_func(self, *, rank: int | None = None, inference_parallel_size: int | None = None,
                 **update_kwargs) -> Callable[[list[tuple[str, str]]], UpdateReport | None]:
        """The ``req_func`` for ``ParameterServer.update``; other keyword arguments go to :meth:`update`.

        ``req_func`` runs on every PS rank. With ``rank`` (the PS rank), only the first rank of
        each inference group of ``inference_parallel_size`` ranks (default: all ranks, one engine)
        posts, with its group's handles (``ckpt_core.engines.requests.group_handles``); without ``rank``,
        every call posts all handles: build it on the posting rank only.
        """
        if rank is None:
            return lambda handles: self.update(handles, **update_kwargs)

        def req_func(handles):
            mine = group_handles(handles, rank, inference_parallel_size)
            return None if mine is None else self.update(mine, **update_kwargs)
        return req_func

