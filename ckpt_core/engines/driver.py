"""The reference launchers' update flow, shared by our drivers (``examples/vllm_update.py``,
``python -m ckpt_sglang.update``).

Meanings kept from checkpoint-engine's examples/update.py and SGLang's launcher:

- owners (``--checkpoint-path``): register this rank's share, gather metas, rank 0 writes them
  (``--save-metas-file``; JSON here, never pickle), then ``--update-method`` ``broadcast``
  (default), ``p2p`` (every rank pulls from the owners' host memory) or ``all`` (broadcast,
  then p2p);
- joiners (``--load-metas-file``): register nothing, load the owners' metas and pull the
  checkpoint P2P into this world's engines (``--update-method`` is ignored, as upstream);
- ``--sleep-time``: afterwards, keep the checkpoint registered that long (owners serving joiners).

Difference: a P2P update targets every rank of this world (upstream SGLang's launcher names the
first inference group, which is the whole world under its own torchrun re-execution).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from typing import Callable, Iterator

from ckpt_core.errors import ConfigError

UPDATE_METHODS = ("broadcast", "p2p", "all")


def emit_json_line(obj, **dumps_kwargs) -> None:
    """Print ``obj`` as one JSON line in a single write to stdout. The ranks of a torchrun job
    share one stream: a line written in pieces (unbuffered output writes the text, then the
    newline) can have another rank's line land in between; one write of up to PIPE_BUF bytes
    (4 KiB) cannot be split."""
    data = (json.dumps(obj, **dumps_kwargs) + "\n").encode()
    sys.stdout.flush()   # whatever this process printed before goes first
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):   # a captured or replaced stdout
        sys.stdout.write(data.decode())
        sys.stdout.flush()
        return
    while data:
        data = data[os.write(fd, data):]


def slices_wanted(asked: bool, log=None) -> bool:
    """Whether a driver asked for sliced updates gets them: not when the operator turned slices off
    (``CKPT_SLICES=0``), which ``log`` (a logger) is then told once."""
    from ckpt_core._settings import slices_enabled
    if asked and not slices_enabled():
        if log is not None:
            log.warning("sliced updates were asked for, but CKPT_SLICES=0 turns them off: whole tensors")
        return False
    return asked


def update_methods(update_method: str, joining: bool) -> list[str]:
    """The updates to run, in order: ``["p2p"]`` for a joiner, else ``update_method`` expanded."""
    if update_method not in UPDATE_METHODS:
        raise ConfigError(f"--update-method must be one of {UPDATE_METHODS}, got {update_method!r}")
    if joining:
        return ["p2p"]
    return ["broadcast", "p2p"] if update_method == "all" else [update_method]


def serves_p2p(update_method: str, *, joining: bool, save_metas_file: str | None) -> bool:
    """Whether the owners of a launcher serve their checkpoint over P2P (``serve_p2p``, docs/p2p.md):
    only when asked, by ``--update-method p2p|all`` or ``--save-metas-file`` (metas are for joiners,
    who pull P2P); joiners own nothing to serve."""
    return not joining and (update_method in ("p2p", "all") or bool(save_metas_file))


def prepare_checkpoint(ps, name: str, *, files: list[str] | None, load_metas_file: str | None,
                       save_metas_file: str | None) -> float:
    """Collective: make ``name`` updatable on every rank of ``ps``; returns the seconds it took.

    Joiner (``load_metas_file``): ``ps.load_metas`` (validated JSON; a malformed or foreign file is
    a ``ConfigError``). Owner: ``register_checkpoint(files=...)`` + ``gather_metas``. Then rank 0
    writes the metas to ``save_metas_file`` (atomically), if given; an owner address on loopback is a
    ``ConfigError`` on every rank (``ParameterServer.save_metas``).
    """
    t0 = time.perf_counter()
    if load_metas_file:
        ps.load_metas(load_metas_file)
    else:
        ps.register_checkpoint(name, files=files)
        ps.gather_metas(name)
    if save_metas_file:   # every rank checks (same metas, same verdict): rank 0 never fails alone
        ps.check_metas_reachable()
        if ps.rank == 0:
            ps.save_metas(save_metas_file)
    return time.perf_counter() - t0


def run_updates(ps, name: str, methods: list[str], make_req_func: Callable[[list], Callable], *,
                timeout: float, slices=None) -> Iterator[tuple[str, dict, list]]:
    """Collective: run ``methods`` in order; yields ``(method, ps result, reports)`` after each.

    ``make_req_func(reports)`` builds that update's ``req_func``, which may append its engine's
    reports to ``reports``. ``p2p`` targets every rank of the world (``ranks=[0..world)``, rank r
    engine rank r of a slice plan). ``slices``: the plan both kinds of update route by.
    """
    for method in methods:
        reports: list = []
        ranks = list(range(ps.world_size)) if method == "p2p" else None
        result = ps.update(name, make_req_func(reports), ranks=ranks, timeout=timeout,
                           **({"slices": slices} if slices is not None else {}))
        yield method, result, reports
