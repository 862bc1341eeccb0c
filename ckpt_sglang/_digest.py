"""Digests of every parameter and buffer an SGLang model holds, taken where they live.

``state_digests(model, mode)`` returns ``{name: [dtype, shape, digest]}`` for every parameter and
buffer of every module (tied aliases under each name they have), so two servers, or one server
before and after an update, can be compared byte for byte. ``mode``:

- ``sha256``: SHA-256 of the tensor's bytes, copied to the host (exact; a few seconds per GiB);
- ``sums``: two 64-bit sums of the bytes computed on the device, the second weighting each 8-byte
  word by an odd multiple of its position: equal bytes give equal sums, changed, moved or swapped
  bytes change them (fast enough for a 7B model in every benchmark step).

Runs inside SGLang's scheduler process (``ckpt_sglang.probe``); imports torch only.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["state_digests", "tensor_digest", "MODES"]

MODES = ("sha256", "sums")


@torch.no_grad()
def tensor_digest(t: torch.Tensor, mode: str = "sha256") -> list:
    """[dtype, shape, digest] of one tensor (meta tensors: 'meta')."""
    head = [str(t.dtype).removeprefix("torch."), list(t.shape)]
    if t.is_meta:
        return head + ["meta"]
    data = t.detach().contiguous().reshape(-1)
    raw = data.view(torch.uint8) if data.numel() else data.new_empty(0, dtype=torch.uint8)
    if mode == "sums":
        return head + [_sums(raw)]
    return head + [hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest()]


def _sums(raw: torch.Tensor) -> str:
    if raw.numel() == 0:
        return "0:0"
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64).mul_(2).add_(1)
    return f"{int(words.sum())}:{int((words * weights).sum())}:{raw.numel() - pad}"


def state_digests(model: torch.nn.Module, mode: str = "sha256") -> dict[str, list]:
    """``{name: [dtype, shape, digest]}`` of every parameter and buffer of ``model`` (see the module doc)."""
    if mode not in MODES:
        raise ValueError(f"digest mode must be one of {MODES}, got {mode!r}")
    out: dict[str, list] = {}
    for qname, module in model.named_modules(remove_duplicate=False):
        prefix = f"{qname}." if qname else ""
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None and prefix + name not in out:
                out[prefix + name] = tensor_digest(t, mode)
    return out
