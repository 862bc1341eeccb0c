"""Sliced deltas in real worlds: a tensor-parallel-like engine worker that holds only its boxes, loaded
into fused live parameters as a TP engine's loaders would (``SlicedDeltaEngine``), the plan it loads by,
a small model trained with AdamW between versions, and the PS-side helpers a ``PsWorld`` runs through
its ``call`` command.

Engine rank t of 2 reads rows t of ``q``, ``k``, ``gate``, ``up``, ``embed`` and ``lm_head``, columns t of
``o``, and ``norm`` whole. Its live parameters fuse them: ``qk`` (q's rows then k's rows: each box a
contiguous row block of it) and ``gu`` (gate's rows as its first 32 columns, up's as the next 32: each box
a strided column block, as a transposed fused layout would hold them).
"""

from __future__ import annotations

import os

import torch

from ckpt_core.planning.slices import RankSlices, SliceKey, SlicePlan, Write, plan_from_json, plan_to_json
from support.data import digest
from support.engine import SimEngine, make_req_func

SHAPES = {"q": (32, 32), "k": (16, 32), "o": (32, 32), "gate": (64, 32), "up": (64, 32), "embed": (96, 32),
          "norm": (32,), "lm_head": (96, 32)}
OWNER = {"q": 0, "k": 0, "o": 0, "norm": 0, "gate": 1, "up": 1, "embed": 1, "lm_head": 1}   # PS rank registering it
ROWS = ("q", "k", "gate", "up", "embed", "lm_head")


