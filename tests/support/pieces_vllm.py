"""A PS rank of a trainer that holds its dim-0 shards (``TensorShard`` boxes) and updates a real vLLM server
with deltas (``test_vllm_sliced_delta_paths.py``'s pieced chain). Run inside ``PsWorld`` ranks (``call``)."""

from __future__ import annotations

import torch

from support.slices_world import fsdp_rows

RETILED = "model.embed_tokens.weight"   # split at a row other than torch.chunk's in a retiled version


def pieces(weights: str, rank: int, world: int, retile: bool = False) -> dict:
    """This rank's share of ``weights``: the rows of every tensor of two or more dims (``fsdp_rows``), the norms
    whole on the last rank only; ``retile``: ``RETILED`` split two rows past ``torch.chunk``'s border."""
    from safetensors.torch import load_file

    from ckpt_core import TensorShard
    out = {}
    for n, t in load_file(weights).items():
        if t.dim() < 2:
            if rank == world - 1:
                out[n] = t.clone()
            continue
        if retile and n == RETILED and world == 2:
            cut = -(-t.shape[0] // 2) + 2
            start, rows = (0, cut) if rank == 0 else (cut, t.shape[0] - cut)
            out[n] = TensorShard(t.narrow(0, start, rows).clone(), tuple(t.shape), (start,) + (0,) * (t.dim() - 1))
            continue
        out[n] = fsdp_rows(t, rank, world)
    return out


def pieces_update(ps, rank, name, weights, base, endpoint, mode, retile=False, timeout=300.0):
    """Register ``name`` in pieces (``base``: its delta's base), then update the engine whole with
    ``deltas=True`` (``mode``: the update's ``delta``). Returns the PS's result and, on rank 0, the workers'
    replies; a refusal raises (the world answers its type and message)."""
    from ckpt_vllm import VllmClient

    share = pieces(weights, rank, ps.world_size, retile) if weights else {}
    if weights:   # None: ``name`` is registered already
        ps.register_checkpoint(name, named_tensors=share, **({"base": base} if base else {}))
        ps.gather_metas(name)
    client = VllmClient(endpoint, timeout=timeout) if rank == 0 else None
    replies: list = []
    try:
        def req(handles):
            if client is not None:
                replies.append(client.update(handles, version=name, deltas=True, timeout=timeout).workers)
        result = ps.update(name, req, timeout=timeout, delta=mode)
    finally:
        if client is not None:
            client.close()
    held = [getattr(s, "local", s) for s in share.values()]
    return {"result": result, "workers": replies[0] if replies else None,
            "share_bytes": sum(t.numel() * t.element_size() for t in held),
            "boxed": sum(1 for s in share.values() if not isinstance(s, torch.Tensor))}
