"""What a driver and an engine adapter need beside ``ParameterServer``: the names in ``__all__`` are
public, and so is the module ``managed`` (a PS rank started by an engine worker); the other modules
of this package (``base``, ``registry``, ``driver``, ``requests``, ``http``) are not.

- The engine seam (``base``, ``registry``): ``EngineKind`` (one kind of engine, found by name
  through the entry-point group ``ckpt_core.engines``: ``get_engine``, ``available_engines``,
  ``register_engine``), ``EngineClient`` (what the service and drivers call on one engine server:
  update, stage, commit, optionally slice_plan and precheck, close), ``UpdateReport`` (what each
  call returns) and ``Requester`` (the HTTP plumbing an engine's client builds on).

- ``group_handles(handles, rank, inference_parallel_size)``: what a rank's ``req_func`` posts to
  its engine (the first rank of each inference group posts its group's handles; None elsewhere).
- The reference launchers' flow, as ``examples/vllm_update.py`` and ``python -m
  ckpt_sglang.update`` run it: ``UPDATE_METHODS``, ``update_methods``, ``serves_p2p``,
  ``prepare_checkpoint``, ``run_updates``, ``slices_wanted`` (the operator's ``CKPT_SLICES``).
- ``emit_json_line(obj)``: one JSON line in one write (torchrun ranks share stdout).
- argparse types bounded like ``ckpt-engine``'s own options (a value out of bounds is a usage
  error naming the option, exit 2): ``number``, ``count``, ``SECONDS``, ``TIMEOUT``,
  ``GIB_OR_NONE``, and the bounds ``MAX_DEVICES``, ``MAX_RANKS``.

Nothing here imports torch or an engine; each name is imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_core.ops.lazy import lazy_exports

_LAZY = {
    "EngineKind": "ckpt_core.engines.base",
    "EngineClient": "ckpt_core.engines.base",
    "UpdateReport": "ckpt_core.engines.base",
    "Requester": "ckpt_core.engines.base",
    "get_engine": "ckpt_core.engines.registry",
    "available_engines": "ckpt_core.engines.registry",
    "register_engine": "ckpt_core.engines.registry",
    "group_handles": "ckpt_core.engines.requests",
    "UPDATE_METHODS": "ckpt_core.engines.driver",
    "update_methods": "ckpt_core.engines.driver",
    "serves_p2p": "ckpt_core.engines.driver",
    "prepare_checkpoint": "ckpt_core.engines.driver",
    "run_updates": "ckpt_core.engines.driver",
    "slices_wanted": "ckpt_core.engines.driver",
    "emit_json_line": "ckpt_core.engines.driver",
    "number": "ckpt_core._cli_args",
    "count": "ckpt_core._cli_args",
    "SECONDS": "ckpt_core._cli_args",
    "TIMEOUT": "ckpt_core._cli_args",
    "GIB_OR_NONE": "ckpt_core._cli_args",
    "MAX_DEVICES": "ckpt_core._cli_args",
    "MAX_RANKS": "ckpt_core._cli_args",
}

if TYPE_CHECKING:
    from ckpt_core._cli_args import GIB_OR_NONE, MAX_DEVICES, MAX_RANKS, SECONDS, TIMEOUT, count, number
    from ckpt_core.engines.base import EngineClient, EngineKind, Requester, UpdateReport
    from ckpt_core.engines.driver import (
        UPDATE_METHODS,
        emit_json_line,
        prepare_checkpoint,
        run_updates,
        serves_p2p,
        slices_wanted,
        update_methods,
    )
    from ckpt_core.engines.registry import available_engines, get_engine, register_engine
    from ckpt_core.engines.requests import group_handles

# a literal list (not list(_LAZY)), so that linters see the re-exports above
__all__ = [
    "EngineKind",
    "EngineClient",
    "UpdateReport",
    "Requester",
    "get_engine",
    "available_engines",
    "register_engine",
    "group_handles",
    "UPDATE_METHODS",
    "update_methods",
    "serves_p2p",
    "prepare_checkpoint",
    "run_updates",
    "slices_wanted",
    "emit_json_line",
    "number",
    "count",
    "SECONDS",
    "TIMEOUT",
    "GIB_OR_NONE",
    "MAX_DEVICES",
    "MAX_RANKS",
]
assert set(__all__) == set(_LAZY)  # noqa: S101 - both lists name the same exports (checked at import)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
