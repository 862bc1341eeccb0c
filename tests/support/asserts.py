"""Assertions and reports of the fault tests: every rank failed alike, the healthy engine workers
left a failed update holding exactly what they held, and one row of the fault table."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from support.engine import EngineFront


def assert_every_rank_failed(got: dict, error: str, *needles: str) -> dict:
    """Every rank's outcome is the exception class ``error`` with each needle in its message."""
    for r, o in got.items():
        assert not o.ok and o.error == error, f"rank {r} should have failed with {error}: {o}"
        for needle in needles:
            assert needle in o.message, f"rank {r}: {needle!r} not in {o.message!r}"
    return got


def assert_healthy_workers_aborted(front: EngineFront, since: int, before: dict[int, dict], *,
                                   failing: tuple[int, ...] = ()) -> None:
    """After a failed update: every worker not in ``failing`` raised RemoteWorkerError from
    ``update_weights_from_ipc`` (the PS aborted it) and still holds exactly the weights it held
    before (``before``: worker -> digests); no worker committed anything of the failed update."""
    outcomes = front.worker_outcomes(since)
    for i, (status, text) in enumerate(outcomes):
        if i in failing:
            assert status == "error", f"the failing worker {i} reported success: {text}"
            continue
        assert status == "error" and "RemoteWorkerError" in str(text), \
            f"healthy worker {i} did not raise RemoteWorkerError: {status} {str(text)[-800:]}"
    for i in range(len(outcomes)):
        if front.procs[i].is_alive():
            assert front.digests(i) == before[i], f"engine worker {i} changed its weights in a failed update"


def report_case(case: str, outcome: str, seconds: float | None) -> None:
    """One row of the fault table: printed (pytest -s shows it) and appended to
    $CKPT_FAULT_TABLE when set, so the figures can be collected for the issue note."""
    sec = "-" if seconds is None else f"{seconds:.2f}"
    line = f"FAULT | {case} | {outcome} | {sec}"
    print(line, flush=True)
    path = os.environ.get("CKPT_FAULT_TABLE")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
