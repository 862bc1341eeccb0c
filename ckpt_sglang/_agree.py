"""Agreement between the tensor-parallel ranks of one SGLang server, inside its scheduler processes.

Each TP rank of an SGLang server has a scheduler process of its own, and every weight call reaches
all of them in the same order: the rank-0 scheduler broadcasts each request it receives to the
others over the TP group's CPU (gloo) group, and SGLang's ``update_weights_from_tensor`` ends with
a barrier on that group (0.5.17 and 0.5.23). Our loader (``ckpt_sglang.staging.load``) runs inside
that call on every rank, so it may run collectives of its own on the same group: the same ones, in
the same order, on every rank. We open no socket of our own between the ranks.

Before a staged op changes anything, each rank publishes its status: a code and a reason (UTF-8,
at most ``REASON_BYTES``), all-gathered as one fixed-size uint8 record per rank (never a pickle).
Every rank then decides from the same list and, when any rank objects, raises the same error with
the same text (:func:`refusal`), so the client reads one outcome from every rank of one call. A rank
that never reaches the collective (hung, or failed before calling the loader) is an
``UpdateTimeoutError`` on the ranks that waited for it, after the op's timeout.

An op that writes live parameters (a load, a commit) ends with a second agreement on its outcome:
each rank's status says whether it failed after it began writing into its live parameters
(``FAILED``) or before (``UNTOUCHED``: no bucket reached SGLang's ``load_weights``, no delta was
applied, nothing was post-processed). :func:`written` tells from the whole list whether any rank may
have written (a rank that succeeded did); :func:`outcome` picks the error's tail accordingly, so every
rank reports one outcome: the engine still holds what it held, or it may hold a mix of both versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ckpt_core.errors import CheckpointFormatError, ConfigError, RemoteWorkerError, UpdateTimeoutError

__all__ = ["TpGroup", "sglang_tp_group", "refusal", "written", "outcome", "OK", "BUSY", "REFUSED", "MALFORMED",
           "FAILED", "UNTOUCHED"]

OK, BUSY, REFUSED, MALFORMED, FAILED = 0, 1, 2, 3, 4   # BUSY: a receiver still runs (nothing may change)
UNTOUCHED = 5   # an op that writes live parameters failed on this rank before it wrote any (FAILED: after, or may have)
_ERRORS = {BUSY: ConfigError, REFUSED: ConfigError, MALFORMED: CheckpointFormatError, FAILED: RemoteWorkerError,
           UNTOUCHED: RemoteWorkerError}
REASON_BYTES = 1021
_RECORD = 3 + REASON_BYTES   # code, reason length (2 bytes, big-endian), reason


@dataclass(frozen=True)
class TpGroup:
    """This rank's place in the server's TP group, and the group's CPU (gloo) process group."""

    rank: int = 0
    size: int = 1
    cpu_group: Any = None

    def gather(self, code: int, reason: str, what: str, timeout_s: float,
               timed_out: str = "this rank changed nothing") -> list[tuple[int, str]]:
        """Every rank's ``(code, reason)``, in TP-rank order; the same list on every rank. ``timed_out``:
        what the ``UpdateTimeoutError`` says this rank did when the others did not arrive in time."""
        if self.size == 1:
            return [(code, reason)]
        import torch
        import torch.distributed as dist

        data = reason.encode()[:REASON_BYTES]
        record = torch.zeros(_RECORD, dtype=torch.uint8)
        record[:3] = torch.tensor([code, len(data) >> 8, len(data) & 0xFF], dtype=torch.uint8)
        if data:
            record[3:3 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        records = [torch.empty_like(record) for _ in range(self.size)]
        work = dist.all_gather(records, record, group=self.cpu_group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:   # gloo: "Operation timed out!"
            raise UpdateTimeoutError(f"TP rank {self.rank}: the other TP ranks of this server did not reach {what} "
                                     f"within {timeout_s:g} s; {timed_out}") from exc
        out = []
        for r in records:
            raw = bytes(r.numpy())
            n = (raw[1] << 8) | raw[2]
            out.append((raw[0], raw[3:3 + n].decode(errors="replace")))
        return out


def sglang_tp_group() -> TpGroup:
    """The TP group of the SGLang scheduler this runs in (``parallel_state.get_tp_group()``, the same
    name in 0.5.17 and 0.5.23); a group of one outside SGLang. The loader checks its size against the
    server's ``tp_size`` (sent by the client), so a group not found where there is one is refused."""
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        size = int(group.world_size)
        return TpGroup(int(group.rank_in_group), size, group.cpu_group if size > 1 else None)
    except Exception:   # noqa: BLE001 - not inside an SGLang scheduler with its groups set up
        return TpGroup()


def refusal(statuses: list[tuple[int, str]], head: str, tail: str) -> Exception | None:
    """The error every rank raises when any rank's status is not ``OK`` (None when all are): the type
    of the first objecting rank's code, and one text built from the whole list, so that it reads the
    same on every rank. Ranks with the same reason are named together."""
    objecting = [(rank, code, why) for rank, (code, why) in enumerate(statuses) if code != OK]
    if not objecting:
        return None
    if len(statuses) == 1:
        text = head + objecting[0][2]
    else:
        by_reason: dict[str, list[int]] = {}
        for rank, _code, why in objecting:
            by_reason.setdefault(why, []).append(rank)
        text = head + "; ".join(f"{why} on TP rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                                for why, ranks in by_reason.items()) + f" (of {len(statuses)})"
    return _ERRORS[objecting[0][1]](text + tail)


def written(statuses: list[tuple[int, str]]) -> bool:
    """Whether any rank may have written into its live parameters during an op whose end the ranks
    agree on: every rank but one that reports ``UNTOUCHED`` (a rank that succeeded wrote)."""
    return any(code != UNTOUCHED for code, _ in statuses)


def outcome(statuses: list[tuple[int, str]], head: str, untouched: str, mixed: str) -> Exception | None:
    """:func:`refusal` of an op's end: ``untouched`` ends the text when no rank wrote anything
    (:func:`written`), ``mixed`` when any may have. Decided from the whole list: the same on every rank."""
    return refusal(statuses, head, mixed if written(statuses) else untouched)
