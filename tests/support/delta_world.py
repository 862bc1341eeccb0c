"""Delta updates in real worlds: an engine worker that holds live tensors (``DeltaEngine``) and the
PS-side helpers a ``PsWorld`` runs through its ``call`` command.

``DeltaEngine`` keeps every tensor it loads. Tensors named in ``behavior["derived"]`` it keeps in a
derived form (float32, as an engine that repacks or upcasts would), so they cannot be scattered
into: a delta reaches them through the rebuild-and-reload path. Its ``digests`` are of the
checkpoint-format bytes it holds (derived ones cast back), comparable with ``support.data.want_digests``.
"""

from __future__ import annotations

import os

import torch

from support.data import digest
from support.engine import SimEngine, make_req_func


class DeltaEngine(SimEngine):
    def __init__(self, kind, index, behavior):
        super().__init__(kind, index, behavior)
        from ckpt_core.delta.apply import DeltaReceiver
        self.params: dict[str, torch.Tensor] = {}
        self.derived: dict[str, tuple[torch.Tensor, torch.dtype]] = {}
        self.reloads = 0   # reload calls: per bucket, or once in the post hook (behavior "defer")
        defer = bool(behavior.get("defer"))
        self.rx = DeltaReceiver(live=self._live, reload=self._reload, defer_reload=defer, complete=defer)

    def _is_derived(self, name: str) -> bool:
        return name in set(self.behavior.get("derived", ()))

    def _live(self, name: str):
        return None if self._is_derived(name) else self.params.get(name)

    def _store(self, name: str, t: torch.Tensor) -> None:
        if self._is_derived(name):
            self.derived[name] = (t.to(torch.float32), t.dtype)   # the engine's own layout: not the checkpoint's bytes
        elif name in self.params and self.params[name].shape == t.shape and self.params[name].dtype == t.dtype:
            self.params[name].copy_(t)   # in place, as an engine's live parameter
        else:
            self.params[name] = t.clone()

    def _reload(self, weights) -> None:
        self.reloads += 1
        for name, t in weights:
            self._store(name, t)

    def command(self, cmd):
        if cmd[0] == "digests":
            out = {n: digest(t) for n, t in self.params.items()}
            out.update({n: digest(t.to(dt)) for n, (t, dt) in self.derived.items()})
            return out
        if cmd[0] == "held":
            return self.rx.held
        return super().command(cmd)

    def update(self, handles, this: dict) -> dict:
        from ckpt_core import update_weights_from_ipc

        def run(weights):
            for name, t in weights:
                self._store(name, t)
                if self._is_derived(name):
                    self.rx.keep(name, t)   # the checkpoint-format copy a later delta rebuilds from

        saved = {k: os.environ.get(k) for k in this.get("env", {})}
        os.environ.update(this.get("env", {}))
        try:
            with self.rx.update(run=run, version=this.get("version")) as cb:
                update_weights_from_ipc(self.ctx, handles[self.key], self.index, run=cb.run, on_plan=cb.on_plan,
                                        post_hook=cb.post_hook, timeout=this.get("timeout", 60))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        self.updates += 1
        return dict(self.rx.last, held=self.rx.held, reloads=self.reloads)


def delta_update(ps, rank, name, address, timeout, behaviors, mode):
    """``ps.update(name, ..., delta=mode)``; rank 0 posts to the engine front."""
    req = make_req_func(address, behaviors) if rank == 0 else (lambda h: None)
    return ps.update(name, req, timeout=timeout, delta=mode)


def corrupt_payload(ps, rank, name, tensor):
    """Flip one byte in the body of ``tensor``'s delta payload in this rank's host memory (after
    registration: what a bad DIMM or a stray write would do). Returns whether this rank holds it."""
    from ckpt_core.delta.versions import PAYLOAD, companion
    ckpt = ps._catalog.checkpoints[companion(name)]
    for m in ckpt.metas:
        if m.name == PAYLOAD + tensor:
            raw = ckpt.regions[m.base].tensor[m.base_offset: m.base_offset + m.nbytes]
            raw[-1] ^= 0x5A
            return True
    return False


def delta_figures(ps, rank, name):
    return dict(ps.deltas.figures.get(name, {}))


def delta_update_p2p(ps, rank, name):
    """A delta into a subset of ranks: refused (broadcast only for now)."""
    return ps.update(name, lambda h: None, ranks=[0], delta=True, timeout=30)
