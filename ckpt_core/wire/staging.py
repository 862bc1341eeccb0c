"""Staged weights: an update received while the engine keeps serving, switched in later.

Engine-agnostic (used by ckpt_vllm's worker extension and ckpt_sglang's engine-side loader). A
stage receives every bucket of a PS update the usual way (same wire, same checks), but copies
each bucket into a staging area this worker owns instead of loading it: device memory up to a
limit the caller sets, pinned host memory beyond it (plain host memory on a CPU engine). Live
parameters, KV cache and running requests are not touched. ``commit`` later feeds the staged
tensors through the same reload path an update uses (vLLM's layerwise reload: fused, repacked and
quantized layers come out exactly as from a cold load; SGLang's own ``load_weights``), then frees
the area.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

import torch

from ckpt_core.errors import CheckpointFormatError

__all__ = ["StagingArea", "repeated_names"]

_ALIGN = 256


def repeated_names(names: Iterable[str], earlier: Container[str] = ()) -> list[str]:
    """The names of ``names`` that come twice, or that ``earlier`` already holds, sorted."""
    seen: set[str] = set()
    twice: set[str] = set()
    for name in names:
        if name in seen or name in earlier:
            twice.add(name)
        seen.add(name)
    return sorted(twice)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


_MAX_GAP = 4096   # largest hole between two tensors of one run (copied along rather than split)


@dataclass
class _Run:
    """Tensors of a bucket that lie together in one buffer: ``source`` (uint8) spans them, from the
    first one's start rounded down to ``_ALIGN`` (so each keeps its alignment in the copy; torch keeps
    a tensor's offset in its storage a multiple of its item size); None for one tensor copied on its
    own (empty, or not contiguous)."""
    source: torch.Tensor | None
    members: list[tuple[int, torch.Tensor]]   # (index in the bucket, tensor)
    nbytes: int


def _runs(weights: list[tuple[str, torch.Tensor]]) -> list[_Run]:
    """The bucket's tensors in runs of neighbours in one storage (in order, at most ``_MAX_GAP`` bytes
    apart): a run is one copy where it took one per tensor (thousands per bucket on an MoE model)."""
    spans: list[list] = []   # [storage or None, first byte, end byte, members]
    for i, (_, t) in enumerate(weights):
        n = t.numel() * t.element_size()
        storage = t.untyped_storage() if n and t.is_contiguous() else None
        start = t.data_ptr() - storage.data_ptr() if storage is not None else 0
        if storage is None:
            spans.append([None, 0, n, [(i, t)]])
            continue
        last = spans[-1] if spans else None
        if (last is not None and last[0] is not None and last[0].data_ptr() == storage.data_ptr()
                and 0 <= start - last[2] <= _MAX_GAP):
            last[2] = start + n
            last[3].append((i, t))
        else:
            spans.append([storage, start - start % _ALIGN, start + n, [(i, t)]])
    return [_Run(None if st is None else
                 torch.empty(0, dtype=torch.uint8, device=members[0][1].device).set_(st, a, (b - a,)), members, b - a)
            for st, a, b, members in spans]


@dataclass
class StagingArea:
    """The staged tensors of one version, bucket by bucket, in buffers this worker owns."""

    version: str
    device: torch.device
    device_limit: int = 0          # bytes of device memory the area may use; the rest goes to host memory
    buckets: list[list[tuple[str, torch.Tensor]]] = field(default_factory=list)
    names: set = field(default_factory=set)
    device_bytes: int = 0
    host_bytes: int = 0
    tensors: int = 0
    seconds: float = 0.0
    sealed: bool = False           # every bucket arrived and the PS update succeeded

    @property
    def nbytes(self) -> int:
        return self.device_bytes + self.host_bytes

    def check_plan(self, tensors, expected: dict | None) -> None:
        """Refuse a plan before anything is copied: a name twice, or, when the layout of the last
        complete update is known (``{name: (dtype, shape)}``), a missing, unknown or reshaped tensor.

        ``tensors``: ``(name, torch dtype, shape)`` of every tensor of the PS update.
        """
        tensors = list(tensors)
        twice = repeated_names(name for name, _, _ in tensors)
        if twice:
            raise CheckpointFormatError(f"the staged update sends {', '.join(twice[:8])} twice; "
                                        "nothing was staged", tensor=twice[0])
        seen = {name: (str(dtype).removeprefix("torch."), tuple(shape)) for name, dtype, shape in tensors}
        if not expected:
            return
        missing = sorted(set(expected) - set(seen))
        unknown = sorted(set(seen) - set(expected))
        changed = sorted(n for n in set(seen) & set(expected) if seen[n] != tuple(expected[n]))
        if missing:
            what, first = f"nothing would arrive for {', '.join(missing[:8])} ({len(missing)} missing)", missing[0]
        elif unknown:
            what, first = f"{', '.join(unknown[:8])} ({len(unknown)}) were not part of it", unknown[0]
        elif changed:
            n = changed[0]
            what, first = (f"{n} is {seen[n][0]} {list(seen[n][1])}, the engine loaded {expected[n][0]} "
                           f"{list(expected[n][1])} ({len(changed)} tensor(s) differ)"), n
        else:
            return
        raise CheckpointFormatError(
            f"the staged update does not match the last complete update of this engine: {what}; nothing was "
            "staged and the engine serves its current weights", tensor=first)

    def add(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket (views into the PS's IPC buffer, reused after this returns) into the area:
        one copy per run of tensors that lie together in the buffer (``_runs``), then a view per tensor."""
        t0 = time.perf_counter()
        runs = _runs(weights)
        total = sum(_aligned(r.nbytes) for r in runs)
        on_device = self.device.type != "cpu" and self.device_bytes + total <= self.device_limit
        if on_device:
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            self.device_bytes += total
        else:
            buf = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self.host_bytes += total
        typed: dict[torch.dtype, torch.Tensor] = {}   # the area's buffer as each dtype (total is 256-aligned)
        staged: list = [None] * len(weights)
        offset = 0
        for r in runs:
            if r.source is None:   # one tensor on its own
                (i, t), = r.members
                n = r.nbytes
                view = buf[offset:offset + n].view(t.dtype).view(t.shape) if n else torch.empty(t.shape, dtype=t.dtype)
                view.copy_(t, non_blocking=True)
                staged[i] = (weights[i][0], view)
            else:
                buf[offset:offset + r.nbytes].copy_(r.source, non_blocking=True)
                for i, t in r.members:
                    as_dtype = typed.get(t.dtype)
                    if as_dtype is None:
                        as_dtype = typed[t.dtype] = buf.view(t.dtype)
                    at = offset + t.data_ptr() - r.source.data_ptr()
                    staged[i] = (weights[i][0], as_dtype.as_strided(t.shape, t.stride(), at // t.element_size()))
            offset += _aligned(r.nbytes)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()   # the PS reuses its buffer for the next bucket
        self.buckets.append(staged)
        self.names.update(name for name, _ in weights)
        self.tensors += len(weights)
        self.seconds += time.perf_counter() - t0

    def free(self) -> None:
        self.buckets.clear()
        self.names.clear()
        self.sealed = False

    def summary(self) -> dict:
        return {"version": self.version, "tensors": self.tensors, "bytes": self.nbytes,
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "sealed": self.sealed}
