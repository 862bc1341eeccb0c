"""Pure planners: bucket packing, the capacity model, NIC and reader assignment (plain data in and out).

Public (the modules of this package are not): ``SlicePlan`` (which slices each engine rank's
loaders read, as ``VllmClient.slice_plan`` records it and ``ParameterServer.update(..., slices=)``
routes by), ``write_plan_file(path, plan)`` and ``read_plan_file(path)`` (its JSON file, which
``ckpt-engine plan --slices-plan FILE`` reads). Imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_core.ops.lazy import lazy_exports

_LAZY = {
    "SlicePlan": "ckpt_core.planning.slices",
    "write_plan_file": "ckpt_core.planning.slices",
    "read_plan_file": "ckpt_core.planning.slices",
}

if TYPE_CHECKING:
    from ckpt_core.planning.slices import SlicePlan, read_plan_file, write_plan_file

# a literal list (not list(_LAZY)), so that linters see the re-exports above
__all__ = [
    "SlicePlan",
    "write_plan_file",
    "read_plan_file",
]
assert set(__all__) == set(_LAZY)  # noqa: S101 - both lists name the same exports (checked at import)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
