"""The update of one service rank (``POST /v1/checkpoints/{name}/update``) and the commit of a staged one.

Everything this rank could refuse by itself (the checkpoint's name, ``inference_group_ranks``, the
engine endpoint against the operator's policy, a sliced request on the stock wire) is checked first
and agreed with every rank (``_agree.agree``) before any collective: every rank answers the same
error, or all go on. Then, for a sliced update, the slice plan is shared (a collective), and the
parameter server's update runs (collective).
"""

from __future__ import annotations

import re
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from ckpt_core._settings import slices_enabled
from ckpt_core.engines.base import EngineClient, Prechecked, supports_slices
from ckpt_core.engines.registry import get_engine
from ckpt_core.errors import ConfigError
from ckpt_core.ops.log import rank_logger
from ckpt_core.transfer.prechecks import problem_of

from ._agree import agree
from ._models import NAME_PATTERN, UpdateRequest
from ._policy import ServicePolicy

if TYPE_CHECKING:
    from ckpt_core.planning.slices import SlicePlan


def check_name(name: str) -> str:
    if not re.fullmatch(NAME_PATTERN, name):
        raise ConfigError(f"checkpoint name {name[:80]!r} is not allowed "
                          "(1-256 characters, no '/' or control characters)")
    return name


class _EngineRequest:
    """The ``req_func`` of one update that gives ``update_url``: posts the chosen handles through
    ``engine`` (the client of ``body.engine``, ``ckpt_core.engines``) with the engine ``options`` the
    request set, and closes it (the PS may stop waiting for its thread: the client is closed there,
    after its last request); when it never ran (``ran`` false) the caller closes it. ``plan``: the
    slice plan the update routes by (``slices``), whose digest the engine's workers are told.
    ``precheck``: the client's, where the engine has one (asked on every rank before anything moves)."""

    def __init__(self, body: UpdateRequest, engine: EngineClient, options: dict[str, Any]) -> None:
        self.body, self.engine, self.options = body, engine, options
        self.ran = False
        self.precheck: Callable[[], object] | None = getattr(engine, "precheck", None)

    def __call__(self, handles: list[tuple[str, str]], plan: SlicePlan | None = None) -> None:
        self.ran = True
        body = self.body
        chosen = [handles[r] for r in body.inference_group_ranks] if body.inference_group_ranks else handles
        sliced = {"slices": plan.digest} if plan is not None else {}
        with self.engine:
            if body.stage is not None:
                self.engine.stage(chosen, body.stage, device_bytes=int(body.stage_device_gib * (1 << 30)),
                                  **self.options, **sliced)
            else:
                self.engine.update(chosen, **self.options, **sliced)


def _engine_request(body: UpdateRequest, world_size: int, wire: str, policy: ServicePolicy,
                    name: str = "") -> _EngineRequest | None:
    """This rank's checks of the request's engine, then its :class:`_EngineRequest` (None: the request
    gives no ``update_url``, nothing is posted). A wire the engine's workers do not speak is refused up front."""
    bad = [r for r in body.inference_group_ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"inference_group_ranks {bad} are outside this world of {world_size} ranks")
    kind = get_engine(body.engine)
    kind.check_wire(wire)
    if body.uds is not None and body.update_url is None:
        raise ConfigError("uds is the socket to reach update_url by: give update_url too")
    if body.update_url is None:
        return None
    uds = policy.check_engine(body.update_url, body.uds, body.engine)   # before anything is posted
    options = {k: v for k, v in body.engine_options().items() if k != "slices"}   # slices: the plan's digest
    if body.delta and "deltas" in kind.options:   # the workers apply the delta and keep it as the next base
        options["deltas"] = True
    if options.get("deltas") and body.stage is not None and body.stage != name:
        raise ConfigError(f"a staged update with delta or deltas stages the checkpoint under its own name: give "
                          f"stage={name!r}, not {body.stage!r} (the workers name the version they hold by it, and "
                          "the next delta names its base by it; docs/deltas.md)")
    kind.check_options(options, staged=body.stage is not None)   # again, with the deltas a delta implies
    if options.get("deltas") and body.stage is None:   # a delta names its base by the version the workers hold
        options["version"] = name                      # (staged: the stage's version, which is name)
    return _EngineRequest(body, kind.client(body.update_url, uds=uds, timeout=body.timeout), options)


