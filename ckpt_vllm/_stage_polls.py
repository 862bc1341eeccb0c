"""The requester's side of a staged update: poll the workers' stage threads until every one is
done, and prepare the staged weights a few layers per call. One implementation for every
requester: ``VllmClient`` (HTTP ``/collective_rpc``), an offline ``vllm.LLM`` (its own
``collective_rpc``: the benchmark, the GPU tests).

``rpc(method, args, kwargs)`` returns the reply of every worker, in order.
"""

from __future__ import annotations

import time
from typing import Callable

from ckpt_core.errors import RemoteWorkerError, UpdateTimeoutError

Rpc = Callable[[str, list, dict], list]


def wait_staged(rpc: Rpc, version: str, timeout: float, *, where: str = "the engine", poll_s: float = 0.02,
                give_up: Callable[[Exception], None] | None = None) -> list[dict]:
    """Every worker's stage result once all are ``done``. A worker's failure is a
    ``RemoteWorkerError``; no stage finished within ``timeout`` seconds, an
    ``UpdateTimeoutError``: for both, ``give_up(error)`` runs first (the client drops the stage).
    A stage that vanished from a worker (dropped, or replaced by another) is a ``RemoteWorkerError``."""
    deadline = time.monotonic() + timeout
    while True:
        states = rpc("ckpt_stage_status", [], {})
        if states and all(s.get("state") == "done" for s in states):
            return states
        failed = [(i, s) for i, s in enumerate(states) if s.get("state") == "failed"]
        lost = [i for i, s in enumerate(states) if s.get("state") == "none"]
        exc: Exception | None = None
        if failed:
            exc = RemoteWorkerError(f"{where}: the stage of {version!r} failed on worker(s) {[i for i, _ in failed]}: "
                                    f"{failed[0][1].get('error_type')}: {failed[0][1].get('error')}; "
                                    "nothing live changed")
        elif lost or not states:
            raise RemoteWorkerError(f"{where}: the stage of {version!r} vanished from worker(s) {lost} "
                                    "(dropped, or replaced by another stage)")
        elif time.monotonic() > deadline:
            exc = UpdateTimeoutError(f"{where} did not finish staging {version!r} within {timeout:g} s; "
                                     "the stage was dropped")
        if exc is not None:
            if give_up is not None:
                give_up(exc)
            raise exc
        time.sleep(poll_s)


def prepare_staged(rpc: Rpc, version: str, step_bytes: int, timeout: float, *, where: str = "the engine",
                   each_step: Callable[[list[dict]], None] | None = None) -> tuple[list[dict], int]:
    """Call ``ckpt_prepare_staged`` (about ``step_bytes`` of layers per call) until no worker is
    ``preparing``; returns the last states and the number of calls. ``each_step(states)`` runs
    after every call that left work to do. Past ``timeout`` seconds an ``UpdateTimeoutError``
    (the version stays staged; its commit then reloads)."""
    deadline = time.monotonic() + timeout
    calls = 0
    while True:
        states = rpc("ckpt_prepare_staged", [version], {"budget_bytes": int(step_bytes)})
        calls += 1
        if all(s.get("state") != "preparing" for s in states):
            return states, calls
        if each_step is not None:
            each_step(states)
        if time.monotonic() > deadline:
            raise UpdateTimeoutError(f"{where} did not finish preparing {version!r} within {timeout:g} s "
                                     "(it stays staged; its commit reloads)")


def llm_rpc(llm) -> Rpc:
    """``rpc`` over an offline ``vllm.LLM`` (its ``collective_rpc`` in this process)."""
    return lambda method, args, kwargs: llm.collective_rpc(method, args=tuple(args), kwargs=kwargs)
