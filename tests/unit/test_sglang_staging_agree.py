"""The TP ranks of an SGLang server agree before a staged op changes anything (ckpt_sglang/_agree.py):
two real processes run ``ckpt_sglang.staging.EngineStaging``'s ops over a real gloo group, as two
scheduler processes of one server do over SGLang's TP CPU group. The whole chain through SGLang at
TP 2 is tests/integration/test_sglang_staged_tp.py."""

from __future__ import annotations

import base64
import multiprocessing as mp
import pickle
import threading
import time

import pytest
import torch

from ckpt_core.errors import ConfigError, RemoteWorkerError
from ckpt_sglang._agree import BUSY, FAILED, OK, REFUSED, UNTOUCHED, outcome, refusal, written
from ckpt_sglang._protocol import ReplySocket, encode_command
from support.ports import free_port
from support.procs import leave_gloo_world


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from ckpt_sglang._agree import TpGroup
    from ckpt_sglang.staging import EngineStaging, SglangStagingArea, _Receiver

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group, engine = TpGroup(rank, 2, dist.group.WORLD), EngineStaging()

    def outcome(case, fn, *args):
        t0 = time.monotonic()
        try:
            fn(*args)
            out.put((rank, case, "ok", "", time.monotonic() - t0))
        except Exception as exc:   # noqa: BLE001 - reported to the test
            out.put((rank, case, type(exc).__name__, str(exc), time.monotonic() - t0))

    # 1. rank 1 still receives a stage (its PS never sends: a receiver that ends only when told to stop):
    #    the drop ends it and drops what rank 0 staged, both ranks answering alike
    rx = None
    if rank == 0:
        engine.area = SglangStagingArea("v4", torch.device("cpu"))
        engine.area.sealed = True
    else:
        rx = _Receiver("v5")

        def waits_for_its_ps():
            while not rx.should_stop():
                time.sleep(0.01)

        rx.thread = threading.Thread(target=waits_for_its_ps, daemon=True)
        rx.thread.start()
        engine.receiving = rx
    outcome("drop", engine.drop, None, {"timeout": 30}, group)
    out.put((rank, "kept", None if engine.area is None else engine.area.version,
             "receiver alive" if rx is not None and rx.thread.is_alive() else "", 0.0))
    # rank 0 stages v4 again: the commit below still has something to refuse rank 1's part of
    if rank == 0:
        engine.area = SglangStagingArea("v4", torch.device("cpu"))
        engine.area.sealed = True
    dist.barrier()
    # 2. rank 1 reaches the commit long after rank 0 (hung): rank 0 gives up after half the op's timeout,
    #    having changed nothing; when rank 1 arrives the gather completes and the group goes on
    if rank == 1:
        time.sleep(6)
    outcome("late" if rank else "alone", engine.commit, None, {"weights": "v4", "timeout": 4}, group)
    out.put((rank, "kept after", None if engine.area is None else engine.area.version, "", 0.0))
    leave_gloo_world(out)   # rank 0's gather that gave up may still be a std::thread: see there


def test_a_drop_ends_a_stage_still_receiving_on_every_rank_and_a_missing_rank_is_a_timeout():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(8):
            rank, case, kind, text, seconds = out.get(timeout=120)
            got[rank, case] = (kind, text, seconds)
    finally:
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert got[0, "drop"][0] == got[1, "drop"][0] == "ok", (got[0, "drop"], got[1, "drop"])
    assert got[1, "drop"][2] < 10, "the drop waited for the receiver long after it was told to stop"
    assert got[0, "kept"][0] is None, "the drop kept rank 0's stage"
    assert got[1, "kept"][:2] == (None, ""), "rank 1's receiver still runs after the drop answered"
    kind, text, seconds = got[0, "alone"]
    assert kind == "UpdateTimeoutError" and "did not reach the commit of 'v4' within 2 s" in text, got[0, "alone"]
    assert 1.5 < seconds < 30, seconds
    assert got[0, "kept after"][0] == "v4", "a commit that timed out changed rank 0's stage"
    assert got[1, "late"][0] == "ConfigError", got[1, "late"]   # rank 1 holds nothing: its own refusal


def test_one_text_for_every_rank_names_the_ranks_by_reason_and_takes_the_first_objectors_type():
    statuses = [(OK, ""), (REFUSED, "nothing is staged"), (BUSY, "version 'a' is still being staged"),
                (REFUSED, "nothing is staged")]
    err = refusal(statuses, "cannot commit version 'b': ", "; nothing was committed on any TP rank")
    assert isinstance(err, ConfigError) and str(err) == (
        "cannot commit version 'b': nothing is staged on TP ranks 1, 3; version 'a' is still being staged on TP "
        "rank 2 (of 4); nothing was committed on any TP rank")
    assert refusal([(OK, "")] * 3, "x", "y") is None
    assert str(refusal([(REFUSED, "nothing is staged")], "cannot commit version 'b': ", "; nothing was committed")) \
        == "cannot commit version 'b': nothing is staged; nothing was committed"