def plan() -> SlicePlan:
    ranks = []
    for t in range(2):
        needs = {n: ((0, SHAPES[n][0] // 2 * t, SHAPES[n][0] // 2),) for n in ROWS}
        needs["o"] = ((1, 16 * t, 16),)
        needs["norm"] = None
        params = {"qk": (24, 32), "o": (32, 16), "gu": (32, 64), "embed": (48, 32), "norm": (32,), "lm_head": (48, 32)}
        writes = (Write("qk", ((0, 0, 16),), "q"), Write("qk", ((0, 16, 8),), "k"), Write("o", (), "o"),
                  Write("gu", ((1, 0, 32),), "gate"), Write("gu", ((1, 32, 32),), "up"),
                  Write("embed", (), "embed"), Write("norm", (), "norm"), Write("lm_head", (), "lm_head"))
        ranks.append(RankSlices(t, needs, params, writes))
    tensors = {n: ("F32" if n == "norm" else "BF16", s, 4 if n == "norm" else 2) for n, s in SHAPES.items()}
    return SlicePlan(SliceKey("delta-slices-world", "tp=2", "test"), tensors, tuple(ranks))


def plan_doc() -> dict:
    return plan_to_json(plan())


def region(t: torch.Tensor, box) -> torch.Tensor:
    for d, s, n in box or ():
        t = t.narrow(d, s, n)
    return t


def want(version: dict[str, torch.Tensor], rank: int) -> dict[str, str]:
    """Digests of what engine rank ``rank`` must hold of ``version`` (whole tensors): each box it reads."""
    return {n: digest(region(version[n], b).contiguous()) for n, b in plan().ranks[rank].needs.items()}


class Trainer:
    """fp32 master weights, AdamW; each version is the bf16 snapshot (norm in fp32) the engines are sent."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.p = {n: (torch.ones(s) if n == "norm" else torch.randn(s, generator=g) * 0.02) for n, s in SHAPES.items()}
        for t in self.p.values():
            t.requires_grad_(True)
        self.opt = torch.optim.AdamW(list(self.p.values()), lr=1e-4)
        self.g = g

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        p = self.p
        ids = torch.randint(0, 96, (8,), generator=self.g)
        h = p["embed"][ids] * p["norm"]
        s = h @ p["q"].T + (h @ p["k"].T).repeat(1, 2)
        x = h + torch.tanh(s) @ p["o"].T
        m = torch.nn.functional.silu(x @ p["gate"].T) * (x @ p["up"].T)
        x = x + m.reshape(8, 2, 32).sum(1)
        loss = torch.nn.functional.cross_entropy(x @ p["lm_head"].T, torch.roll(ids, 1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def version(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() if n == "norm" else t.detach().to(torch.bfloat16) for n, t in self.p.items()}


def per_rank(version: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    return {r: {n: t for n, t in version.items() if OWNER[n] == r} for r in range(2)}


class SlicedDeltaEngine(SimEngine):
    """An engine worker of engine rank ``behavior["slices"][1]`` that loads by ``plan()``: its live
    parameters hold its boxes; sliced deltas are scattered into their regions (``DeltaReceiver.live_box``)."""

    def __init__(self, kind, index, behavior):
        super().__init__(kind, index, behavior)
        from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
        from ckpt_core.delta.apply import DeltaReceiver
        self.plan = plan_from_json(behavior["plan_doc"])
        self.rs = self.plan.ranks[behavior["slices"][1]]
        dtype_of = {w.param: WIRE_DTYPES[self.plan.tensors[w.source][0]] for w in self.rs.writes if w.source}
        g = torch.Generator().manual_seed(1000 + index)   # never zeros: a missed write shows
        self.params = {p: torch.randn(s, generator=g).to(dtype_of[p]) for p, s in self.rs.params.items()}
        self.rx = DeltaReceiver(live=lambda name: None, live_box=self._live_box)

    def _writes(self, name: str):
        return [w for w in self.rs.writes if w.source == name]

    def _live_box(self, name: str, box):
        from ckpt_core.delta.sliced import norm_box
        from ckpt_core.errors import CheckpointFormatError
        if name not in self.rs.needs or norm_box(self.rs.needs[name]) != box:
            raise CheckpointFormatError(f"engine rank {self.rs.rank} does not read box {box} of this tensor",
                                        tensor=name)
        writes = self._writes(name)
        return region(self.params[writes[0].param], writes[0].region) if len(writes) == 1 else None

    def command(self, cmd):
        if cmd[0] == "digests":
            return {n: digest(region(self.params[w.param], w.region).contiguous())
                    for n in self.rs.needs for w in self._writes(n)}
        if cmd[0] == "held":
            return self.rx.held
        return super().command(cmd)

    def update(self, handles, this: dict) -> dict:
        from ckpt_core import update_weights_from_ipc

        def run(weights):
            for name, t in weights:
                for w in self._writes(name):
                    region(self.params[w.param], w.region).copy_(t)

        saved = {k: os.environ.get(k) for k in this.get("env", {})}
        os.environ.update(this.get("env", {}))
        try:
            with self.rx.update(run=run, version=this.get("version")) as cb:
                update_weights_from_ipc(self.ctx, handles[self.key], self.index, run=cb.run, on_plan=cb.on_plan,
                                        post_hook=cb.post_hook, timeout=this.get("timeout", 60),
                                        slices=this.get("slices"))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        self.updates += 1
        return dict(self.rx.last, held=self.rx.held)


def sliced_update(ps, rank, name, address, timeout, doc, behaviors, delta):
    """``ps.update(name, ..., slices=plan_from_json(doc), delta=delta)``; rank 0 posts to the engine front."""
    req = make_req_func(address, behaviors) if rank == 0 else (lambda h: None)
    return ps.update(name, req, timeout=timeout, slices=None if doc is None else plan_from_json(doc), delta=delta)


def corrupt_box_payload(ps, rank, name, doc, tensor):
    """Flip one byte (XOR, so that doing it twice repairs it) in the body of a box payload of ``tensor`` in
    this rank's sliced delta of ``name`` (built by an earlier sliced delta update). Returns whether this
    rank holds one."""
    from ckpt_core.delta.sliced import BOX, parse_box_name, sliced_name
    from ckpt_core.delta.versions import companion
    ckpt = ps._catalog.checkpoints[sliced_name(companion(name), plan_from_json(doc))]
    for m in ckpt.metas:
        if m.name.startswith(BOX) and parse_box_name(m.name)[0] == tensor:
            ckpt.regions[m.base].tensor[m.base_offset + m.nbytes - 1] ^= 0x5A
            return True
    return False


def sliced_checkpoints(ps, rank):
    """This rank's checkpoints that are sliced deltas (released with their version)."""
    return [n for n in ps.checkpoints() if "@delta[" in n]


def fold(ps, rank, name, base):
    """``ps.fold_delta(name, base=base)`` on this rank."""
    return ps.fold_delta(name, base=base)
