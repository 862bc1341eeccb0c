"""Inside SGLang: stage an update while the server generates, switch to it in a short pause.

Start SGLang with ``--custom-weight-loader ckpt_sglang.staging.load`` (ckpt-engine installed in
the server's environment); :class:`ckpt_sglang.SglangClient` drives it (``stage``, ``commit``,
``drop_staged``, ``weight_versions``). SGLang calls :func:`load` in its scheduler process, on
every TP rank, inside a weight-update session (``/begin_weight_update`` ..
``/end_weight_update``) that the client opens while generation is paused; ``_protocol.py`` says
how commands arrive and replies leave.

- ``stage``: start a receiver thread and return at once. The thread runs the stock
  checkpoint-engine worker loop that SGLang's own ``/update_weights_from_ipc`` runs (so the same
  ``ParameterServer(wire="stock")`` feeds both), with ``run`` copying each bucket into a
  :class:`~ckpt_core.wire.staging.StagingArea` instead of ``model.load_weights``. The client
  resumes generation right away; the transfer runs while the server generates, and the PS's
  ``update`` returns once every bucket is staged. Live parameters are not touched; a stage that
  fails frees its area, the old weights serve on.
- ``commit``: under the client's pause, feed the staged buckets to SGLang's own
  ``model.load_weights`` (fusing q/k/v and gate/up as in a cold load), then free the area. The
  session's end runs SGLang's post-load processing; the client then flushes the cache, sets
  SGLang's ``weight_version`` and continues.
- ``load``: a direct update (``SglangClient.update(via="loader")``): in this call, the same stock
  loop feeds each bucket straight into ``model.load_weights`` (no staging area), then, outside a
  weight-update session (0.5.17), the post-load processing SGLang's IPC route runs; inside one
  (0.5.23) the session's end does it. The stage's and the load's receiving run with a lowered
  switch interval (``_stock_loop.py``).
- ``drop``: free the area, and end a stage still receiving (its receiver stops within a poll of
  ``STOP_POLL_S`` while it waits for the PS, or after the bucket it is copying; it never seals).
  ``state``: live version (since when), what is staged or receiving.

A staged checkpoint must cover the layout of the last commit of this process (same names, dtypes
and shapes), checked per bucket as it arrives and as a whole at the commit.

The TP ranks of the server agree before any of them changes anything (``_agree.py``: an
all-gather of each rank's status over SGLang's own TP CPU group, inside the call every rank runs):
a stage one rank refuses (no handle for its device) is refused on every rank, and drops what every
rank had staged or was still receiving; a new stage and a drop end a stage still receiving on every
rank (as on vLLM: a receiver waiting for a PS that gave the update up would otherwise hold the
engine until its receive timeout); a commit or a load while a stage receives anywhere is refused
everywhere and changes nothing; a commit runs only when every rank holds the same complete stage of
that version, and a commit some rank cannot run changes no live weight on any rank (a stage the
ranks do not all hold alike, or an incomplete one, is dropped on every rank); a ``load_weights``
failing on one rank at the commit is reported by every rank. A load runs only when every rank has a
handle for its device and nothing staged or receiving; its failure on one rank (the PS then aborts
every rank's loop) is reported by every rank. Every rank answers each call with the same outcome.

A load or commit that fails says what the model holds, agreed by the ranks at its end
(``_agree.outcome``): each rank knows whether it wrote into its live parameters (a flag set just
before its first call of SGLang's ``load_weights``, a delta's apply, or the post-load processing).
When no rank wrote (the PS gave the update up before the receivers connected, a refusal at the
handshake or the plan, a delta refused at its first bucket), the error says that nothing was loaded
and which version the engine still holds, and ``state`` keeps that live version; when any rank may
have written, it says that the model may hold a mix of both versions (push a full update) and no
rank reports a live version after it (a failed delta is undone instead, its version kept).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.wire.staging import StagingArea

from ._agree import BUSY, FAILED, MALFORMED, OK, REFUSED, UNTOUCHED, TpGroup, outcome, refusal, sglang_tp_group, written
from ._delta import SglangDeltas, is_delta_name
from ._protocol import decode_command, reply
from ._stock_loop import run_stock_loop

__all__ = ["load", "EngineStaging"]

log = logging.getLogger("ckpt_sglang.staging")
REPLY_TIMEOUT_S = 10.0
AGREE_TIMEOUT_S = 60.0   # when a command carries no timeout of its own
RECEIVE_TIMEOUT_S = 600.0   # a receive (and its host copies) when the command carries no receive_timeout
STOP_JOIN_S = 10.0   # how long a drop waits for the receiver it stopped (it stops within a poll, or a bucket's copy)
MIXED = "; the model may hold a mix of both versions: push a full update"


def _device_of(model) -> tuple[torch.device, str, int]:
    """(device, device key, device id) as SGLang's checkpoint-engine worker extension keys this rank."""
    from sglang.srt.checkpoint_engine.checkpoint_engine_worker import SGLangCheckpointEngineWorkerExtensionImpl

    ext = SGLangCheckpointEngineWorkerExtensionImpl(None)
    param = next(model.parameters())
    return param.device, ext.get_device_uuid(), ext.get_device_id()


