"""The pure parts of verl's ckpt backend: who keeps which tensor, and who meets whom.

Plain data in, plain data out (unit-tested without verl): ``topology`` is ``build_topology``'s
answer, ``take_share`` walks verl's weight generator on a trainer rank.
"""

from __future__ import annotations

import torch

from ckpt_core.errors import CheckpointFormatError, ConfigError


def topology(trainers: int, rollouts: int, metadata: list) -> tuple[dict[str, list], dict[str, list]]:
    """Each worker's ``init_process_group`` arguments, trainers first (verl's order of ``metadata``).

    Trainer rank 0 is the master (``is_master``): its metadata carries the store and the round id,
    which every worker gets. Raises ``ConfigError`` for any other shape of ``metadata``."""
    if not isinstance(trainers, int) or not isinstance(rollouts, int) or trainers < 1 or rollouts < 1:
        raise ConfigError(f"need at least one trainer and one rollout worker, got {trainers!r} and {rollouts!r}")
    if not isinstance(metadata, list) or len(metadata) != trainers + rollouts:
        raise ConfigError(f"expected {trainers} + {rollouts} workers' metadata, got "
                          f"{len(metadata) if isinstance(metadata, list) else type(metadata).__name__}")
    masters = [i for i, m in enumerate(metadata) if isinstance(m, dict) and "master" in m]
    if masters != [0]:
        raise ConfigError(f"exactly trainer rank 0 must be the master (is_master=True); masters: {masters}")
    master = metadata[0]["master"]
    if not (isinstance(master, dict) and isinstance(master.get("addr"), str) and isinstance(master.get("port"), int)
            and isinstance(master.get("round"), str)):
        raise ConfigError(f"the master's metadata lacks its store's addr, port or round id: {master!r}")

    def side(name: str, n: int) -> dict[str, list]:
        return {"side": [name] * n, "rank": list(range(n)), "trainers": [trainers] * n,
                "rollouts": [rollouts] * n, "master": [dict(master) for _ in range(n)]}
    return side("trainer", trainers), side("rollout", rollouts)


async def take_share(weights, rank: int, ranks: int) -> tuple[dict[str, torch.Tensor], Exception | None]:
    """Walk all of verl's (sync or async) generator; keep tensor i when i % ranks == rank, in host memory."""
    mine: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    local: Exception | None = None
    i = 0

    def take(name, tensor) -> None:
        nonlocal i, local
        index, i = i, i + 1
        if local is not None:
            return
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            local = ConfigError(f"verl's weights must be (name, tensor) pairs; item {index} is "
                                f"({type(name).__name__}, {type(tensor).__name__})")
        elif name in seen:
            local = CheckpointFormatError("verl's weights name this tensor twice", tensor=name)
        else:
            seen.add(name)
            if index % ranks == rank:
                mine[name] = tensor.detach() if tensor.device.type == "cpu" else tensor.detach().to("cpu")
    try:
        if hasattr(weights, "__aiter__"):
            async for name, tensor in weights:
                take(name, tensor)
        else:
            for name, tensor in weights:
                take(name, tensor)
    except Exception as exc:   # noqa: BLE001 - the trainer's own generator failed: agreed in _register
        local = local or ConfigError(f"verl's weight generator raised {type(exc).__name__}: {exc}")
    return mine, local


