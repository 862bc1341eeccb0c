"""One TP rank's weight calls in the CPU SGLang stand-in (``engine.py``): SGLang's own scheduler
methods, with weight-update sessions (SGLang 0.5.23) or without (``--without-sessions``: 0.5.17),
each call noted as it arrives.

Every TP rank has its own ``SchedulerWeightUpdaterManager`` (SGLang keeps the session state on
every rank and ends each call in a barrier of the TP group), so ``tp.FanOut`` runs each call below
on every rank, and each rank notes it in its own ``SchedulerStandIn.events``: ``"ipc"``,
``"tensor"``, ``"begin"``, ``"end"``, with ``" (in session)"`` appended when that rank's session
was open as the call arrived. ``ckpt_test_weight_calls`` reports them per rank.

Without sessions the engine drops the ``/begin_weight_update`` and ``/end_weight_update`` routes
(0.5.17's route table), and the tensor route loads as 0.5.17's does: outside any session, with no
post-processing. 0.5.23's manager refuses to load outside a session, so on every rank the call
holds a bare session record for the load alone (no ``begin``: nothing restored; no ``end``: no
post-processing) and clears it after, also when the load fails.
"""

from __future__ import annotations

from typing import Any, Callable

WEIGHT_CALLS = {"update_weights_from_ipc": "ipc", "update_weights_from_tensor": "tensor",
                "begin_weight_update": "begin", "end_weight_update": "end"}


def _outside_session(updater) -> Callable[[Any], Any]:
    """0.5.17's ``update_weights_from_tensor`` played by 0.5.23's manager (see the module docstring)."""
    from sglang.srt.managers.scheduler_components.weight_updater import _WeightUpdateSession

    def call(obj):
        updater._session = _WeightUpdateSession(selector="target")
        try:
            return updater.update_weights_from_tensor(obj)
        finally:
            updater._session = None
    return call


def _noted(events: list[str], updater, event: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def call(obj):
        events.append(event if updater._session is None else f"{event} (in session)")
        return fn(obj)
    return call


def scheduler_calls(scheduler, without_sessions: bool = False) -> dict[str, Callable[[Any], Any]]:
    """This rank's weight calls the routes reach, by SGLang's method name, plus the test-only
    ``ckpt_test_weight_calls`` (this rank's events, and whether its session is open now)."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

    updater = SchedulerWeightUpdaterManager(tp_worker=scheduler, draft_worker=None, memory_saver_adapter=None,
                                            flush_cache=scheduler.flush_cache, is_fully_idle=scheduler.is_fully_idle,
                                            scheduler=scheduler)
    methods = {name: getattr(updater, name) for name in WEIGHT_CALLS}
    if without_sessions:
        methods["update_weights_from_tensor"] = _outside_session(updater)
    calls = {name: _noted(scheduler.events, updater, WEIGHT_CALLS[name], fn) for name, fn in methods.items()}

    def weight_calls(_arg) -> dict:
        return {"events": list(scheduler.events), "session_open": updater._session is not None}

    calls["ckpt_test_weight_calls"] = weight_calls
    return calls