def _agree_s(cmd: dict) -> float:
    """How long a rank waits for the others at an agreement: half the client's wait for the replies,
    so that a rank that never arrives is reported before the client gives up."""
    return max(1.0, 0.5 * float(cmd.get("timeout", 2 * AGREE_TIMEOUT_S)))


def _receive_s(cmd: dict) -> float:
    """The seconds a command's receive, and the host copies of what it loads, may take."""
    return float(cmd.get("receive_timeout", RECEIVE_TIMEOUT_S))


def _missing_handle(handles, key: str) -> str | None:
    """Why this rank cannot receive: the parameter server sent no ZeroMQ handle for its device (None: it did)."""
    if isinstance(handles, dict) and key in handles:
        return None
    sent = sorted(handles) if isinstance(handles, dict) else handles
    return f"no ZeroMQ handle for the device {key} (the parameter server sent handles for {sent})"


Layout = dict[str, tuple[str, tuple]]   # {name: (dtype, shape)}


@dataclass
class SglangStagingArea(StagingArea):
    """A staging area and the layout of what it staged (set when sealed)."""

    layout: Layout = field(default_factory=dict)
    keep: bool = False    # staged with deltas: a full one's commit keeps what deltas need, a delta may be staged
    delta: bool = False   # what it staged is a delta (its payloads)


@dataclass(eq=False)
class _Receiver:
    """A stage's receiver thread. ``dropped``: why its owner gave it up (set under the engine's lock);
    the thread then stops at its next wait for the PS or its next bucket, and never seals."""

    version: str
    thread: threading.Thread = field(init=False)
    dropped: str | None = None

    def should_stop(self) -> str | None:
        return self.dropped


def _join_dropped(rx: _Receiver | None) -> None:
    """Wait (outside the engine's lock: the receiver takes it to end) for a receiver told to stop."""
    if rx is None:
        return
    rx.thread.join(STOP_JOIN_S)
    if rx.thread.is_alive():   # it can no longer seal; it frees its own area when it ends
        log.warning("ckpt: the dropped stage of %s still runs after %g s; it ends at its next message from the "
                    "parameter server", rx.version, STOP_JOIN_S)


