"""What a rank checks before a collective, and how every rank learns the verdict.

A check that fails on one rank only (a checkpoint unregistered there, a bad
timeout, metas it cannot use) must not make that rank leave while its peers
enter the collective: they would wait for it until ``PS_COLLECTIVE_TIMEOUT_S``
and break the world. Instead each rank turns its local problem into a plain
``[error class, message]`` pair, sends it in the collective's first exchange,
and every rank raises the same typed error (:func:`raise_agreed`); the world
stays usable.
"""

from __future__ import annotations

import math
import time

from ckpt_core import errors
from ckpt_core._settings import update_seconds
from ckpt_core.checkpoint.sources import RegisteredCheckpoint
from ckpt_core.planning.pieces import group_pieces
from ckpt_core.planning.buckets import Plan, TensorMeta, choose_layout, first_shared_name
from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.errors import CheckpointNotFoundError, CkptError, ConfigError

Problem = list   # [error class name, message], JSON on the wire
IDENTITY = {"name": "checkpoint", "wire": "engine wire"}   # what every rank of one update must share


def problem_of(exc: Exception) -> Problem:
    """An error as it travels in an exchange. One that is not ours (a bug, a third-party library)
    travels as ``CkptError`` naming its class, so that every rank still raises a typed error."""
    if isinstance(exc, CkptError):
        return [type(exc).__name__, str(exc)]
    return ["CkptError", f"{type(exc).__name__}: {exc}"]


def raise_agreed(problems: list[Problem | None], what: str) -> None:
    """Raise, on every rank alike, the problems the ranks reported in one exchange (none: return).

    The error class is the lowest failing rank's; the message lists every rank's own message.
    """
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if not failed:
        return
    first = failed[0][1]
    cls = getattr(errors, str(first[0]), None)
    if not (isinstance(cls, type) and issubclass(cls, CkptError)) or cls is errors.RemoteWorkerError:
        cls = ConfigError
    text = "; ".join(dict.fromkeys(str(p[1]) for _, p in failed))   # same text once, rank order kept
    raise cls(f"{what} refused on rank(s) {[r for r, _ in failed]}: {text}")


def same_kind(views: list[dict], what: str) -> None:
    """Every rank called the same kind of update: P2P views carry ``targets``, broadcast views not.

    Checked by both kinds right after :func:`raise_agreed` on the same first exchange, so a
    mixed call fails with this one error on every rank (none waits in a collective).
    """
    p2p = [r for r, v in enumerate(views) if "targets" in v]
    if p2p and len(p2p) != len(views):
        rest = [r for r in range(len(views)) if r not in p2p]
        raise ConfigError(f"{what} refused: rank(s) {p2p} called a P2P update (ranks=[...]) but rank(s) "
                          f"{rest} a broadcast update (ranks empty or None); call it alike on every rank")


def same_call(views: list[dict], what: str, keys: dict[str, str]) -> None:
    """Every rank called the collective about the same thing: each ``key`` of ``keys`` has one
    value on every rank (``keys`` maps a view's key to what it means, for the message).

    The identity of what a collective moves (the checkpoint's name, the engines' wire) travels
    in its first exchange: ranks naming two checkpoints of one layout would otherwise each send
    their own bytes, and the engines would hold a mix of both. Raised alike on every rank.
    """
    for key, label in keys.items():
        values = [v.get(key) for v in views]
        if any(x != values[0] for x in values):
            told = ", ".join(f"rank {r} {x!r}" for r, x in enumerate(values))
            raise ConfigError(f"{what} refused: ranks disagree on the {label} ({told}); call it alike on every rank")


def parse_metas(metas, world_size: int) -> dict[str, list[list[TensorMeta]]]:
    """Metas in the form ``get_metas()`` returns, checked whole before anything is installed."""
    if not isinstance(metas, dict):
        raise ConfigError(f"metas must be the dict get_metas() returns, got {type(metas).__name__}")
    out: dict[str, list[list[TensorMeta]]] = {}
    for name, per_rank in metas.items():
        try:
            parsed = [[_meta(m) for m in ms] for ms in per_rank]
        except (TypeError, AttributeError, KeyError, ValueError) as exc:   # ConfigError is a ValueError
            raise ConfigError(f"metas of {name!r} are not in the format get_metas() returns: {exc}") from exc
        if len(parsed) != world_size:
            raise ConfigError(f"metas of {name!r} describe {len(parsed)} ranks, this world has {world_size}")
        shared = first_shared_name(parsed)
        if shared:
            raise ConfigError(f"metas of {name!r} list tensor {shared[0]!r} twice (ranks {shared[1]} and {shared[2]})")
        group_pieces(parsed)   # pieces that do not tile their tensor: CheckpointFormatError, nothing installed
        out[name] = parsed
    return out


