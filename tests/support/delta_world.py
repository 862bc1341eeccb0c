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

DERIVED = ("r1.mlp.weight", "r0.fp8.weight")   # the engine keeps these in its own layout: reloaded, not scattered


class Trainer:
    """fp32 master weights, AdamW; each version is the bf16/fp32/fp8 snapshot an engine is sent."""

    def __init__(self, seed: int, world: int = 2):
        self.world = world
        g = torch.Generator().manual_seed(seed)
        self.p = {
            "r0.embed.weight": torch.randn(96, 32, generator=g) * 0.02,
            "r0.attn.weight": torch.randn(32, 32, generator=g) * 0.02,
            "r0.norm.weight": torch.ones(32),
            "r0.fp8.weight": torch.randn(16, 32, generator=g) * 0.5,
            "r1.mlp.weight": torch.randn(64, 32, generator=g) * 0.02,
            "r1.down.weight": torch.randn(32, 64, generator=g) * 0.02,
            "r1.lm_head.weight": torch.randn(96, 32, generator=g) * 0.02,
        }
        for t in self.p.values():
            t.requires_grad_(True)
        self.opt = torch.optim.AdamW(list(self.p.values()), lr=1e-4)
        self.g = g

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        p = self.p
        ids = torch.randint(0, 96, (8,), generator=self.g)
        x = p["r0.embed.weight"][ids] * p["r0.norm.weight"]
        x = x + torch.tanh(x @ p["r0.attn.weight"].T) + 0.1 * (x[:, :32] @ p["r0.fp8.weight"].T).sum(-1, keepdim=True)
        x = x + (torch.relu(x @ p["r1.mlp.weight"].T) @ p["r1.down.weight"].T)
        loss = torch.nn.functional.cross_entropy(x @ p["r1.lm_head.weight"].T, torch.roll(ids, 1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def version(self) -> dict[int, dict[str, torch.Tensor]]:
        def cast(n, t):
            t = t.detach()
            if "fp8" in n:
                return t.to(torch.float8_e4m3fn)
            return t.clone() if "norm" in n else t.to(torch.bfloat16)
        return {r: {n: cast(n, t) for n, t in self.p.items() if n.startswith(f"r{r}.")} for r in range(self.world)}


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
                run_cb, on_plan = _faults(this, cb.run, cb.on_plan)
                update_weights_from_ipc(self.ctx, handles[self.key], self.index, run=run_cb, on_plan=on_plan,
                                        post_hook=cb.post_hook, timeout=this.get("timeout", 60))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        self.updates += 1
        return dict(self.rx.last, held=self.rx.held, reloads=self.reloads)


def _faults(this: dict, run, on_plan):
    """``run`` and ``on_plan`` with the engine front's injections of one update: ``require`` (tensor names the
    plan must carry, else refused in the handshake) and ``fail_bucket`` (the loader fails at that bucket)."""
    buckets = [0]

    def checked_plan(tensors):
        missing = set(this.get("require", ())) - {n for n, _, _ in tensors}
        if missing:
            raise KeyError(f"checkpoint lacks {sorted(missing)}")
        return on_plan(tensors)

    def failing_run(weights):
        b, buckets[0] = buckets[0], buckets[0] + 1
        if this.get("fail_bucket") == b:
            raise RuntimeError(f"injected engine failure at bucket {b}")
        return run(weights)

    return failing_run, checked_plan


def delta_update(ps, rank, name, address, timeout, behaviors, mode):
    """``ps.update(name, ..., delta=mode)``; rank 0 posts to the engine front."""
    req = make_req_func(address, behaviors) if rank == 0 else (lambda h: None)
    return ps.update(name, req, timeout=timeout, delta=mode)


def corrupt_payload(ps, rank, name, tensor, comp=None):
    """Flip one byte in the body of ``tensor``'s delta payload in this rank's host memory (after
    registration: what a bad DIMM or a stray write would do); ``comp``: the companion (default ``name@delta``,
    e.g. a fold ``name@delta:A``). Returns whether this rank holds it."""
    from ckpt_core.delta.versions import PAYLOAD, companion
    ckpt = ps._catalog.checkpoints[comp or companion(name)]
    for m in ckpt.metas:
        if m.name == PAYLOAD + tensor:
            raw = ckpt.regions[m.base].tensor[m.base_offset: m.base_offset + m.nbytes]
            raw[-1] ^= 0x5A
            return True
    return False


def delta_figures(ps, rank, name):
    return dict(ps.deltas.figures.get(name, {}))


def delta_update_sliced(ps, rank, name):
    """A delta with ``slices=`` that is not a slice plan: refused alike on every rank."""
    return ps.update(name, lambda h: None, slices=object(), delta=True, timeout=30)


def p2p_delta_update(ps, rank, name, address, timeout, ranks, behaviors, mode):
    """``ps.update(name, ..., ranks=ranks, delta=mode)``; the first target posts to the engine front."""
    req = make_req_func(address, behaviors) if rank == min(ranks) else (lambda h: None)
    return ps.update(name, req, ranks=ranks, timeout=timeout, delta=mode)


def save_metas(ps, rank, path):
    if rank == 0:
        ps.save_metas(path)
    return sorted(ps.get_metas()["checkpoints"])


def engines_hold(ps, rank):
    return ps.deltas.engines_hold


def companion_on_device(ps, rank, name):
    """Whether ``name``'s delta (its companion checkpoint) is registered device-resident on this rank."""
    return ps._catalog.checkpoints[name + "@delta"].on_device


def register_on_device(ps, rank, name, tensors, base=None):
    """Register ``tensors`` (this rank's share) on the PS's own device (``on_device=True``), moved there
    first: a trainer's weights beside the engine; ``base``: its previous version, registered alike."""
    device = ps.backend.device(ps.device_index)
    ps.register_checkpoint(name, named_tensors={n: t.to(device).contiguous() for n, t in tensors.items()},
                           on_device=True, base=base)
    return {"on_device": ps.last_register["on_device"]}


def overwrite_registered(ps, rank, name, count):
    """Change ``count`` elements of the first tensor of device-resident checkpoint ``name`` in place (a
    trainer's step on tensors it registered with ``on_device=True``)."""
    from ckpt_core.checkpoint.device import device_tensor

    ckpt = ps._catalog.checkpoints[name]
    t = device_tensor(ckpt, ckpt.metas[0])
    t.reshape(-1).view(torch.uint8)[:count] ^= 1
    return True
def fold_delta(ps, rank, name, base):
    """``ps.fold_delta(name, base=base)``: this rank's figures of the fold."""
    return ps.fold_delta(name, base=base)


def companion_bytes(ps, rank, comp):
    """Bytes of checkpoint ``comp`` every owner registered (from the metas this rank gathered or loaded)."""
    loaded = ps._p2p.loaded.get(comp)
    metas = loaded.metas if loaded is not None else ps._catalog.metas.get(comp)
    return None if metas is None else sum(m.nbytes for ms in metas for m in ms)
