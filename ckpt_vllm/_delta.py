"""Delta updates into a live vLLM model (issue 39, first slice; docs/deltas.md).

vLLM derives its weights from the checkpoint's (fused qkv and gate_up, vLLM-CPU's repacked linears,
quantized kernels), so no live tensor is taken to hold a checkpoint tensor verbatim here: every
delta is rebuilt on the worker into full checkpoint tensors, from a host copy of the version it
holds (kept by the updates called with ``deltas=True``) plus the delta's changed elements, checked
against the version's digests, and loaded through the same layerwise reload as a full update
(``ReloadSession``), once every PS rank agreed that every bucket arrived and was checked
(``DeltaReceiver(defer_reload=True)``). The reload gets the unchanged kept tensors too
(``complete=True``): vLLM's fused modules must receive all their parts in one reload. So the wire
carries the delta, and the engine ends exactly as after a full update of the new version.

Not yet: scattering into live tensors that hold the checkpoint's bytes (the slice recording knows
which do), reloading only the changed layers, staged and sliced deltas.
"""

from __future__ import annotations

from typing import Any

from ckpt_core import update_weights_from_ipc as _core_update_weights_from_ipc
from ckpt_core.delta.apply import DeltaReceiver
from ckpt_core.errors import ConfigError

from ._reload import ReloadSession
from ._sessions import abort_sessions, finish_sessions


def receiver_of(worker: Any) -> DeltaReceiver:
    """This worker's delta state (held version, kept checkpoint-format copy), made on first use."""
    rx = getattr(worker, "_ckpt_delta_rx", None)
    if rx is None:
        rx = worker._ckpt_delta_rx = DeltaReceiver(live=lambda name: None, defer_reload=True, complete=True)
    return rx


def receive_with_deltas(worker: Any, sessions: list[ReloadSession], zmq_ctx, zmq_handle: str, index: int, *,
                        timeout: float, version: str | None) -> dict:
    """One update into begun reload ``sessions`` that may be a delta; a full one is kept (host copy)
    for the next delta. ``version`` names what a full update makes live (required)."""
    if not isinstance(version, str) or not version:
        abort_sessions(sessions)
        raise ConfigError("an update with deltas=True needs version=: a later delta names its base by it")
    rx = receiver_of(worker)
    kept: dict = {}

    def load(weights):
        for s in sessions:
            s.load(weights)

    def run(weights):   # a full update: loaded, and kept for the next delta
        load(weights)
        for name, t in weights:
            kept[name] = t.detach().to("cpu", copy=True)

    def on_plan(tensors):
        for s in sessions:
            s.check_plan(name for name, _, _ in tensors)
            s.check_whole_layers(name for name, _, _ in tensors)

    rx.reload = load
    try:
        with rx.update(run=run, on_plan=on_plan, post_hook=lambda: finish_sessions(sessions), version=version) as cb:
            _core_update_weights_from_ipc(zmq_ctx, zmq_handle, index, run=cb.run, on_plan=cb.on_plan,
                                          post_hook=cb.post_hook, timeout=timeout)
    except BaseException:
        abort_sessions(sessions)
        raise
    finally:
        rx.reload = None
    if kept:   # a full update: its tensors are the next delta's base
        rx.kept = kept
    main = sessions[0]
    return {"tensors": main.tensors, "bytes": main.bytes, "held": rx.held, "delta": dict(rx.last)}
