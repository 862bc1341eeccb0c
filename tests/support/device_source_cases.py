"""Helpers that run inside a PS rank process (``PsWorld``'s ``call`` command) for the device-resident
source (``register_checkpoint(..., on_device=True)``): the tensors are made there, so the test can ask
whether the checkpoint holds the caller's own storage and rewrite it in place between updates.

The tensors a rank registered stay in ``HELD`` (this process's), by checkpoint name."""

from __future__ import annotations

import torch

from ckpt_core import TensorShard
from support.data import FAULT_DTYPES, digest, fresh_tensor

HELD: dict[str, dict] = {}
ROWS = 8   # rows of the shared tensor each rank holds as a piece


def layout(rank: int) -> dict:
    """This rank's plain tensors: every transferred dtype, a 2-D one, a scalar and an empty one."""
    out = {f"dev{rank}.{i}.w": ((1000 + 37 * i,) if i % 2 else (24, 40), FAULT_DTYPES[i % 4]) for i in range(6)}
    out[f"dev{rank}.scalar"] = ((), torch.float32)
    out[f"dev{rank}.empty"] = ((0, 4), torch.bfloat16)
    return out


def _fill(rank: int, seed: int, device) -> dict:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return {n: fresh_tensor(s, d, gen).to(device) for n, (s, d) in layout(rank).items()}


def _piece(rank: int, world: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + 50 + rank)
    return fresh_tensor((ROWS, 16), torch.bfloat16, gen).to(device)


def register(ps, rank: int, name: str, seed: int) -> dict:
    """Register fresh tensors and one piece of ``shared.w`` on this rank's device, in place; report
    whether each region views the caller's storage, the host bytes and pool, and what was registered."""
    device = ps.backend.device(ps.device_index)
    tensors = _fill(rank, seed, device)
    piece = _piece(rank, ps.world_size, seed, device)
    named = dict(tensors, **{"shared.w": TensorShard(piece, (ROWS * ps.world_size, 16), (ROWS * rank, 0))})
    ps.register_checkpoint(name, named_tensors=named, on_device=True)
    HELD[name] = {"tensors": tensors, "piece": piece}
    return _report(ps, name)


def _report(ps, name: str) -> dict:
    ckpt = ps._catalog.checkpoints[name]
    held = HELD[name]
    sources = [*held["tensors"].values(), held["piece"]]
    ptrs = sorted(r.tensor.data_ptr() for r in ckpt.regions.values() if r.tensor.numel())
    return {"same_storage": ptrs == sorted(t.data_ptr() for t in sources if t.numel()),
            "devices": sorted({r.tensor.device.type for r in ckpt.regions.values()}),
            "on_device": ckpt.on_device, "no_pool": ckpt.pool is None, "pool_bytes": ps.pool_bytes(),
            "registered_bytes": ps.registered_bytes(name), "last_register": ps.last_register,
            "digests": {n: digest(t) for n, t in held["tensors"].items()}, "piece": held["piece"].cpu().clone()}


def rewrite(ps, rank: int, name: str, seed: int) -> dict:
    """Write fresh values into the registered tensors in place (an optimizer step); report the new ones."""
    device = ps.backend.device(ps.device_index)
    held = HELD[name]
    for n, t in _fill(rank, seed, device).items():
        held["tensors"][n].copy_(t)
    held["piece"].copy_(_piece(rank, ps.world_size, seed, device))
    return _report(ps, name)


def register_bad(ps, rank: int, name: str, how: str | None) -> None:
    """Register on the device with one bad input on this rank (``how``), or a good share (None)."""
    device = ps.backend.device(ps.device_index)
    tensors = _fill(rank, 7, device)
    if how == "other device":
        tensors[f"dev{rank}.0.w"] = torch.empty((24, 40), dtype=torch.float32, device="meta")
    elif how == "not contiguous":
        tensors[f"dev{rank}.0.w"] = tensors[f"dev{rank}.0.w"].t()
    ps.register_checkpoint(name, named_tensors=tensors, on_device=True)
    HELD[name] = {"tensors": tensors}


def p2p_update(ps, rank: int, name: str, ranks: list[int]) -> dict:
    """A P2P update of ``name`` into ``ranks`` (nobody posts: it must be refused before anything moves)."""
    return ps.update(name, lambda handles: None, ranks=ranks, timeout=30)


def register_slices(ps, rank: int, name: str, seed: int) -> bool:
    """``support.slices_world``'s tensors (rank 0: rows and norm, rank 1: cols and emb) made on this rank's
    device and registered there in place, for a sliced update (strided boxes copied from the device)."""
    from support.slices_world import tensors
    device = ps.backend.device(ps.device_index)
    mine = {n: t.to(device) for n, t in tensors(seed).items() if n in {0: ("rows", "norm"), 1: ("cols", "emb")}[rank]}
    ps.register_checkpoint(name, named_tensors=mine, on_device=True)
    HELD[name] = {"tensors": mine}
    return ps._catalog.checkpoints[name].on_device


def get_metas_sliced(ps, rank: int, doc: dict) -> dict:
    """``get_metas(slices=plan)``: a collective of the owners' world (box digests for joiners)."""
    from ckpt_core.planning.slices import plan_from_json
    return ps.get_metas(slices=plan_from_json(doc))


def shared_digest(pieces: list[torch.Tensor]) -> str:
    """The digest the engines must hold for ``shared.w``: every rank's piece, in rank order."""
    return digest(torch.cat(pieces))
