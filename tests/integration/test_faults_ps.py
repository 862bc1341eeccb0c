"""Fault injection on the parameter-server side: a PS rank killed or frozen in the middle of an update.

The surviving rank must fail with a typed error within the collective timeout
(PS_COLLECTIVE_TIMEOUT_S, set small in the PS processes), the engine workers must
leave their receive loop (not wait for their own long timeout), and a new PS world
must then update the same engine processes with exactly the new weights.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness import EngineFront, FreshCheckpoints, PsWorld, report_case

BUCKET_BYTES = 16 << 10
COLLECTIVE_TIMEOUT_S = 4.0
WORKER_TIMEOUT_S = 60.0          # long on purpose: workers must leave because they notice, not time out
INIT = {"max_bucket_gb": BUCKET_BYTES / (1 << 30)}
ENV = {"PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}


@pytest.fixture(scope="module")
def front():
    f = EngineFront("cpu", 2)
    yield f
    f.close()


def start_slow_update(ps: PsWorld, front: EngineFront, name: str, marks, *, timeout: float):
    """Both engines take 0.3 s per bucket; returns once worker 0 is inside bucket 1 (mid-pipeline)."""
    slow = {i: {"sleep_s": 0.3, "mark_dir": str(marks), "timeout": WORKER_TIMEOUT_S} for i in range(ps.size)}
    ps.send("update", (name, front.address, timeout, slow))
    deadline = time.monotonic() + 30
    while not (marks / "w0-b1").exists():
        assert time.monotonic() < deadline, "the update never reached bucket 1"
        time.sleep(0.01)


def ipc_prefix(ps: PsWorld) -> str:
    return ps.all("ipc_prefix", ranks=[0])[0].value


def assert_only_the_dead_ranks_buffer_is_left(prefix: str, dead: int) -> None:
    """The survivor released its IPC buffer; a SIGKILLed rank cannot unlink its own: remove it here."""
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    for n in left:
        os.unlink(f"/dev/shm/{n}")
    assert all(n.startswith(f"{prefix}{dead}-") for n in left), f"a surviving rank leaked its IPC buffer: {left}"


def assert_engines_left_and_a_new_world_delivers(front: EngineFront, seed: int, kind: str = "cpu") -> None:
    t0 = time.monotonic()
    for i in range(2):
        assert front.stats(i)["mapped"] == [], f"engine worker {i} still maps the dead world's buffer"
    assert time.monotonic() - t0 < 10, "the engine workers stayed in the dead update"
    with PsWorld(kind, 2, init=INIT) as ps:
        ckpts = FreshCheckpoints(ps, seed=seed)
        name, want = ckpts.new("after")
        got = ps.update(name, front, 30)
        assert all(o.ok for o in got.values()), got
        for i in range(2):
            assert front.digests(i) == want, f"engine worker {i} does not hold exactly the new weights"


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-store-host"])
def test_a_ps_rank_killed_mid_update_fails_the_survivor_in_time_with_a_typed_error(front, victim, tmp_path):
    prefix = kill_a_ps_rank_mid_update("cpu", front, victim, tmp_path)
    assert_only_the_dead_ranks_buffer_is_left(prefix, victim)
    assert_engines_left_and_a_new_world_delivers(front, seed=80 + victim)


def kill_a_ps_rank_mid_update(kind: str, front: EngineFront, victim: int, marks) -> str:
    """SIGKILL PS rank ``victim`` while both engines are mid-pipeline; check the survivor's error and
    time; returns the world's IPC buffer prefix."""
    survivor = 1 - victim
    with PsWorld(kind, 2, init=INIT, env=ENV) as ps:
        name, _ = FreshCheckpoints(ps, seed=70 + victim).new("doomed")
        prefix = ipc_prefix(ps)
        start_slow_update(ps, front, name, marks, timeout=30)
        ps.kill(victim)
        t_kill = time.monotonic()
        got = ps.collect(ranks=[survivor], timeout=60)[survivor]
        dt = time.monotonic() - t_kill
        assert not got.ok and got.error in ("TransportError", "UpdateTimeoutError"), got
        assert f"rank {survivor}" in got.message and "die" in got.message, got
        assert dt < COLLECTIVE_TIMEOUT_S + 3, f"survivor took {dt:.1f} s (collective timeout {COLLECTIVE_TIMEOUT_S} s)"
        report_case(f"PS rank {victim} SIGKILLed mid-update ({kind})", f"{got.error} on rank {survivor}: "
                    f"{got.message.splitlines()[0][:90]}", dt)
        # its process groups are gone: a further update says so at once instead of hanging
        again = ps.all("update", (name, None, 10, None), ranks=[survivor], timeout=30)[survivor]
        assert not again.ok and again.error == "TransportError" and "broke in an earlier update" in again.message, again
        # the survivor's ParameterServer still closes cleanly
        assert ps.all("close", ranks=[survivor])[survivor].ok
    return prefix