def _meta(m: dict) -> TensorMeta:
    if not isinstance(m, dict):
        raise ValueError(f"tensor entry {m!r} is not an object")
    keys = ("name", "dtype", "shape", "nbytes", "itemsize", "base", "base_offset")
    if set(m) - {"box"} != set(keys):
        raise ValueError(f"tensor entry {m!r} needs exactly the fields {list(keys)} (and 'box' for a piece)")
    return tensor_meta(*(m[k] for k in keys), m.get("box"), where=f"tensor entry {m.get('name')!r}")


def check_count(v, what: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"metas: {what} must be an integer >= {lo}, got {v!r}")
    return v


def tensor_meta(name, dtype, shape, nbytes, itemsize, base, offset, box=None, *, where: str) -> TensorMeta:
    """The one validation of a tensor's metas, whatever document or exchange brought them.

    Checks every field's type, the dtype code against its itemsize (a code this build does not
    carry, or ``F16`` with 4 bytes per element, would hand the engine views of the wrong type),
    and ``shape x itemsize == nbytes``. 0-byte tensors are valid. ``box``: a piece's
    ``[global_shape, offsets]`` (whether the pieces tile is ``pieces.group_pieces``' check). Raises
    ``ConfigError``.
    """
    if not isinstance(name, str) or not name or not isinstance(dtype, str) or not isinstance(shape, (list, tuple)):
        raise ConfigError(f"metas: {where} has a bad name, dtype or shape: {[name, dtype, shape]!r}")
    dims = tuple(check_count(d, f"{where} ({name}) shape") for d in shape)
    nbytes, itemsize = check_count(nbytes, f"{name} nbytes"), check_count(itemsize, f"{name} itemsize", 1)
    known = WIRE_DTYPES.get(dtype)
    if known is None or known.itemsize != itemsize:
        raise ConfigError(f"metas: tensor {name!r} has dtype code {dtype!r} with itemsize {itemsize}, "
                          "which this build does not carry")
    if math.prod(dims) * itemsize != nbytes:
        raise ConfigError(f"metas: tensor {name!r}: {nbytes} bytes do not match shape {list(dims)} "
                          f"x {itemsize} bytes per element")
    return TensorMeta(name, dtype, dims, nbytes, itemsize, check_count(base, f"{name} region"),
                      check_count(offset, f"{name} offset"), None if box is None else _box(name, box, len(dims)))


def _box(name: str, box, ndim: int) -> tuple:
    if not isinstance(box, (list, tuple)) or len(box) != 2 or not all(isinstance(b, (list, tuple)) for b in box) \
            or len(box[0]) != ndim or len(box[1]) != ndim:
        raise ConfigError(f"metas: the piece of tensor {name!r} has a bad box {box!r}: "
                          f"want [global shape, offsets] of {ndim} dimensions each")
    return (tuple(check_count(d, f"{name} global shape") for d in box[0]),
            tuple(check_count(o, f"{name} piece offset") for o in box[1]))


def meta_row(m: TensorMeta) -> list:
    """A tensor's metas as one JSON row (``tensor_meta(*row)`` reads it back)."""
    row = [m.name, m.dtype, list(m.shape), m.nbytes, m.itemsize, m.base, m.base_offset]
    return row if m.box is None else row + [[list(m.box[0]), list(m.box[1])]]


