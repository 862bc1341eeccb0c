"""What every rank's service agrees on before a collective route starts a collective.

A collective route (gather, update) is posted to every rank's service, each with its own body (the
reference's convention gives ``update_url`` to one rank per engine). Whatever one rank would refuse
on its own (a body that does not validate, an engine endpoint outside its policy, a bad
``inference_group_ranks``) and whatever must be the same on every rank for the ranks to run the same
collectives (the operation, the checkpoint, whether the update is sliced: a sliced update shares a
plan first, a collective the others would not join) is exchanged first, in one small collective
(:func:`agree`, over the control group, bounded by ``PS_COLLECTIVE_TIMEOUT_S`` like every
collective). Then every rank raises the same typed error, or none does: no rank answers at once
while its peers wait in a collective it left, and the world stays usable for the next request.

Exchange (one ``all_gather_json``, each rank's view in rank order)::

    {"op": "update" | "gather", "name": checkpoint, "problem": [error class, message] | null,
     "slices": bool | null, "slices_off": bool}

Order of the verdict, the same on every rank: another operation or checkpoint on some rank
(ConfigError), then the lowest refusing rank's error class with every refusing rank's message,
then a disagreement on slices (ConfigError naming CKPT_SLICES where it turned them off).
"""

from __future__ import annotations

from ckpt_core.errors import ConfigError
from ckpt_core.transfer.prechecks import problem_of, raise_agreed, same_call

from ._policy import Forbidden

__all__ = ["ValidationError", "agree", "refusal"]


class ValidationError(ConfigError):
    """A request body that does not validate (HTTP 422, ``type`` ``ValidationError`` as FastAPI's own),
    raised on every rank of a collective route once the ranks agreed on it."""


KINDS = {"Forbidden": Forbidden, "ValidationError": ValidationError}   # ours, beside ckpt_core.errors


def refusal(check, *args) -> list | None:
    """``check(*args)``'s error as it travels in :func:`agree` (None: it passed)."""
    try:
        check(*args)
    except Exception as exc:   # ours or not: told to every rank, none is left waiting
        return problem_of(exc)
    return None


def agree(ps, operation: str, name: str, problem: list | None, *, slices: bool | None = None,
          slices_off: bool = False) -> None:
    """Collective, the route's first: every rank's operation, checkpoint, verdict (``problem``) and
    ``slices``; raises on every rank alike (see the module docstring), else returns on every rank."""
    views = ps.all_gather_json({"op": operation, "name": name, "problem": problem, "slices": slices,
                                "slices_off": slices_off})
    what = f"{operation}({name[:200]!r})"
    same_call(views, what, {"op": "operation", "name": "checkpoint"})
    raise_agreed([v.get("problem") for v in views], what, KINDS)
    asked = [v.get("slices") for v in views]
    if len(set(asked)) > 1:
        off = [r for r, v in enumerate(views) if v.get("slices_off")]
        why = f"; CKPT_SLICES=0 turns them off on rank(s) {off}" if off else ""
        told = ", ".join(f"rank {r} {x}" for r, x in enumerate(asked))
        raise ConfigError(f"{what} refused: ranks disagree on slices ({told}){why}: give every rank's request the "
                          "same \"slices\" and every rank's service the same CKPT_SLICES")