UNTOUCHED_TAIL, MIXED_TAIL = "; nothing was loaded: v1 still", "; a mix: push a full update"


@pytest.mark.parametrize("statuses, mixed", [
    ([(UNTOUCHED, "gone")], False),
    ([(UNTOUCHED, "gone")] * 4, False),
    ([(FAILED, "boom")], True),
    ([(UNTOUCHED, "gone"), (UNTOUCHED, "gone"), (FAILED, "boom"), (UNTOUCHED, "gone")], True),
    ([(UNTOUCHED, "gone"), (OK, "")], True),   # the rank that succeeded loaded everything
])
def test_the_end_of_a_load_says_nothing_was_loaded_only_when_no_rank_wrote(statuses, mixed):
    assert written(statuses) is mixed
    err = outcome(statuses, "the load failed: ", UNTOUCHED_TAIL, MIXED_TAIL)
    assert isinstance(err, RemoteWorkerError)
    assert str(err).endswith(MIXED_TAIL if mixed else UNTOUCHED_TAIL), str(err)
    assert outcome([(OK, "")] * len(statuses), "x", UNTOUCHED_TAIL, MIXED_TAIL) is None


BUCKETS = [[("w1", torch.arange(6.0).reshape(3, 2))], [("w2", torch.arange(4.0))]]


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loaded: list[str] = []

    def load_weights(self, weights):
        self.loaded.extend(n for n, _ in weights)


def _load_rank(rank: int, port: int, out) -> None:
    """One TP rank's ``EngineStaging.load`` with the stock loop stood in (it fails after ``fails[rank]``
    buckets, a TransportError as a gone PS's): v1 loads on both ranks, then each case fails."""
    import torch.distributed as dist

    from ckpt_core.errors import TransportError
    from ckpt_sglang import staging
    from ckpt_sglang._agree import TpGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group, engine, key = TpGroup(rank, 2, dist.group.WORLD), staging.EngineStaging(), f"dev-{rank}"
    handles = {"dev-0": "ipc://@a", "dev-1": "ipc://@b"}
    staging._device_of = lambda model: (torch.device("cpu"), key, rank)
    fails: list = [None]

    def loop(handle, device, device_id, timeout_s, *, run, post_hook=None, side_stream=True, reply_hook_error=False):
        for i, bucket in enumerate(BUCKETS):
            if fails[0] is not None and i == fails[0][rank]:
                raise TransportError(f"the parameter server went away before bucket {i}")
            run(bucket)
        if post_hook is not None:
            post_hook()

    staging.run_stock_loop = loop
    engine.load(_Model(), {"weights": "v1", "handles": handles, "timeout": 30}, group)
    # both ranks before their first bucket; rank 0 before its first, rank 1 after one
    for case, at in (("none wrote", (0, 0)), ("one wrote", (0, 1))):
        fails[0] = at
        model = _Model()
        try:
            engine.load(model, {"weights": "v2", "handles": handles, "timeout": 30}, group)
            kind, text = "ok", ""
        except Exception as exc:   # noqa: BLE001 - reported to the test
            kind, text = type(exc).__name__, str(exc)
        out.put((rank, case, kind, text, engine.state(model, {})["live"], model.loaded))
        dist.barrier()
    leave_gloo_world(out)


def test_every_tp_rank_says_nothing_was_loaded_only_when_no_rank_wrote_and_keeps_its_live_version_then():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_load_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(4):
            rank, case, *rest = out.get(timeout=120)
            got[rank, case] = rest
    finally:
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    gone = "the load of 'v2' failed: TransportError: the parameter server went away before bucket "
    for r in (0, 1):
        untouched = gone + "0 on TP ranks 0, 1 (of 2); nothing was loaded on any TP rank: the engine still holds " \
            "version 'v1'"
        assert got[r, "none wrote"] == ["RemoteWorkerError", untouched, "v1", []], got[r, "none wrote"]
        assert got[r, "one wrote"][0] == "RemoteWorkerError" and got[r, "one wrote"][2] is None, got[r, "one wrote"]
        assert got[r, "one wrote"][1] == (gone + "0 on TP rank 0; " + gone.split(": ", 1)[1] + "1 on TP rank 1 (of "
                                          "2); the model may hold a mix of both versions: push a full update")
    assert got[0, "one wrote"][3] == [] and got[1, "one wrote"][3] == ["w1"], "the stand-in loop did not run as meant"


def test_a_loader_that_finds_fewer_tp_ranks_than_the_server_has_refuses_instead_of_acting_alone():
    """Outside SGLang the loader finds a TP group of one; a command for a TP-2 server is refused, not run."""
    import ckpt_sglang.staging as staging

    with ReplySocket() as replies:
        payload = encode_command("drop", replies.address, 2, timeout=5)[0]
        staging.load(None, pickle.loads(base64.b64decode(payload)))
        with pytest.raises(RemoteWorkerError, match="the server has tp_size 2, but this loader found a TP group of 1"):
            replies.collect("drop", 1, 10, "srv")
