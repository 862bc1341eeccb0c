"""Requester: drive an SGLang server's side of an update over HTTP (TCP or a Unix socket).

SGLang's engine embeds the stock checkpoint-engine worker, so the parameter server must speak
the stock wire (``ParameterServer(wire="stock")``). One ``POST /update_weights_from_ipc`` makes
every worker of the engine pull from its PS rank. Routes used:

- ``GET /model_info``: readiness (``/health`` stays 503 until the first weights arrived).
- ``POST /update_weights_from_ipc`` ``{"zmq_handles", "flush_cache", "weight_version"}``:
  ``{"success", "message"}``, HTTP 400 on failure.
- ``POST /pause_generation`` ``{"mode"}``, ``POST /continue_generation``, ``POST /flush_cache``.
- Staged updates (``stage``/``commit``/``drop_staged``/``weight_versions``; the server started
  with ``--custom-weight-loader ckpt_sglang.staging.load``, see ``ckpt_sglang/staging.py``):
  ``GET /server_info``, ``/update_weights_from_tensor`` (``load_format`` = that loader),
  ``/update_weight_version``. ``state_digests``: the same route with ``ckpt_sglang.probe.load``.
- Direct updates (``update(..., via="loader")``; ``via=None`` takes them where the server runs our
  loader and has its first weights): the same tensor route, our loader's ``load`` op receiving the
  update straight into SGLang's ``load_weights``; then ``/flush_cache`` and ``/update_weight_version``.
- ``POST /begin_weight_update`` .. ``/end_weight_update``: every call of ours that loads weights
  (the IPC update included) runs inside SGLang's weight-update session where the server has one;
  a server without the route (0.5.17) is remembered and loads as before (``_server.py``).
- Before loading, a model SGLang cannot reload in place (FP8 per tensor, ...) is refused with
  ``ConfigError``, nothing posted (``_server.reload_problem``); ``req_func(...).precheck`` lets
  ``ParameterServer.update`` refuse it on every rank before anything moves.

With ``flush_cache`` and requests in flight, SGLang loads the weights and then answers 400
("the cache was not flushed"): the weights are in, only the KV cache of the old weights is
left. ``busy="retract"`` (default) or ``"abort"`` then pauses generation that way, flushes the
cache and continues; ``busy="fail"`` raises. ``pause=`` instead pauses around the whole update.
Errors are ckpt_core's (``ckpt_core.engines.http``): ``UpdateTimeoutError``, ``TransportError``,
``RemoteWorkerError`` (with the server's message), ``ConfigError``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ckpt_core.delta.versions import accepts_deltas
from ckpt_core.engines.base import Prechecked, Requester, UpdateReport, mixed_weight_version
from ckpt_core.engines.http import Phases, error_text
from ckpt_core.errors import CkptError, ConfigError, RemoteWorkerError

from ._protocol import LOADER, PROBE_LOADER, ReplySocket, encode_command
from ._server import ServerFeatures

__all__ = ["SglangClient", "UpdateReport", "PAUSE_MODES", "BUSY_MODES", "COMMIT_PAUSE_MODES", "VIA"]

log = logging.getLogger("ckpt_sglang.client")

PAUSE_MODES = ("abort", "retract", "in_place")
BUSY_MODES = ("retract", "abort", "fail")
COMMIT_PAUSE_MODES = ("retract", "in_place")   # no request is dropped
VIA = ("loader", "ipc", None)   # SglangClient.update's routes; None: chosen per server
CACHE_NOT_FLUSHED = "cache was not flushed"   # SGLang's 400 text when requests were still running


class SglangClient(Requester):
    """HTTP client of one SGLang server (an :class:`~ckpt_core.engines.base.EngineClient`). Thread-safe;
    ``close()`` is idempotent.

    Example::

        with SglangClient("http://127.0.0.1:30000") as client:
            client.wait_ready(timeout=300)
            ps = ParameterServer(wire="stock")
            ...
            ps.update("step-7", client.req_func(weight_version="7"))
    """

    # ``/model_info`` answers as soon as the HTTP server runs, also while a server started with
    # ``--checkpoint-engine-wait-weights-before-ready`` waits for its first weights (``/health`` is 503 then).
    READY_ROUTE = "/model_info"

    def __init__(self, endpoint: str = "http://localhost:19730", *, uds: str | None = None,
                 timeout: float = 600.0, connect_timeout: float = 10.0):
        super().__init__(endpoint, uds=uds, timeout=timeout, connect_timeout=connect_timeout)
        self.server = ServerFeatures(self.http)

    def __enter__(self) -> "SglangClient":
        return self

    def not_served(self, path: str) -> str:
        return "is this an SGLang server?"

    def _post(self, path: str, body: dict | None = None, *, timeout: float | None = None, **kw) -> dict:
        """POST ``body``; the answer as a dict (a text answer as ``{"message": text}``)."""
        resp = self._request("POST", path, json=body, timeout=timeout, **kw)
        try:
            reply = resp.json()
        except ValueError:
            return {"message": resp.text}
        return reply if isinstance(reply, dict) else {"message": str(reply)}

    # -- calls -------------------------------------------------------------------------
    def pause(self, mode: str = "retract") -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._post("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._post("/continue_generation", {})

    def flush_cache(self) -> None:
        self._post("/flush_cache")

    def update(self, handles, *, flush_cache: bool = True, weight_version: str | None = None,
               timeout: float | None = None, pause: str | None = None, busy: str = "retract",
               stage: str | None = None, stage_device_bytes: int = 0,
               stage_pause: str | None = "in_place", via: str | None = None, deltas: bool = False) -> UpdateReport:
        """Make the server pull one update; ``handles``: ``[(device_key, zmq_handle)]`` or a dict.

        ``via``: ``"loader"`` loads through our loader (``ckpt_sglang.staging.load``, its ``load``
        op: the stock worker loop straight into SGLang's ``load_weights``, with a lowered switch
        interval while it receives); ``"ipc"`` through SGLang's ``/update_weights_from_ipc``;
        None: ``"loader"`` where the server runs our loader, except while it waits for its first
        weights (``--checkpoint-engine-wait-weights-before-ready``: only a successful IPC update
        marks them loaded), i.e. until this client's first IPC update succeeded there.

        ``pause``: pause generation (``PAUSE_MODES``) around the update; None keeps serving.
        ``busy``: what to do when the weights went in but the cache could not be flushed
        because requests were running (see the module docstring).
        ``stage="v8"``: stage the update instead (:meth:`stage`, ``stage_pause`` its ``pause``);
        :meth:`commit` switches to it.

        ``deltas=True`` (docs/deltas.md, "SGLang"): the update goes through our loader (``via`` None or
        ``"loader"``) and takes a delta (``ParameterServer.update(..., delta=True)``) or a full update;
        a full one keeps what later deltas need. ``weight_version`` is required: it must be the
        checkpoint's name on the PS (a delta names its base by it).
        """
        if stage is not None:
            if pause is not None or weight_version is not None:
                raise ConfigError("a staged update takes neither pause nor weight_version: the server keeps "
                                  "generating while it stages; commit(version) pauses and sets the version")
            return self.stage(handles, stage, timeout=timeout, device_bytes=stage_device_bytes, pause=stage_pause,
                              deltas=deltas)
        if busy not in BUSY_MODES:
            raise ConfigError(f"busy must be one of {BUSY_MODES}, got {busy!r}")
        if pause is not None and pause not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {pause!r}")
        if deltas:
            if weight_version is None:
                raise ConfigError("deltas=True needs weight_version: the checkpoint's name, by which a delta "
                                  "names its base")
            if via == "ipc":
                raise ConfigError("deltas=True loads through our loader (via='loader'): SGLang's IPC route would "
                                  "load a delta's payloads as tensors")
            via = "loader"
        route = self.route(via)
        wait = self.http.timeout if timeout is None else float(timeout)
        self.server.check_reloadable()   # before anything is posted
        phases, report = Phases(), UpdateReport(path=route)
        t0 = time.perf_counter()
        if pause is not None:
            phases.run("pause", self.pause, pause)
        try:
            try:
                if route == "loader":
                    self._load(phases, report, dict(handles), weight_version, wait, deltas)
                    if flush_cache:
                        self._flush(phases, report, busy, pause)
                else:
                    self._ipc(phases, report, dict(handles), flush_cache, weight_version, wait, busy, pause)
            finally:
                if pause is not None:
                    phases.run("resume", self.resume)
        except BaseException as exc:
            if route == "loader" and weight_version is not None:
                self._cleanup(exc, "weight_version", lambda: self._mark_mixed(str(weight_version)))
            raise
        report.seconds = dict(phases.seconds, total=time.perf_counter() - t0)
        return self._record(report)

    def route(self, via: str | None = None) -> str:
        """The route :meth:`update` takes for ``via`` (``"loader"`` or ``"ipc"``; see there)."""
        if via not in VIA:
            raise ConfigError(f"via must be one of {VIA}, got {via!r}")
        if via == "loader":
            self.server.require_loader(LOADER, "direct loads (via='loader')")
            return "loader"
        if via == "ipc":
            return "ipc"
        try:
            direct = self.server.has_loader(LOADER) and not self.server.awaiting_first_weights()
        except CkptError as exc:   # /server_info unreadable: the IPC post then fails (or works) as it would
            log.debug("%s: cannot tell whether it runs %s (%s): the IPC route", self.where, LOADER, exc)
            return "ipc"
        return "loader" if direct else "ipc"

    def _ipc(self, phases: Phases, report: UpdateReport, handles: dict, flush_cache: bool,
             weight_version: str | None, wait: float, busy: str, pause: str | None) -> None:
        body = {"zmq_handles": handles, "flush_cache": flush_cache, "weight_version": weight_version}
        resp = self._in_session(phases, "all", lambda: phases.run(
            "update", self.http.request, "POST", "/update_weights_from_ipc", json=body, timeout=wait))
        if resp.status_code == 404:
            raise ConfigError(f"/update_weights_from_ipc is not served by {self.where} (HTTP 404)")
        report.message = error_text(resp)
        if resp.status_code == 400 and CACHE_NOT_FLUSHED in report.message and busy != "fail":
            report.busy = True
            self._flush_while_paused(phases, busy if pause is None else None)
        else:
            self.http.raise_for_status(resp)
            self.server.first_weights_loaded()

    def _load(self, phases: Phases, report: UpdateReport, handles: dict, weight_version: str | None,
              wait: float, deltas: bool = False) -> None:
        """Our loader's ``load`` op on every TP rank (in SGLang's session where it has one); then
        SGLang's ``weight_version`` (after the load: SGLang's tensor route would set it even when
        our loader reports a failure)."""
        ranks = self.server.require_loader(LOADER, "direct loads (via='loader')")
        fields: dict[str, Any] = {"weights": weight_version, "handles": handles, "receive_timeout": wait}
        if deltas:
            fields["deltas"] = True
        report.workers = self._session_op(phases, "load", None, wait, ranks, phase="update", **fields)
        report.message = f"loaded through {LOADER} on {ranks} TP rank(s)"
        if weight_version is not None:
            phases.run("weight_version", self.set_weight_version, str(weight_version))

    def _flush(self, phases: Phases, report: UpdateReport, busy: str, pause: str | None) -> None:
        """Flush the old weights' cache after a direct load; requests in flight are handled as
        :meth:`update`'s ``busy`` says (as SGLang's IPC route's 400 is)."""
        try:
            phases.run("flush_cache", self.flush_cache)
        except RemoteWorkerError:
            if busy == "fail" or pause is not None:
                raise
            report.busy = True
            self._flush_while_paused(phases, busy)

    def _flush_while_paused(self, phases: Phases, mode: str | None) -> None:
        """The weights are in; requests in flight kept SGLang from flushing the old weights' cache."""
        if mode is None:   # already paused by the caller
            phases.run("flush_cache", self.flush_cache)
            return
        phases.run("pause", self.pause, mode)
        try:
            phases.run("flush_cache", self.flush_cache)
        except RemoteWorkerError as exc:
            raise RemoteWorkerError(f"weights were updated on {self.where}, but its KV cache of the old "
                                    f"weights could not be flushed even after pausing ({mode}): {exc}") from exc
        finally:
            phases.run("resume", self.resume)

    def _in_session(self, phases: Phases, selector: str, load: Callable[[], object]):
        """``load()`` inside SGLang's weight-update session where the server has one (the session
        is closed also when ``load`` fails: its end post-processes whatever was loaded)."""
        if self.server.sessions is False:   # known: this server has none
            return load()
        opened = phases.run("begin", self.server.begin, selector)
        try:
            out = load()
        except BaseException as exc:
            if opened:
                self._cleanup(exc, "end_weight_update", self.server.end)
            raise
        if opened:
            phases.run("end", self.server.end)
        return out

    def req_func(self, **update_kwargs) -> Prechecked[UpdateReport]:
        """A ``req_func`` posting every handle it is given; keyword arguments go to :meth:`update`.

        It carries ``precheck`` (:meth:`check_reloadable`): ``ParameterServer.update`` asks it before
        anything moves, so a model SGLang cannot reload is refused on every rank at once. With
        ``deltas=True`` it is marked as taking deltas (``ckpt_core.delta.versions.accepts_deltas``), which
        ``ParameterServer.update(..., delta=True)`` asks of every rank's ``req_func`` on the stock wire."""
        def req_func(handles):
            return self.update(handles, **update_kwargs)
        out = Prechecked(req_func, self.check_reloadable)
        if update_kwargs.get("deltas"):
            named = update_kwargs.get("weight_version") or update_kwargs.get("stage")
            if named is None or update_kwargs.get("via") == "ipc":
                raise ConfigError("req_func(deltas=True) needs weight_version (or stage): the checkpoint's name, by "
                                  "which a delta names its base; and our loader (via None or 'loader')")
            accepts_deltas(out)   # a delta over the stock wire reaches our loader, which applies it
        return out

    def check_reloadable(self) -> None:
        """``ConfigError`` when SGLang cannot load a checkpoint into this server's live model
        (``ckpt_sglang._server.reload_problem``: FP8 per tensor and other formats whose
        post-processing replaces the weight); nothing is posted."""
        self.server.check_reloadable()

    def precheck(self) -> None:
        """The :class:`~ckpt_core.engines.base.EngineClient` precheck: :meth:`check_reloadable`."""
        self.check_reloadable()

    # -- staged updates (ckpt_sglang/staging.py runs inside the server) ---------------------
    def staging_ranks(self) -> int:
        """The server's TP size, once it is known to run our loader (``GET /server_info``)."""
        return self.server.require_loader(LOADER, "staged updates")

    def _session_op(self, phases: Phases, op: str, pause: str | None, timeout: float, ranks: int,
                    loader: str = LOADER, phase: str | None = None, **fields) -> list:
        """Pause, run ``op`` in our loader on every TP rank (inside SGLang's weight-update session
        where the server has one: the command says whether it runs in one); returns each rank's
        result. The caller resumes (also on failure). ``phase``: the phases' name (default ``op``)."""
        if pause is not None:
            phases.run("pause", self.pause, pause)
        phase = phase or op
        with ReplySocket() as replies:
            def call():
                body = {"serialized_named_tensors": encode_command(op, replies.address, ranks, timeout=timeout,
                                                                   session=self.server.sessions is True, **fields),
                        "load_format": loader, "flush_cache": False, "selector": "target"}
                phases.run(phase, self._post, "/update_weights_from_tensor", body, timeout=timeout)
                return phases.run(f"{phase}_replies", replies.collect, op, ranks, timeout, self.where)
            return self._in_session(phases, "target", call)

    def _staged_call(self, op: str, pause: str | None, timeout: float | None, after=None, loader: str = LOADER,
                     **fields) -> UpdateReport:
        wait = self.http.timeout if timeout is None else float(timeout)
        # refused before anything is posted
        ranks = self.server.require_loader(loader, "staged updates" if loader == LOADER else "state digests")
        if op in ("stage", "commit"):  # the commit loads what the stage received
            self.server.check_reloadable()
        if op == "commit":   # its host copies (a full version kept for deltas) wait no longer than the call
            fields.setdefault("receive_timeout", wait)
        phases, report = Phases(), UpdateReport()
        t0 = time.perf_counter()
        try:
            report.workers = self._session_op(phases, op, pause, wait, ranks, loader, **fields)
            if after is not None:
                after(phases)
        except BaseException as exc:
            if pause is not None:
                self._cleanup(exc, "continue_generation", self.resume)
            raise
        if pause is not None:
            phases.run("resume", self.resume)
        report.seconds = dict(phases.seconds, paused=time.perf_counter() - t0)
        report.seconds["total"] = report.seconds["paused"]
        return self._record(report)

    def stage(self, handles, version: str, *, timeout: float | None = None, device_bytes: int = 0,
              pause: str | None = "in_place", deltas: bool = False) -> UpdateReport:
        """Start receiving an update into every TP rank's staging area; the server keeps its weights.

        Use it as the update's ``req_func`` (``req_func(stage="v8")``): it returns once the
        receivers run (a pause of a few milliseconds, ``in_place``, to open SGLang's session);
        the transfer then runs while the server generates, and ``ParameterServer.update``
        returns when every bucket is staged (or raises; the area is then freed).
        ``device_bytes``: device memory each rank may stage into, beyond it pinned host memory.
        ``pause=None`` opens the session without pausing: only for models whose weights SGLang
        does not pack in place (``begin_weight_update`` then changes nothing; unquantized
        models on GPU), else generation could run on unpacked weights until the session ends.
        ``deltas=True`` (docs/deltas.md, "SGLang"): stage a delta (``ParameterServer.update(...,
        delta=True)``, refused at its first bucket when the server does not hold its base, nothing
        staged), applied by :meth:`commit`; or a full update whose commit keeps what later deltas
        need. ``version`` must be the checkpoint's name.
        """
        wait = self.http.timeout if timeout is None else float(timeout)
        if pause not in (None, "in_place", "retract"):
            raise ConfigError(f"a stage opens its session under pause None, 'in_place' or 'retract', got {pause!r}")
        fields: dict[str, Any] = {"weights": str(version), "handles": dict(handles), "device_bytes": int(device_bytes),
                                  "receive_timeout": wait}
        if deltas:
            fields["deltas"] = True
        return self._staged_call("stage", pause, timeout, **fields)

    def commit(self, version: str, *, pause: str = "retract", timeout: float | None = None) -> UpdateReport:
        """Switch the server to the staged ``version`` in one pause, with no request dropped.

        ``retract`` (default): running requests go back to the queue and are recomputed on the new
        weights, the cache of the old ones is flushed. ``in_place``: they stay in the running
        batch with their KV cache of the old weights, and no flush happens (SGLang refuses one
        then). Then SGLang's ``weight_version`` is set. ``report.seconds["paused"]`` is how long
        generation stood still. Nothing (or another version) staged is a ``RemoteWorkerError``
        (``ConfigError`` in the loader) and changes nothing.
        """
        if pause not in COMMIT_PAUSE_MODES:
            raise ConfigError(f"commit pauses with one of {COMMIT_PAUSE_MODES} (no request dropped), got {pause!r}")

        def after(phases: Phases) -> None:
            if pause == "retract":
                phases.run("flush_cache", self.flush_cache)
            phases.run("weight_version", self.set_weight_version, str(version))

        try:
            return self._staged_call("commit", pause, timeout, after=after, weights=str(version))
        except BaseException as exc:
            self._cleanup(exc, "weight_version", lambda: self._mark_mixed(str(version)))
            raise

    def _mark_mixed(self, version: str) -> None:
        """After a failed load or commit of ``version`` through our loader: where the TP ranks report that one
        of them had written (``mixed``: a mix of two versions may serve), SGLang's own ``weight_version``
        (``/model_info``, its responses) becomes :func:`~ckpt_core.engines.base.mixed_weight_version` instead
        of the old version's name until a full update succeeds."""
        if any(w.get("mixed") for w in self.weight_versions()):
            self.set_weight_version(mixed_weight_version(version))

    def drop_staged(self) -> list:
        """Free every rank's staging area; returns what each held (None where nothing was)."""
        return self._staged_call("drop", "in_place", None).workers

    def weight_versions(self) -> list[dict]:
        """Per TP rank: the live version our commits set (and since when, unix time), what is
        staged or still receiving, the last failed stage; plus SGLang's own ``weight_version``."""
        reported = self.model_info().get("weight_version")
        return [dict(w, sglang_weight_version=reported) for w in self._staged_call("state", "in_place", None).workers]

    def state_digests(self, mode: str = "sha256", timeout: float | None = None) -> list[dict]:
        """Per TP rank, ``{name: [dtype, shape, digest]}`` of every parameter and buffer of SGLang's
        model, read in the scheduler process (the server started with ``--custom-weight-loader
        ckpt_sglang.probe.load``). ``mode``: ``sha256`` of the bytes (copied to the host), or
        ``sums``: two 64-bit sums computed on the device (fast; equal bytes give equal sums, moved
        or changed bytes change them). Under an ``in_place`` pause of a few milliseconds (and SGLang's
        session where it has one, as every loader call needs)."""
        return self._staged_call("digests", "in_place", timeout, loader=PROBE_LOADER, mode=str(mode)).workers

    def model_info(self) -> dict:
        resp = self.http.request("GET", "/model_info", timeout=30.0)
        self.http.raise_for_status(resp)
        return resp.json()

    def set_weight_version(self, version: str) -> None:
        """SGLang's ``weight_version`` (``/model_info``, responses), without aborting requests."""
        self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
