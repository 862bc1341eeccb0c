"""What a vLLM worker's failed update or commit leaves live (``ckpt_vllm._live``), without vLLM: the
worker extension's own state after ``settle`` on one worker, and on two real processes agreeing over a
real gloo group as the workers of one TP-2 engine do over vLLM's CPU group; the flag the reload session
sets before it first hands a bucket to vLLM's loader. The real engine: tests/integration/test_vllm_live.py."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch

from ckpt_core.delta.apply import DeltaReceiver
from ckpt_core.errors import CheckpointFormatError, TransportError
from ckpt_vllm._delta import _undo_unfinished
from ckpt_vllm._live import MIXED, settle, untouched
from ckpt_vllm._reload import LiveWrites, ReloadSession
from ckpt_vllm.worker import VllmColocateWorkerExtension
from support.ports import free_port
from support.procs import leave_gloo_world


class Worker(VllmColocateWorkerExtension):
    """The extension as vLLM mixes it in, with the fields these paths read."""

    def __init__(self, live: str | None = "v1", since: float = 100.0):
        self.model_runner = SimpleNamespace(reset_mm_cache=self._reset)
        self.resets = 0
        self._ckpt_live_version, self._ckpt_live_since, self._ckpt_live_layout = live, since, {"w": ("float32", (2,))}
        self._ckpt_delta_rx = DeltaReceiver(live=lambda name: None, held=live)

    def _reset(self) -> None:
        self.resets += 1


def _run(worker, fail: Exception | None, write: bool):
    """An update as the plain path runs it under ``settle``: the held base dropped first, then (``write``)
    a bucket handed to the loader, then ``fail`` raised, or the new version made live."""
    def op(writes: LiveWrites):
        worker._ckpt_drop_held()
        if write:
            writes.mark()
        if fail is not None:
            raise fail
        worker._ckpt_made_live({}, "v2")
        return {"tensors": 3}
    return settle(worker, "the update", op)


def test_a_failure_before_any_write_keeps_the_live_version_its_time_and_the_delta_base():
    worker = Worker()
    with pytest.raises(TransportError) as err:
        _run(worker, TransportError("the PS went away before the first bucket"), write=False)
    assert str(err.value) == "the PS went away before the first bucket" + untouched("v1")
    assert str(err.value).endswith("nothing was loaded on any worker: the engine still holds version 'v1'")
    assert worker.ckpt_weight_versions()["live"] == "v1" and worker._ckpt_live_since == 100.0
    assert worker.ckpt_weight_versions()["mixed"] is False
    assert worker._ckpt_delta_rx.held == "v1", "the base a delta applies to was dropped though nothing was written"
    assert worker.resets == 0


def test_a_failure_after_a_write_leaves_no_version_live_and_no_delta_base():
    worker = Worker()
    with pytest.raises(CheckpointFormatError) as err:
        _run(worker, CheckpointFormatError("vLLM rejected the tensor", tensor="b"), write=True)
    assert str(err.value) == "vLLM rejected the tensor (tensor 'b')" + MIXED and err.value.tensor == "b"
    versions = worker.ckpt_weight_versions()
    assert versions["live"] is None and versions["live_since"] > 100.0 and versions["mixed"] is True
    assert worker._ckpt_delta_rx.held is None and worker.resets == 1


def test_a_success_makes_its_version_live_and_a_failure_with_nothing_live_says_so():
    worker = Worker()
    assert _run(worker, None, write=True) == {"tensors": 3}
    assert worker.ckpt_weight_versions()["live"] == "v2" and worker.ckpt_weight_versions()["mixed"] is False
    fresh = Worker(live=None)
    with pytest.raises(TransportError, match=r"the engine still holds the weights it held \(no version of ours"):
        _run(fresh, TransportError("refused at the plan"), write=False)
    assert fresh.ckpt_weight_versions()["live"] is None and fresh.ckpt_weight_versions()["mixed"] is False


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        for _ in weights:
            raise RuntimeError("the loader failed")


def test_the_reload_session_marks_its_writes_just_before_vllms_loader_runs():
    model, writes = _Model(), LiveWrites()
    session = ReloadSession(model, None, writes=writes)
    session.active = True   # begun (vLLM's reload mode is not needed for what is checked here)
    session.received = {"a"}
    with pytest.raises(CheckpointFormatError, match="sends a again"):   # refused before the loader
        session.load([("a", torch.ones(2))])
    assert not writes.wrote and model.calls == 0
    with pytest.raises(CheckpointFormatError, match="the loader failed"):
        session.load([("b", torch.ones(2))])
    assert writes.wrote and model.calls == 1


def test_a_delta_whose_undo_did_not_finish_counts_as_written():
    writes = LiveWrites()
    _undo_unfinished(SimpleNamespace(delta=("v1", "v2"), undo_log=[]), writes)   # undone whole
    _undo_unfinished(SimpleNamespace(delta=None, undo_log=[object()]), writes)    # a full update's
    _undo_unfinished(None, writes)                                                # failed before it began
    assert not writes.wrote
    _undo_unfinished(SimpleNamespace(delta=("v1", "v2"), undo_log=[object()]), writes)
    assert writes.wrote


# -- two workers of one engine ---------------------------------------------------------------
CASES = {   # case: (worker 0's (failure, wrote), worker 1's)
    "none wrote": ((True, False), (True, False)),
    "one wrote, the other succeeded": ((True, True), (False, True)),
    "the other wrote": ((True, False), (True, True)),
    "one failed untouched, the other succeeded": ((True, False), (False, True)),
}


def _worker_process(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    import ckpt_vllm._sessions as sessions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sessions._world_group = lambda: SimpleNamespace(cpu_group=dist.group.WORLD, world_size=2, rank_in_group=rank)
    for case, plans in CASES.items():
        fails, write = plans[rank]
        worker = Worker()
        try:
            answer = sessions.answer_together("the update", lambda: _run(
                worker, TransportError(f"worker {rank} failed") if fails else None, write))
            kind, text = "returned", str(answer.get("refused", "")) if isinstance(answer, dict) else ""
        except Exception as exc:   # noqa: BLE001 - reported to the test
            kind, text = type(exc).__name__, str(exc)
        out.put((rank, case, kind, text, worker.ckpt_weight_versions()["live"], worker._ckpt_delta_rx.held))
    leave_gloo_world(out)


def test_the_workers_of_one_engine_agree_on_what_it_holds():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker_process, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(2 * len(CASES)):
        rank, case, kind, text, live, held = out.get(timeout=120)
        got[rank, case] = (kind, text, live, held)
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    # nobody wrote: both keep v1 (and its delta base); the last worker raises, the other returns the refusal
    for rank in (0, 1):
        kind, text, live, held = got[rank, "none wrote"]
        assert (live, held) == ("v1", "v1") and text.startswith("worker 0 failed" + untouched("v1")), got
    assert got[1, "none wrote"][0] == "TransportError" and got[0, "none wrote"][0] == "returned"
    # any worker wrote (one that succeeded did): neither reports a version live, nor holds a delta base
    for case in ("one wrote, the other succeeded", "the other wrote", "one failed untouched, the other succeeded"):
        for rank in (0, 1):
            kind, text, live, held = got[rank, case]
            assert (live, held) == (None, None), (case, rank, got[rank, case])
            assert text.startswith("worker 0 failed" + MIXED), (case, rank, text)