def test_a_frozen_ps_rank_fails_the_survivor_within_the_collective_timeout(front, tmp_path):
    prefix = freeze_a_ps_rank_mid_update("cpu", front, tmp_path)
    assert_only_the_dead_ranks_buffer_is_left(prefix, 1)
    assert_engines_left_and_a_new_world_delivers(front, seed=91)


def freeze_a_ps_rank_mid_update(kind: str, front: EngineFront, marks) -> str:
    """SIGSTOP PS rank 1 mid-pipeline (alive but silent: only a timeout can tell), then kill it."""
    with PsWorld(kind, 2, init=INIT, env=ENV) as ps:
        name, _ = FreshCheckpoints(ps, seed=90).new("frozen")
        prefix = ipc_prefix(ps)
        start_slow_update(ps, front, name, marks, timeout=15)
        os.kill(ps.pids[1], signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            got = ps.collect(ranks=[0], timeout=60)[0]
            dt = time.monotonic() - t_stop
        finally:
            ps.kill(1)
        assert not got.ok and got.error == "UpdateTimeoutError", got
        assert "PS_COLLECTIVE_TIMEOUT_S" in got.message or "control group" in got.message, got
        report_case(f"PS rank 1 frozen (SIGSTOP) mid-update ({kind})", f"{got.error} on rank 0", dt)
        assert dt < COLLECTIVE_TIMEOUT_S + 4, f"survivor took {dt:.1f} s (collective timeout {COLLECTIVE_TIMEOUT_S} s)"
    return prefix


def _kill_a_world_that_keeps_its_buffers(front: EngineFront, seed: int) -> str:
    """A world with keep_device_buffers: after one update both ranks and workers hold the buffer;
    then both PS processes are SIGKILLed. Returns the /dev/shm prefix of their buffers."""
    with PsWorld("cpu", 2, init=dict(INIT, keep_device_buffers=True), env=ENV) as ps:
        name, want = FreshCheckpoints(ps, seed=seed).new("kept")
        got = ps.update(name, front, 30)
        assert all(o.ok for o in got.values()) and all(front.digests(i) == want for i in range(2)), got
        prefix = ipc_prefix(ps)
        assert len([n for n in os.listdir("/dev/shm") if n.startswith(prefix)]) == 2
        assert all(len(front.stats(i)["mapped"]) == 1 for i in range(2))
        ps.kill(0)
        ps.kill(1)
    return prefix


def test_engines_drop_the_kept_buffer_of_a_dead_ps_when_the_next_one_maps_its_own(front):
    prefix = _kill_a_world_that_keeps_its_buffers(front, seed=95)
    try:
        with PsWorld("cpu", 2, init=dict(INIT, keep_device_buffers=True)) as ps:
            name, want = FreshCheckpoints(ps, seed=96).new("next")
            got = ps.update(name, front, 30)
            assert all(o.ok for o in got.values()) and all(front.digests(i) == want for i in range(2)), got
            new_prefix = ipc_prefix(ps)
            for i in range(2):
                mapped = front.stats(i)["mapped"]
                assert len(mapped) == 1 and new_prefix in mapped[0], f"engine worker {i} maps {mapped}"
        report_case("PS world with kept buffers SIGKILLed, next world updates",
                    "engines map only the new buffer (the dead one's memory is let go)", None)
    finally:
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink(f"/dev/shm/{n}")


def test_the_shm_buffer_of_a_killed_ps_is_reclaimed_by_the_next_ps_on_the_host(front):
    prefix = _kill_a_world_that_keeps_its_buffers(front, seed=97)
    try:
        with PsWorld("cpu", 2, init=INIT) as ps:
            name, want = FreshCheckpoints(ps, seed=98).new("next")
            got = ps.update(name, front, 30)              # allocates a buffer: the moment to sweep
            assert all(o.ok for o in got.values()), got
        left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        assert left == [], f"orphaned IPC buffers of SIGKILLed PS ranks: {left}"
    finally:
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink(f"/dev/shm/{n}")
