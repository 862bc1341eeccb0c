"""What an update or commit of a vLLM worker that failed leaves live, agreed by every worker of the engine.

Each worker of one engine holds its own shard of the model: a version is live only when every worker
holds it whole. An op that can write into the live model (a plain, direct or delta update, a commit)
runs under :func:`settle`, which hands it a :class:`~ckpt_vllm._reload.LiveWrites` flag: the op's
reload sessions mark it just before they first hand a bucket to vLLM's loader or run vLLM's finalize,
a direct update before its first copy, a prepared commit before its copy, a delta before its reload of
the changed layers (its scatters are undone on failure; a delta whose undo could not finish marks it).

At the op's end every worker counts, over the engine's workers (one all-reduce of two numbers), the
workers that failed and those that wrote (a worker that succeeded wrote). With no failure nothing more
happens. With one:

- no worker wrote: the engine holds what it held. Every worker keeps its live version, its
  ``live_since`` and the delta base it held (a plain update that found nothing to load keeps it too);
  the failing worker's error ends with ``nothing was loaded on any worker: the engine still holds
  version '<v>'``.
- any worker wrote: some parameters may hold the new version. Every worker, the ones that succeeded
  included, reports no live version (``live`` None, ``live_since`` the time it was found), holds no
  delta base (a delta is refused until a full update), and drops the caches derived from the
  weights; the error ends with ``the model may hold a mix of both versions: push a full update``.

So after every op all workers answer ``ckpt_weight_versions`` with the same ``live``; the engine's
live version is the one every worker reports, None when any reports None (``VllmClient.live_version``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

from ._reload import LiveWrites
from ._sessions import counts_over_workers

__all__ = ["settle", "untouched", "MIXED"]

log = logging.getLogger("ckpt_vllm")
T = TypeVar("T")
MIXED = "; the model may hold a mix of both versions: push a full update"


def untouched(live: str | None) -> str:
    """The tail of a failed op's error when no worker of the engine wrote into its live model."""
    if live is None:
        return ("; nothing was loaded on any worker: the engine still holds the weights it held "
                "(no version of ours was live)")
    return f"; nothing was loaded on any worker: the engine still holds version {live!r}"


def settle(worker: Any, what: str, op: Callable[[LiveWrites], T]) -> T:
    """Run ``op`` (an update or commit of ``worker``; ``what`` names it in the log), then settle what the
    engine holds with every worker (see the module doc): returns ``op``'s result, or raises its error
    with the outcome added. Every worker of the engine must call it for the same op."""
    writes = LiveWrites()
    rx = getattr(worker, "_ckpt_delta_rx", None)
    held = None if rx is None else rx.held   # the delta base before the op (a plain update drops it first)
    try:
        result: T | None = op(writes)
        error: Exception | None = None
    except Exception as exc:   # noqa: BLE001 - raised below, with the outcome every worker agreed on
        result, error = None, exc
    failed, wrote = counts_over_workers(error is not None, error is None or writes.wrote)
    if not failed:
        return result   # type: ignore[return-value]
    if wrote:
        worker._ckpt_forget_live(mixed=True)
        tail = MIXED
        log.error("ckpt: %s failed on %d worker(s) after %s began writing into the live model: it may hold "
                  "a mix of both versions, no version is live; push a full update", what, failed,
                  "this worker" if writes.wrote or error is None else "another worker")
    else:
        rx = getattr(worker, "_ckpt_delta_rx", None)
        if rx is not None:
            rx.held = held   # nothing was written on any worker: the base is still held whole
        tail = untouched(getattr(worker, "_ckpt_live_version", None))
        log.warning("ckpt: %s failed on %d worker(s) before any worker wrote into the live model: the engine "
                    "still holds what it held", what, failed)
    if error is None:
        return result   # type: ignore[return-value]  # another worker's failure: answered by answer_together
    error.args = (f"{error}{tail}",)
    raise error
