"""Device-resident checkpoints: the caller's tensors on this rank's own device, registered in place.

``ParameterServer.register_checkpoint(name, named_tensors=..., on_device=True)`` builds one with
:func:`build_device_checkpoint`: no host copy, no pinning, no pool. Each tensor becomes one region
whose ``tensor`` is a flat uint8 view of the caller's own storage (a trainer's parameters on the
GPU beside the engine), so an update's bucket filling copies it device-to-device into the IPC
buffer, with the same copies as host bytes (``transfer/pipeline.py``). The update reads the tensors
in place: whatever the caller writes into them before an update is what that update sends, and
they must not change while an update runs.

Everything that needs host bytes refuses such a checkpoint (:class:`DeviceResidentError`): a delta
between it and a host-registered version, P2P serving and pulls (Mooncake reads host memory), box
digests for joiners. A delta between two device-resident versions is encoded on the device
(``delta/encode_device.py``).
"""

from __future__ import annotations

import time

import torch

from ckpt_core.checkpoint.host import HostRegion
from ckpt_core.checkpoint.shards import boxes_of, is_pieced
from ckpt_core.checkpoint.sources import RegisteredCheckpoint, _check_named, _meta, _torch_dtype
from ckpt_core.devices import DeviceBackend
from ckpt_core.errors import DeviceResidentError


def build_device_checkpoint(name: str, backend: DeviceBackend, index: int, named_tensors) -> RegisteredCheckpoint:
    """Register ``named_tensors`` (plain tensors, ``TensorShard`` or DTensor pieces) where they lie on
    ``backend``'s device ``index``; every tensor (each piece's local view) must lie there and be
    contiguous, else :class:`DeviceResidentError` before anything is kept (never a silent copy)."""
    t0 = time.perf_counter()
    device = backend.device(index)
    entries: list[tuple] = []   # (name, tensor, box or None)
    for n, t in _check_named(named_tensors or {}):
        if is_pieced(t):
            entries += [(b.name, b.view, (b.global_shape, b.offsets)) for b in boxes_of(n, t)]
        else:
            entries.append((n, t, None))
    for n, t, _ in entries:
        _check_on(n, t, device)
    regions: dict[int, HostRegion] = {}
    metas = []
    for rid, (n, t, box) in enumerate(entries):
        regions[rid] = HostRegion(rid, t.detach().reshape(-1).view(torch.uint8))   # the caller's storage
        metas.append(_meta(n, t.dtype, t.shape, rid, 0)._replace(box=box))
    return RegisteredCheckpoint(name, metas, regions, None, nbytes=sum(m.nbytes for m in metas),
                                seconds={"validate": time.perf_counter() - t0}, on_device=True)


def device_tensor(ckpt: RegisteredCheckpoint, meta) -> torch.Tensor:
    """The caller's tensor of ``meta`` in device-resident ``ckpt``, typed and shaped (a view, no copy)."""
    region = ckpt.regions[meta.base].tensor   # each region is one whole tensor of the caller (offset 0)
    dtype = _torch_dtype(meta.dtype)
    if not meta.nbytes:
        return torch.empty(meta.shape, dtype=dtype, device=region.device)
    return region[meta.base_offset: meta.base_offset + meta.nbytes].view(dtype).view(meta.shape)


def in_place_problem(name: str, t: torch.Tensor, device: torch.device) -> str | None:
    """Why tensor ``name`` cannot be registered in place on ``device`` (``on_device=True``), or None:
    the one rule for the registration and for callers that choose ``on_device`` by it."""
    if t.device != device:
        return (f"named_tensors[{name!r}] lies on {t.device}, not on this parameter server's device {device}: "
                "on_device=True registers tensors of this rank's own device in place; move it there, or "
                "register without on_device (copied to host memory)")
    if not t.is_contiguous():
        return (f"named_tensors[{name!r}] is not contiguous (shape {tuple(t.shape)}, stride {tuple(t.stride())}): "
                "on_device=True reads tensors in place; pass a contiguous tensor (.contiguous()), or register "
                "without on_device")
    return None


def _check_on(name: str, t: torch.Tensor, device: torch.device) -> None:
    problem = in_place_problem(name, t, device)
    if problem is not None:
        raise DeviceResidentError(problem)


def refuse_device_resident(ckpt: RegisteredCheckpoint | None, name: str, what: str, rank: int) -> None:
    """Raise :class:`DeviceResidentError` if ``ckpt`` (checkpoint ``name`` on ``rank``) is device-resident:
    ``what`` needs its bytes in host memory."""
    if ckpt is not None and ckpt.on_device:
        raise DeviceResidentError(f"checkpoint {name!r} is registered on the device on rank {rank} "
                                  f"(on_device=True): {what} needs its bytes in host memory; register it "
                                  "without on_device for that")
