"""One PS rank's sliced deltas (``sliced.py``): built once per (version, slice plan), agreed before a
sliced delta update moves anything, released with the version.

``prepare`` is the collective a sliced delta update runs once the delta's agreement
(``dispatch.agree_delta``: the base the engines hold, the companion or fold that leads from it) picked
the companion to cut: each rank checks the plan (a ``SlicePlan``), that it holds that companion and
the version, and builds its box payloads if it has not yet for this plan (a problem while building:
a plan that does not fit the version); one exchange tells every rank every problem, the plan each
rank was given and whether each already holds the sliced companion's gathered metas. Then, only when some
rank lacks them, the companion's metas are gathered; the routing (``sliced.routes_of``) is computed
once per companion. Every rank raises the same error, before any transfer, or none does.
"""

from __future__ import annotations

import time

from ckpt_core.checkpoint.sources import build_checkpoint
from ckpt_core.delta.sliced import DeltaRoutes, build_box_payloads, routes_of, sliced_name
from ckpt_core.delta.versions import DeltaVersions
from ckpt_core.errors import ConfigError, DeltaBaseError
from ckpt_core.planning.slices import SlicePlan, require_plan
from ckpt_core.transfer.agree import gather_metas
from ckpt_core.transfer.context import Catalog, UpdateContext
from ckpt_core.transfer.prechecks import problem_of, raise_agreed, same_call


class SlicedDeltas:
    """The sliced deltas this rank built: per version, its companions (one per slice plan) and their figures."""

    def __init__(self, ctx: UpdateContext, catalog: Catalog, versions: DeltaVersions):
        self.ctx, self.catalog, self.versions = ctx, catalog, versions
        self.built: dict[str, list[str]] = {}            # version -> its sliced companions (of its delta, folds)
        self.figures: dict[str, dict] = {}               # companion -> its build figures (this rank's share)
        self.routes: dict[str, DeltaRoutes] = {}         # companion -> its routing, once its metas are gathered

    def prepare(self, name: str, comp: str, slices) -> DeltaRoutes:
        """Collective: the routing by ``slices`` of version ``name``'s delta companion ``comp`` cut into boxes,
        agreed on every rank; refusals (``ConfigError`` for a bad or mismatched plan or a device-resident
        version, ``DeltaBaseError`` for a rank that does not hold ``comp``) raised alike on every rank,
        before anything moves."""
        # the call's identity travels too: a rank that passed no plan is in another exchange (a whole delta's
        # gather_metas), whose own check of the name then fails alike
        view: dict[str, object] = {"problem": None, "plan": None, "ready": False,
                                   "name": f"sliced delta of {name!r}" if isinstance(name, str) else repr(name)}
        try:
            plan = require_plan(slices)
            view["plan"] = plan.digest
            if not isinstance(name, str):
                raise ConfigError(f"checkpoint name must be a string, got {name!r}")
            if comp not in self.catalog.checkpoints or name not in self.catalog.checkpoints:
                raise DeltaBaseError(f"rank {self.ctx.rank} does not hold {comp!r} and {name!r} in its memory: a "
                                     "sliced delta is cut from the registered version and its delta (update it whole)")
            cut = sliced_name(comp, plan)
            if cut not in self.catalog.checkpoints:
                self._build(name, comp, plan)
            view["ready"] = cut in self.routes
        except Exception as exc:   # ours or not: told to every rank, none is left waiting
            view["problem"] = problem_of(exc)
        views = self.ctx.coll.all_gather_json(view)
        raise_agreed([v.get("problem") for v in views], f"sliced delta update({name!r})")
        same_call(views, f"sliced delta update({name!r})",
                  {"name": "call (a delta with slices= on every rank, or on none)"})
        if len({v["plan"] for v in views}) != 1:
            raise ConfigError(f"ranks disagree on the slice plan of the delta update({name!r}): "
                              f"{[v['plan'] for v in views]} (give every rank the same plan)")
        cut = sliced_name(comp, plan)
        if not all(v["ready"] for v in views):   # some rank built it now: every rank gathers its metas
            self.routes.pop(cut, None)
            gather_metas(self.ctx, self.catalog, cut)
            self.routes[cut] = routes_of(plan, self.catalog.metas[cut])
        return self.routes[cut]

    def _build(self, name: str, comp: str, plan: SlicePlan) -> None:
        t0 = time.perf_counter()
        version = self.catalog.checkpoints[name]
        if version.on_device:
            raise ConfigError(f"{name!r} is device-resident: a sliced delta is cut from host memory")
        if any(m.box is not None for m in version.metas):
            raise ConfigError(f"{name!r} is registered in pieces: slice plans take whole tensors (docs/trainers.md, "
                              "Limits); update its delta without slices=")
        payloads, fig = build_box_payloads(version, self.catalog.checkpoints[comp], plan)
        cut = sliced_name(comp, plan)
        self.catalog.checkpoints[cut] = build_checkpoint(cut, self.ctx.backend, named_tensors=payloads)
        self.built.setdefault(name, []).append(cut)
        self.figures[cut] = dict(fig, build_s=time.perf_counter() - t0)

    def forget(self, name: str) -> None:
        """Release the sliced deltas of version ``name`` (``unregister_checkpoint``)."""
        for comp in self.built.pop(name, []):
            ckpt = self.catalog.checkpoints.pop(comp, None)
            if ckpt is not None:
                ckpt.release()
            self.catalog.metas.pop(comp, None)
            self.catalog.plans.forget(comp)
            self.figures.pop(comp, None)
            self.routes.pop(comp, None)


__all__ = ["SlicedDeltas"]