def _post_nothing(handles: list[tuple[str, str]]) -> None:
    """The ``req_func`` of an update without ``update_url``."""


_SLICES_OFF_SAID: list = []   # the CKPT_SLICES=0 warning, once per process
_ENGINE_PLANS: dict = {}   # update_url -> the slice plan its workers were last given (client.slice_plan(reuse=))


def run_update(ps, name: str, body: UpdateRequest, policy: ServicePolicy) -> dict:
    """The collective update of one request (on the service's worker thread): this rank's checks,
    agreed with every rank before any collective (``_agree.agree``); then the slice plan shared first
    when the request asks for ``slices`` (and the operator did not turn them off, ``CKPT_SLICES=0``:
    then whole, said once); then the parameter server's update."""
    request: _EngineRequest | None = None
    slices, off, problem = None, False, None
    try:
        try:
            check_name(name)
            request = _engine_request(body, ps.world_size, ps.wire, policy, name)
            off = bool(body.slices) and not slices_enabled()   # a bad CKPT_SLICES is this rank's refusal too
            slices = _sliced(ps, name, body)
        except Exception as exc:   # ours or not: told to every rank in the agreement, none is left waiting
            problem = problem_of(exc)
        agree(ps, "update", name, problem, slices=slices, slices_off=off)
        plan = _slice_plan(ps, name, body, None if request is None else request.engine) if slices else None
        # asked by ps.update before anything moves: a refusal reaches every rank
        req = _post_nothing if request is None else Prechecked(partial(request, plan=plan), request.precheck)
        return ps.update(name, req, ranks=body.ranks or None, timeout=body.timeout, slices=plan, delta=body.delta)
    finally:
        if request is not None and not request.ran:
            request.engine.close()


def _sliced(ps, name: str, body: UpdateRequest) -> bool:
    """Whether this rank's update is sliced: asked for, and not turned off here (``CKPT_SLICES=0``)."""
    if body.slices and not slices_enabled():
        if not _SLICES_OFF_SAID:
            _SLICES_OFF_SAID.append(True)
            rank_logger(f"service rank {ps.rank}/{ps.world_size}").warning(
                "phase=update checkpoint=%s slices were asked for, but CKPT_SLICES=0 turns them off: whole tensors",
                name)
        return False
    if body.slices and ps.wire != "native":
        raise ConfigError(f"slices need a parameter server speaking our own wire; this one speaks {ps.wire!r}")
    return bool(body.slices)


def _slice_plan(ps, name: str, body: UpdateRequest, engine: EngineClient | None):
    """Collective, before a sliced update: the ranks whose request gives ``update_url`` record the plan
    from that engine's workers (its client's ``slice_plan``, e.g. ``VllmClient.slice_plan``: recorded
    once per model, layout and engine version, then installed on the workers), and every rank gets the
    lowest such rank's. A rank that could not record it fails every rank, naming it, before anything moves."""
    recorded, error = None, None
    if engine is not None:   # this rank's request gives update_url
        try:
            if not supports_slices(engine):
                raise ConfigError(f"engine={body.engine!r} records no slice plans")
            # The engine's plan of the last update is kept while its workers hold it (no re-recording).
            recorded = _ENGINE_PLANS[body.update_url] = engine.slice_plan(
                ps.tensor_specs(name), reuse=_ENGINE_PLANS.get(body.update_url))
        except Exception as exc:   # ours or not: said on every rank (the others would wait in the exchange)
            error = f"{type(exc).__name__}: {exc}"
    return ps.share_slice_plan(recorded, src=None, error=error)


def run_commit(body, policy: ServicePolicy) -> dict:
    """``POST /v1/commit``: the engine's staged version made live (see ``CommitRequest``)."""
    uds = policy.check_engine(body.update_url, body.uds, body.engine)
    with get_engine(body.engine).client(body.update_url, uds=uds, timeout=body.timeout) as client:
        report = client.commit(body.version, pause=body.pause, timeout=body.timeout)
    return {"version": body.version, "seconds": report.seconds, "workers": report.workers}
