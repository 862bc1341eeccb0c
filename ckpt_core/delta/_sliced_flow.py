"""One PS rank's sliced deltas (``sliced.py``): built once per (version, slice plan), agreed before a
sliced delta update moves anything, released with the version.

``prepare`` is the collective a sliced delta update starts with (``dispatch.Updates._sliced_delta``):
each rank checks the plan (a ``SlicePlan``), that it holds the version's delta (registered with
``base=``), and builds its box payloads if it has not yet for this plan (a problem while building:
a plan that does not fit the version); one exchange tells every rank every problem, the plan each
rank was given and whether each already holds the companion's gathered metas. Then, only when some
rank lacks them, the companion's metas are gathered; the routing (``sliced.routes_of``) is computed
once per companion. Every rank raises the same error, before any transfer, or none does.
"""

from __future__ import annotations

import time

from ckpt_core.checkpoint.sources import build_checkpoint
from ckpt_core.delta.sliced import DeltaRoutes, build_box_payloads, routes_of, sliced_name
from ckpt_core.delta.versions import DeltaVersions, companion
from ckpt_core.errors import ConfigError, DeltaBaseError
from ckpt_core.planning.slices import SlicePlan, require_plan
from ckpt_core.transfer.agree import gather_metas
from ckpt_core.transfer.context import Catalog, UpdateContext
from ckpt_core.transfer.prechecks import problem_of, raise_agreed, same_call


class SlicedDeltas:
    """The sliced deltas this rank built: per version, its companions (one per slice plan) and their figures."""

    def __init__(self, ctx: UpdateContext, catalog: Catalog, versions: DeltaVersions):
        self.ctx, self.catalog, self.versions = ctx, catalog, versions
        self.built: dict[str, list[str]] = {}            # version -> its sliced companions
        self.figures: dict[str, dict] = {}               # companion -> its build figures (this rank's share)
        self.routes: dict[str, DeltaRoutes] = {}         # companion -> its routing, once its metas are gathered

    def prepare(self, name: str, slices) -> tuple[str, DeltaRoutes]:
        """Collective: (the delta's base, the routing of its payloads by ``slices``), agreed on every rank;
        refusals (``ConfigError`` for a bad or mismatched plan, ``DeltaBaseError`` for a version without a
        delta on some rank) raised alike on every rank, before anything moves."""
        # the call's identity travels too: a rank that passed no plan is in another exchange (a whole delta's
        # gather_metas), whose own check of the name then fails alike
        view: dict[str, object] = {"problem": None, "plan": None, "ready": False,
                                   "name": f"sliced delta of {name!r}" if isinstance(name, str) else repr(name)}
        try:
            plan = require_plan(slices)
            view["plan"] = plan.digest
            if not isinstance(name, str):
                raise ConfigError(f"checkpoint name must be a string, got {name!r}")
            if self.versions.bases.get(name) is None or companion(name) not in self.catalog.checkpoints:
                raise DeltaBaseError(f"{name!r} was not registered with a base on rank {self.ctx.rank}: "
                                     "update it whole")
            comp = sliced_name(name, plan)
            if comp not in self.catalog.checkpoints:
                self._build(name, plan)
            view["ready"] = comp in self.routes
        except Exception as exc:   # ours or not: told to every rank, none is left waiting
            view["problem"] = problem_of(exc)
        views = self.ctx.coll.all_gather_json(view)
        raise_agreed([v.get("problem") for v in views], f"sliced delta update({name!r})")
        same_call(views, f"sliced delta update({name!r})",
                  {"name": "call (a delta with slices= on every rank, or on none)"})
        if len({v["plan"] for v in views}) != 1:
            raise ConfigError(f"ranks disagree on the slice plan of the delta update({name!r}): "
                              f"{[v['plan'] for v in views]} (give every rank the same plan)")
        comp = sliced_name(name, plan)
        if not all(v["ready"] for v in views):   # some rank built it now: every rank gathers its metas
            self.routes.pop(comp, None)
            gather_metas(self.ctx, self.catalog, comp)
            self.routes[comp] = routes_of(plan, self.catalog.metas[comp])
        return self.versions.bases[name], self.routes[comp]

    def _build(self, name: str, plan: SlicePlan) -> None:
        t0 = time.perf_counter()
        version = self.catalog.checkpoints[name]
        if version.on_device:
            raise ConfigError(f"{name!r} is device-resident: a sliced delta is cut from host memory")
        payloads, fig = build_box_payloads(version, self.catalog.checkpoints[companion(name)], plan)
        comp = sliced_name(name, plan)
        self.catalog.checkpoints[comp] = build_checkpoint(comp, self.ctx.backend, named_tensors=payloads)
        self.built.setdefault(name, []).append(comp)
        self.figures[comp] = dict(fig, build_s=time.perf_counter() - t0)

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
