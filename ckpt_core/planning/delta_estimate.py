"""What a delta update moves and costs at a given density (``ckpt-engine plan --delta-density``).

A delta (``ckpt_core/delta``, docs/deltas.md) sends, per changed tensor, the smallest of its
encodings; an unchanged tensor sends nothing. With ``d`` the fraction of changed elements, spread
at random positions (what AdamW steps measured: docs/deltas.md), and ``e`` bytes per element, the
body bytes per element of each encoding are (``delta/encode.py``, ``measure``)::

    gap16   d * (2 + e)        while every gap between changed elements fits in 16 bits
    idx     d * (4 + e)        the positions as int32
    bitmap  1/8 + d * e        one bit per element
    whole   e

so bf16 costs ``2 d`` of its bytes below ~6 %, then ``1/16 + d``, and never more than the tensor.
Changes in blocks (``runs``) encode smaller still: the estimate is the random case, an upper bound.

The engine checks the ``lin64`` digest of every *changed* tensor's full bytes after the apply
(lossless, checked), so the check scales with the bytes of the tensors that changed, not with the
density: at 2 % every tensor of a few thousand elements or more changes. The check runs where the
tensor lives (``delta/lin64.py``: on a GPU without a host copy); the calibration's rate is the
host's, an upper bound of the time on a device.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ckpt_core.errors import ConfigError

GB = 1e9
MAX_GAP16 = 0xFFFF


@dataclass(frozen=True)
class DeltaCalibration:
    """Host-side rates of the delta codec, per rank (GB/s of the whole tensors' bytes)."""
    encode_gbps: float = 0.156       # compare + positions + values + the new tensor's digest (64 MiB bf16, 2 %)
    apply_gbps: float = 0.43         # decode + check the payload + scatter (64 MiB bf16, 1.5 %)
    digest_gbps: float = 3.4         # lin64 of a changed tensor's bytes after the apply, on the host
    source: str = ("benchmarks/results/2026-12-03-cpu-delta-codec.json (2-core AMD EPYC, AVX2, shared), the digest "
                   "from 2026-12-04-cpu-delta-digest.txt (2-core Xeon, shared): host rates, upper bounds of the time "
                   "(on one H200 lin64 ran at 89 GB/s: 2026-12-04-1xH200-d262d4a-gpu-tests-lin64-device-source.log)")


def changed_tensor_fraction(density: float, elements_per_tensor: float) -> float:
    """The chance that a tensor of ``elements_per_tensor`` elements has at least one changed element
    when each changes independently with probability ``density``."""
    if density <= 0:
        return 0.0
    if density >= 1:
        return 1.0
    return -math.expm1(elements_per_tensor * math.log1p(-density))


def payload_fraction(density: float, item_bytes: int, elements_per_tensor: float) -> tuple[float, str]:
    """(payload bytes / tensor bytes, encoding) of one changed tensor at ``density`` (random positions)."""
    if not 0 <= density <= 1:
        raise ConfigError(f"a density is a fraction of the elements in [0, 1], got {density!r}")
    if item_bytes < 1:
        raise ConfigError(f"item_bytes must be >= 1, got {item_bytes!r}")
    e = float(item_bytes)
    sizes = {"whole": 1.0, "idx": density * (4 + e) / e, "bitmap": (1 / 8 + density * e) / e}
    # gap16 holds while no gap between changed elements reaches 2**16: expected gaps that long,
    # d * n * (1 - d) ** 65535, well below one
    long_gaps = density * elements_per_tensor * math.exp(MAX_GAP16 * math.log1p(-min(density, 1 - 1e-12)))
    if long_gaps < 0.5:
        sizes["gap16"] = density * (2 + e) / e
    best = min(sizes, key=lambda k: (sizes[k], k != "whole"))
    return min(sizes[best], 1.0), best


def predict_delta(full: dict, density: float, *, item_bytes: int = 2,
                  cal: DeltaCalibration = DeltaCalibration()) -> dict:
    """A delta update beside the full one that ``capacity.predict`` gave (``full``): the payload
    moves through the same stages (host-to-device, broadcast or the network) at their rates, the
    engine applies it and checks the changed tensors' digests. Plain data."""
    if not 0 <= density <= 1:   # NaN too: every comparison with it is false
        raise ConfigError(f"--delta-density is a fraction of the elements in [0, 1], got {density!r}")
    model_bytes, tensors, ranks = full["model_bytes"], full["tensors"], full["ranks"]
    per_tensor = model_bytes / tensors / item_bytes
    fraction, encoding = payload_fraction(density, item_bytes, per_tensor)
    changed = changed_tensor_fraction(density, per_tensor)
    payload = int(model_bytes * changed * fraction)
    scale = payload / model_bytes if model_bytes else 0.0
    # the full update's data stages, scaled to the payload (each moves bytes at its rate)
    stages = {k: v * scale for k, v in full["stages_s"].items() if k in ("h2d", "broadcast", "p2p")}
    received = full["received_bytes_per_rank"] * changed   # the changed tensors of what a rank receives
    stages["apply"] = received / (cal.apply_gbps * GB)
    stages["check"] = received / (cal.digest_gbps * GB)
    update = full["fixed_s"] + sum(stages.values())   # not pipelined against each other: an upper bound
    share = full["host_bytes_per_rank"]
    return {
        "density": density, "encoding": encoding, "payload_bytes": payload,
        "payload_fraction": round(payload / model_bytes, 6) if model_bytes else 0.0,
        "changed_tensor_fraction": round(changed, 6), "ranks": ranks,
        "stages_s": {k: round(v, 6) for k, v in stages.items()},
        "bottleneck": max(stages, key=stages.__getitem__), "update_s": round(update, 6),
        "full_update_s": full["update_s"], "pays_off": update < full["update_s"],
        "register_with_base_s": round(share / (cal.encode_gbps * GB), 3),
        "host_bytes_per_rank": share + int(share * changed * fraction),   # the version, then its delta
        "calibration": asdict(cal),
    }


def delta_text(doc: dict) -> list[str]:
    """The lines ``ckpt-engine plan`` prints for a delta prediction."""
    d = doc
    stages = ", ".join(f"{k} {v:.3f} s" for k, v in d["stages_s"].items())
    verdict = ("pays off" if d["pays_off"] else "does not pay off: send the full version (delta=\"fallback\" "
               "or no delta)")
    return [f"  delta at {d['density'] * 100:g} % changed elements ({d['encoding']}): payload "
            f"{d['payload_bytes'] / (1 << 30):.3f} GiB ({d['payload_fraction'] * 100:.2f} % of the model, "
            f"{d['changed_tensor_fraction'] * 100:.0f} % of the tensors change), update ~ {d['update_s']:.3f} s "
            f"({stages}) against {d['full_update_s']:.3f} s full: {verdict}",
            f"    bottleneck {d['bottleneck']}; registering a version with its base ~ "
            f"{d['register_with_base_s']:.2f} s per rank; codec rates from {d['calibration']['source']}"]