class EngineStaging:
    """One scheduler process's staged area, receiver thread and live version (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.area: SglangStagingArea | None = None
        self.receiving: _Receiver | None = None
        self.layout: Layout | None = None   # of the last commit
        self.live_version: str | None = None
        self.live_since: float | None = None
        self.mixed = False   # the last load or commit failed after a rank wrote: a mix of versions may serve
        self.last_stage_error: str | None = None
        self.deltas = SglangDeltas()   # the version held for deltas, the map, kept copies (_delta.py)

    def _still_receiving(self) -> str | None:
        """The version a stage's receiver thread is still receiving (None: none is)."""
        if self.receiving is not None and self.receiving.thread.is_alive():
            return self.receiving.version
        return None

    def _drop_locked(self, how: str) -> _Receiver | None:
        """Free the staged area and tell a stage still receiving to stop (``how``: what became of it);
        returns that receiver, to be joined once the lock is released (:func:`_join_dropped`)."""
        self._free_locked()
        rx, self.receiving = self.receiving, None
        if rx is not None:
            rx.dropped = f"the stage of {rx.version!r} was {how}"
        return rx

    # -- ops (each returns its result or raises; load() turns that into the reply) ----------
    def stage(self, model, cmd: dict, group: TpGroup = TpGroup()) -> dict:
        version, handles = str(cmd["weights"]), cmd.get("handles")
        timeout = _receive_s(cmd)
        device, key, device_id = _device_of(model)
        missing = _missing_handle(handles, key)
        with self._lock:   # held through the agreement: a receiver finishing meanwhile waits for it
            statuses = group.gather(OK if missing is None else REFUSED, missing or "", f"the stage of {version!r}",
                                    _agree_s(cmd))
            refused = refusal(statuses, f"cannot stage version {version!r}: ", "; nothing is staged on any TP rank "
                              "now (a stage replaces what was staged or still receiving)")
            # a new stage replaces the staged one and ends one still receiving (its PS may have given it up),
            # also when it is refused
            old = self._drop_locked(f"replaced by the stage of {version!r}")
        _join_dropped(old)
        if refused is not None:
            raise refused
        if not isinstance(handles, dict):   # refused above, on every rank
            raise ConfigError(f"cannot stage version {version!r}: the parameter server sent no handles")
        area = SglangStagingArea(version, device, int(cmd.get("device_bytes", 0)), keep=bool(cmd.get("deltas")))
        rx = _Receiver(version)
        rx.thread = threading.Thread(target=self._receive, args=(area, rx, handles[key], device_id, timeout),
                                     name=f"ckpt-stage-{version}", daemon=True)
        with self._lock:
            self.receiving = rx
            self.last_stage_error = None
            rx.thread.start()
        return {"device_key": key, "version": version, "receiving": True}

    def _receive(self, area: SglangStagingArea, rx: _Receiver, handle: str, device_id, timeout: float) -> None:
        expected = self.layout
        seen: Layout = {}

        first_error: list[str] = []

        def run(weights):
            try:
                if rx.dropped:   # answered to the PS, which aborts the update
                    raise ConfigError(rx.dropped)
                check_and_add(weights)
            except Exception as exc:   # the stock loop sends its traceback to the PS, which aborts
                first_error.append(f"{type(exc).__name__}: {exc}")
                raise

        def check_and_add(weights):
            names = [n for n, _ in weights]
            delta = any(is_delta_name(n) for n in names)
            if delta or area.delta:
                if not area.keep:   # the PS refuses it first (a stage's req_func without deltas takes none)
                    raise CheckpointFormatError("a delta is staged only by stage(..., deltas=True); nothing is staged")
                if seen and not area.delta or not all(is_delta_name(n) for n in names):
                    raise CheckpointFormatError("an update mixes delta payloads and whole tensors; nothing is staged")
                self.deltas.check_bucket(names)   # refused at once, nothing staged, when it cannot apply here
                area.delta = True
                seen.update((n, ("uint8", tuple(t.shape))) for n, t in weights)
                area.add(weights)
                return
            for name, t in weights:
                got = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                if name in seen:
                    raise CheckpointFormatError(f"the staged update sends {name} twice; nothing is staged",
                                                tensor=name)
                if expected is not None and expected.get(name, got) != got:
                    raise CheckpointFormatError(f"the staged update's {name} is {got[0]} {list(got[1])}, the "
                                                f"last commit loaded {expected[name][0]} {list(expected[name][1])}"
                                                "; nothing is staged", tensor=name)
                if expected is not None and name not in expected:
                    raise CheckpointFormatError(f"the staged update's {name} was not part of the last commit; "
                                                "nothing is staged", tensor=name)
                seen[name] = got
            area.add(weights)

        def seal():   # runs before the stock loop answers the PS: staged once its update returns
            with self._lock:
                if rx.dropped:   # its failure is the loop's answer to the PS (reply_hook_error)
                    raise ConfigError(f"{rx.dropped} (as it sealed)")
                area.layout = dict(seen)
                area.sealed = True
                self.area, self.receiving = area, None

        t0 = time.perf_counter()
        try:
            run_stock_loop(handle, area.device, device_id, timeout, run=run, post_hook=seal, reply_hook_error=True,
                           should_stop=rx.should_stop)
        except BaseException as exc:   # noqa: BLE001 - reported to the PS by the stock loop; kept for state
            self._receive_failed(area, (first_error or [f"{type(exc).__name__}: {exc}"])[0])
            return
        log.info("ckpt stage of %s: %d tensors, %.1f MB (%.1f MB on the device) in %.3f s", area.version,
                 area.tensors, area.nbytes / 1e6, area.device_bytes / 1e6, time.perf_counter() - t0)

    def _receive_failed(self, area: SglangStagingArea, error: str) -> None:
        with self._lock:
            self.last_stage_error = error
            if self.receiving is not None and self.receiving.thread is threading.current_thread():
                self.receiving = None
            # failing after its seal (its last reply to the PS): a commit may be loading it already
            owned = self.area is area or not area.sealed
            if self.area is area:
                self.area = None
        if owned:
            area.free()
        log.warning("ckpt stage of %s failed: %s", area.version, error)

    def _commit_status(self, version: str) -> tuple[int, str]:
        """This rank's answer to "can version ``version`` be committed?" (under the lock)."""
        area = self.area
        if self.receiving is not None:
            return BUSY, f"version {self.receiving.version!r} is still being staged"
        if area is None or area.version != version:
            return REFUSED, "nothing is staged" if area is None else f"version {area.version!r} is staged"
        missing = sorted(set(self.layout) - set(area.layout)) if self.layout is not None and not area.delta else []
        if missing:
            return MALFORMED, (f"it lacks {', '.join(missing[:8])} ({len(missing)} of the last commit's tensors)")
        return OK, ""

    def commit(self, model, cmd: dict, group: TpGroup = TpGroup()) -> dict:
        version, wait = str(cmd["weights"]), _agree_s(cmd)
        t0 = time.perf_counter()
        with self._lock:
            statuses = group.gather(*self._commit_status(version), f"the commit of {version!r}", wait)
            codes = {c for c, _ in statuses}
            # a stage the ranks do not all hold alike (it failed on some), or an incomplete one, can never
            # be committed as a whole: dropped on every rank; one still receiving anywhere changes nothing
            drop = BUSY not in codes and (MALFORMED in codes or len(set(statuses)) > 1)
            refused = refusal(statuses, f"cannot commit version {version!r}: ", "; nothing was committed on any TP "
                              "rank" + (", and what was staged was dropped on every TP rank" if drop else ""))
            if refused is not None:
                if drop:
                    self._free_locked()
                raise refused
            area, self.area = self.area, None
            if area is None:   # _commit_status refused it above, on every rank
                raise ConfigError(f"cannot commit version {version!r}: nothing is staged")
        dload = self.deltas.load(model, area.device, version, area.keep, bool(cmd.get("session")), _receive_s(cmd))
        failed: Exception | None = None
        error: Exception | None = None
        untouched = False   # the ranks agreed that none of them wrote anything
        try:
            with dload.transaction():
                try:
                    for bucket in area.buckets:   # SGLang's own loader (the fusing a cold load does), or a delta's
                        dload.run(bucket)
                    dload.post_hook()   # a delta: checked and applied here (scattered, rebuilt and reloaded)
                    if area.device.type == "cuda":
                        torch.cuda.synchronize(area.device)
                    if not dload.delta:
                        dload.finish_full()
                except Exception as exc:   # noqa: BLE001 - every rank reports it, below
                    error = exc
                    log.error("ckpt commit of %s: %s failed:\n%s", version,
                              "the delta" if dload.delta else "SGLang's load_weights", traceback.format_exc())
                statuses = group.gather(_end_code(error is not None, dload.wrote),
                                        f"{type(error).__name__}: {error}" if error else "",
                                        f"the end of the commit of {version!r}", wait,
                                        _end_timed_out(dload.wrote, bool(dload.delta)))
                untouched = not written(statuses)
                what = "the delta" if dload.delta else "SGLang's load_weights"
                failed = outcome(statuses, f"{what} failed while committing {version!r}: ", self._untouched(),
                                 "; the delta was undone on every TP rank" if dload.delta else MIXED)
                if failed is not None:
                    raise failed   # leaves the transaction: a delta is undone on every rank
        except Exception as exc:   # noqa: BLE001 - raised below, after the state is set
            failed = failed or exc
        summary = area.summary()
        area.free()
        with self._lock:
            # a failed delta was undone, and a failure before any rank wrote left it alone: the model holds
            # what it held
            if failed is None or not (dload.delta or untouched):
                if not dload.delta:
                    self.layout = dict(area.layout)
                self.live_version, self.live_since = (version if failed is None else None), time.time()
                self.mixed = failed is not None
        if failed is not None:
            raise failed from error
        out = {**summary, "sealed": True, "seconds": {"load": time.perf_counter() - t0},
               "path": "delta" if dload.delta else "full"}
        out.update(dload.figures)
        return out

    def load(self, model, cmd: dict, group: TpGroup = TpGroup()) -> dict:
        """A direct update: the stock loop feeds each bucket straight into SGLang's ``load_weights``
        (no staging area), in this call (the scheduler's turn, as SGLang's IPC route runs it)."""
        version, handles = cmd.get("weights"), cmd.get("handles")
        what, wait = f"the load of {version!r}" if version else "the load", _agree_s(cmd)
        device, key, device_id = _device_of(model)
        with self._lock:
            code, why = OK, ""
            busy_with, missing = self._still_receiving(), _missing_handle(handles, key)
            if busy_with is not None:   # as a staged version: the load does not drop it, the caller does
                code, why = BUSY, f"version {busy_with!r} is still being staged (drop it first)"
            elif self.area is not None:
                code, why = REFUSED, f"version {self.area.version!r} is staged (commit or drop it first)"
            elif missing is not None:
                code, why = REFUSED, missing
            refused = refusal(group.gather(code, why, what, wait), f"cannot run {what}: ",
                              "; nothing was changed on any TP rank")
            if refused is not None:
                raise refused
        if not isinstance(handles, dict):   # refused above, on every rank
            raise ConfigError(f"cannot run {what}: the parameter server sent no handles")
        keep = bool(cmd.get("deltas"))
        if keep and version is None:   # the client refuses it first; a delta names its base by the version
            raise ConfigError(f"cannot run {what} with deltas: it names no version")
        t0, seen, first_error = time.perf_counter(), {}, []
        tensors, nbytes = [0], [0]
        receive_s = _receive_s(cmd)
        dload = self.deltas.load(model, device, None if version is None else str(version), keep,
                                 bool(cmd.get("session")), receive_s)

        def run(weights):
            try:
                for name, t in weights:
                    seen[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                    tensors[0] += 1
                    nbytes[0] += t.numel() * t.element_size()
                dload.run(weights)   # SGLang's own loader (the fusing a cold load does), or a delta's payloads held
            except Exception as exc:   # the stock loop sends its traceback to the PS, which aborts
                first_error.append(f"{type(exc).__name__}: {exc}")
                log.error("ckpt load: %s failed:\n%s", "the delta" if dload.delta else "SGLang's load_weights",
                          traceback.format_exc())
                raise

        def post_hook():   # a delta is applied here: every bucket arrived, its failure is the PS's last answer
            try:
                dload.post_hook()
            except Exception as exc:
                first_error.append(f"{type(exc).__name__}: {exc}")
                log.error("ckpt load: the delta failed:\n%s", traceback.format_exc())
                raise

        failed, untouched = None, False   # untouched: the ranks agreed that none of them wrote anything
        try:
            with dload.transaction():
                error, post_loaded = None, False
                try:
                    run_stock_loop(handles[key], device, device_id, receive_s,
                                   run=run, post_hook=post_hook, side_stream=False, reply_hook_error=True)
                    if not dload.delta and not cmd.get("session"):   # a session's end post-processes (0.5.23)
                        post_loaded = True   # it changes live parameters, even after a load of no tensor
                        _post_load(model, device)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if not dload.delta:
                        dload.finish_full()
                except BaseException as exc:   # noqa: BLE001 - every rank reports it, below
                    error = (first_error or [f"{type(exc).__name__}: {exc}"])[0]
                wrote = dload.wrote or post_loaded
                statuses = group.gather(_end_code(error is not None, wrote), error or "", f"the end of {what}", wait,
                                        _end_timed_out(wrote, bool(dload.delta)))
                untouched = not written(statuses)
                failed = outcome(statuses, f"{what} failed: ", self._untouched(),
                                 "; the delta was undone on every TP rank" if dload.delta else MIXED)
                if failed is not None:
                    raise failed   # leaves the transaction: a delta is undone on every rank
        except Exception as exc:
            if failed is None:
                failed = exc
        with self._lock:
            if failed is None and not dload.delta:
                self.layout = dict(seen)
            # a failed delta was undone, and a failure before any rank wrote left it alone: the version is what it was
            if failed is None or not (dload.delta or untouched):
                self.live_version = None if failed is not None or version is None else str(version)
                self.live_since = time.time()
                self.mixed = failed is not None
        if failed is not None:
            raise failed
        seconds = time.perf_counter() - t0
        log.info("ckpt load of %s: %d tensors, %.1f MB in %.3f s", version, tensors[0], nbytes[0] / 1e6, seconds)
        out = {"version": version, "tensors": tensors[0], "bytes": nbytes[0], "seconds": {"load": seconds},
               "path": "delta" if dload.delta else "full"}
        out.update(dload.figures)
        return out

    def drop(self, model, cmd: dict, group: TpGroup = TpGroup()) -> dict | None:
        """Free the staged area and end a stage still receiving; returns what was staged (None: nothing
        sealed). No rank refuses it; the agreement keeps the ranks together (a missing one is a timeout
        before anything is dropped)."""
        with self._lock:
            group.gather(OK, "", "dropping the staged version", _agree_s(cmd))
            summary = None if self.area is None else self.area.summary()
            rx = self._drop_locked("dropped")
        _join_dropped(rx)
        return summary

    def state(self, model, cmd: dict, group: TpGroup = TpGroup()) -> dict:
        with self._lock:
            return {"live": self.live_version, "live_since": self.live_since, "mixed": self.mixed,
                    "staged": None if self.area is None else self.area.summary(),
                    "receiving": None if self.receiving is None else self.receiving.version,
                    "last_stage_error": self.last_stage_error}

    def _untouched(self) -> str:
        """The tail of a load's or commit's error when no TP rank wrote anything into its live parameters."""
        with self._lock:
            held = self.live_version
        if held is None:
            return "; nothing was loaded on any TP rank: the engine still holds the weights it held (no version of " \
                "ours was live)"
        return f"; nothing was loaded on any TP rank: the engine still holds version {held!r}"

    def _free_locked(self) -> None:
        if self.area is not None:
            self.area.free()
        self.area = None


def _end_code(failed: bool, wrote: bool) -> int:
    """This rank's status at the end of a load or commit: ``UNTOUCHED`` when it failed before writing."""
    return (FAILED if wrote else UNTOUCHED) if failed else OK


def _end_timed_out(wrote: bool, delta: bool) -> str:
    """What a rank that the others left waiting at the end of a load or commit says it did."""
    if delta:
        return "this rank's delta is undone" if wrote else "this rank wrote nothing"
    return ("this rank wrote into its live parameters: the model may hold a mix of both versions, push a full update"
            if wrote else "this rank wrote nothing, the others may have: push a full update")


def _post_load(model, device: torch.device) -> None:
    """What SGLang 0.5.17's IPC route runs after loading: each quantized module's
    ``process_weights_after_loading``, then the model's ``post_load_weights``. Raises (the load is
    then reported failed on every rank)."""
    from contextlib import nullcontext

    try:
        from sglang.srt.model_loader.loader import device_loading_context
    except ImportError:   # pragma: no cover - moved in a later release
        device_loading_context = None
    for _, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            with device_loading_context(module, device) if device_loading_context else nullcontext():
                method.process_weights_after_loading(module)
    if hasattr(model, "post_load_weights"):
        model.post_load_weights()


_ENGINE = EngineStaging()


def load(model, named_tensors) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader ckpt_sglang.staging.load``).

    Never raises: an exception here would end SGLang's scheduler. Every outcome is the reply.
    """
    import zmq

    try:
        cmd = decode_command(named_tensors)
    except Exception:   # noqa: BLE001 - not ours: nothing to answer to
        log.error("ckpt_sglang.staging.load was called with something that is not our command:\n%s",
                  traceback.format_exc())
        return
    group = sglang_tp_group()
    message = {"tp_rank": group.rank, "op": cmd["op"], "ok": True}
    try:
        if int(cmd.get("tp_size", group.size)) != group.size:
            raise ConfigError(f"the server has tp_size {cmd['tp_size']}, but this loader found a TP group of "
                              f"{group.size} (sglang.srt.distributed.parallel_state.get_tp_group): its ranks could "
                              "not agree, so nothing was done")
        message["result"] = getattr(_ENGINE, cmd["op"])(model, cmd, group)
    except Exception as exc:   # noqa: BLE001 - travels to the client
        message.update(ok=False, error=str(exc), error_type=type(exc).__name__, traceback=traceback.format_exc())
    try:
        reply(zmq.Context.instance(), cmd["reply"], message, REPLY_TIMEOUT_S)
    except Exception:   # noqa: BLE001
        log.error("ckpt_sglang.staging: could not answer %s on %s:\n%s", cmd["op"], cmd["reply"],
                  traceback.format_exc())