class UpdateAgreement:
    """The ParameterServer's first exchange of an update: every rank's pre-checks and layout.

    A mixin of :class:`ParameterServer` (it uses its settings, backend, metas, checkpoints,
    plan cache and collectives), kept here with the rest of the pre-check machinery.
    """

    def _precheck(self, name, req_func, timeout) -> tuple[float, RegisteredCheckpoint | None, list | None]:
        """This rank's own checks of a broadcast update (no collective): (deadline, checkpoint, problem).

        The problem is not raised here but sent in the first exchange, so that every rank
        raises it (``_agree_plan``) and none is left waiting in a collective.
        """
        deadline, problem = self._precheck_call(req_func, timeout)
        if problem is not None:
            return deadline, None, problem
        try:
            return deadline, self._own_share(name), None
        except CkptError as exc:
            return deadline, None, problem_of(exc)

    def _precheck_call(self, req_func, timeout) -> tuple[float, list | None]:
        """The checks every update makes, broadcast or P2P: (deadline, problem), nothing raised.

        With a bad ``timeout`` the deadline is ``PS_COLLECTIVE_TIMEOUT_S`` away: long enough
        for the first exchange, which tells every rank the problem.
        """
        try:
            deadline = time.monotonic() + update_seconds(timeout)
        except ConfigError as exc:
            return time.monotonic() + self.settings.collective_timeout_s, problem_of(exc)
        if not callable(req_func):
            return deadline, problem_of(ConfigError(f"req_func must be callable, got {type(req_func).__name__}"))
        return deadline, None

    def _own_share(self, name) -> RegisteredCheckpoint:
        """The checkpoint this rank sends from; a rank that loaded metas giving it nothing gets an empty one."""
        if not isinstance(name, str):
            raise ConfigError(f"checkpoint name must be a string, got {name!r}")
        ckpt, metas = self._checkpoints.get(name), self._metas.get(name)
        if metas is None:
            if ckpt is None:
                raise CheckpointNotFoundError(f"checkpoint {name!r} is not registered on rank {self.rank}")
            raise ConfigError(f"call gather_metas({name!r}) on every rank before update({name!r})")
        mine = metas[self.rank]
        if ckpt is None:
            if mine:
                raise CheckpointNotFoundError(f"checkpoint {name!r} is not registered on rank {self.rank}, "
                                              f"whose metas list {len(mine)} tensors for it")
            return RegisteredCheckpoint(name, [], {})
        if mine is not ckpt.metas and list(mine) != list(ckpt.metas):
            raise ConfigError(f"the metas of {name!r} for rank {self.rank} do not describe the checkpoint "
                              f"registered there; call gather_metas({name!r}) on every rank again")
        return ckpt

    def _agree_plan(self, name: str, problem: list | None, slices=None) -> tuple[Plan, int, tuple[str, str]]:
        """All ranks agree on (bucket size, slots) from their free memory, then plan (cached).

        The same exchange carries every rank's pre-check problem: if any rank has one, every
        rank raises it. Returns the plan, the slots to use and the plan's wire form (JSON, digest).
        """
        view = {"problem": problem}
        if problem is None:
            try:
                view = self._layout_view(name)
            except Exception as exc:   # ours or not: told to every rank, none is left waiting
                view = {"problem": problem_of(exc)}
        # the update's identity: ranks naming two checkpoints of one layout would send a mix of both
        view.update(name=name if isinstance(name, str) else repr(name), wire=self.wire)
        view["slices"] = None if slices is None else slices.digest
        views = self._coll.all_gather_json(view)
        raise_agreed([v.get("problem") for v in views], f"update({name!r})")
        same_kind(views, f"update({name!r})")
        same_call(views, "update", IDENTITY)
        metas, fp = self._metas[name], view["fp"]
        if len({v["fp"] for v in views}) != 1:
            raise ConfigError(f"ranks disagree on the metas of {name!r}: call gather_metas on every rank again")
        if len({v["slices"] for v in views}) != 1:
            raise ConfigError(f"ranks disagree on the slice plan of update({name!r}): "
                              f"{[v['slices'] for v in views]} (give every rank the same plan, or none)")
        size, slots = min(v["bucket"] for v in views), min(v["slots"] for v in views)
        plan, wire = self._plans.get(metas, fp, size, slices=slices, rank=self.rank)
        return plan, max(1, min(slots, len(plan.buckets))), wire

    def _layout_view(self, name: str) -> dict:
        """This rank's metas digest and the (bucket size, slots) its free memory allows."""
        metas = self._metas[name]
        free = self.backend.mem_get_info(self.device_index)[0] + (self._ipc.nbytes if self._ipc else 0)
        digest = self._plans.digest(name, metas)
        largest, owner_total = self._plans.sizes(metas, digest)
        size, slots = choose_layout(
            free, mem_fraction=self.settings.mem_fraction, max_slots=self.settings.num_slots,
            max_bucket_bytes=self.settings.max_bucket_bytes, largest_tensor=largest, largest_owner_total=owner_total)
        return {"fp": digest, "bucket": size, "slots": slots}


