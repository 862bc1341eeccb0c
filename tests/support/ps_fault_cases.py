"""PS-side fault cases shared by the CPU integration tests and the GPU tests (same code, other device kind).

A PS rank is killed or frozen while both engines are mid-pipeline; the survivor must fail with a
typed error within the collective timeout (PS_COLLECTIVE_TIMEOUT_S, set small in the PS
processes), the engine workers must leave the dead update, and a new PS world must then update
the same engine processes with exactly the new weights.
"""

from __future__ import annotations

import os
import signal
import time

from support.asserts import report_case
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld

BUCKET_BYTES = 16 << 10
COLLECTIVE_TIMEOUT_S = 4.0
WORKER_TIMEOUT_S = 60.0          # long on purpose: workers must leave because they notice, not time out
INIT = {"max_bucket_gb": BUCKET_BYTES / (1 << 30)}
ENV = {"PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}


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


def assert_engines_left_and_a_new_world_delivers(front: EngineFront, seed: int, kind: str = "cpu") -> None:
    t0 = time.monotonic()
    for i in range(2):
        assert front.stats(i)["mapped"] == [], f"engine worker {i} still maps the dead world's buffer"
    # before their own WORKER_TIMEOUT_S: they left because they noticed, not because they timed out
    assert time.monotonic() - t0 < WORKER_TIMEOUT_S, "the engine workers stayed in the dead update"
    with PsWorld(kind, 2, init=INIT) as ps:
        ckpts = FreshCheckpoints(ps, seed=seed)
        name, want = ckpts.new("after")
        got = ps.update(name, front, 30)
        assert all(o.ok for o in got.values()), got
        for i in range(2):
            assert front.digests(i) == want, f"engine worker {i} does not hold exactly the new weights"


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
        # ordering, not seconds: the survivor failed on the dead peer, before its own 30 s update deadline
        assert dt < 30, f"survivor took {dt:.1f} s: it waited for its update deadline, not the peer's death"
        report_case(f"PS rank {victim} SIGKILLed mid-update ({kind})", f"{got.error} on rank {survivor}: "
                    f"{got.message.splitlines()[0][:90]}", dt)
        # its process groups are gone: a further update says so at once instead of hanging
        again = ps.all("update", (name, None, 10, None), ranks=[survivor], timeout=30)[survivor]
        assert not again.ok and again.error == "TransportError" and "broke in an earlier update" in again.message, again
        # the survivor's ParameterServer still closes cleanly
        assert ps.all("close", ranks=[survivor])[survivor].ok
    return prefix


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
        # the message names the collective timeout: it came first, before the 15 s update deadline
        assert dt < 15 + 5, f"survivor took {dt:.1f} s: past its update deadline"
    return prefix


# -- process groups a ParameterServer creates inside a caller's default group (issue 14, defect 5) ----
def _group_census_main(rank: int, world: int, port: int, kind: str, n: int, mode: str, q, p2p=None) -> None:
    """A trainer-like process: it owns the default group; ``n`` ParameterServers come and go in it.
    ``p2p``: the engine front's address; each ParameterServer then does a P2P update into rank 1."""
    import gc

    import torch
    import torch.distributed as dist
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        if kind == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from ckpt_core import ParameterServer

        def census() -> dict:
            gc.collect()   # what a reference cycle holds is freed by the collector, not leaked
            out = {"groups": len(dist.distributed_c10d._world.pg_map), "fds": len(os.listdir("/proc/self/fd"))}
            if kind == "cuda":
                out["device_free"] = torch.cuda.mem_get_info(rank)[0]
            return out

        def one():
            ps = ParameterServer(rank, world, device=kind, auto_pg=False)
            if p2p is not None:   # a P2P update creates its target group: it must go with close() too
                p2p_update_once(ps, rank, p2p)
            # a broadcast, as every update does: on CUDA it creates the NCCL communicator
            ps._coll.broadcast(torch.ones(4, device=ps.backend.device(ps.device_index)), 0, async_op=False)
            if mode == "abort":   # what update() does after a broken collective
                ps._coll.abort()
            ps.close()
            return ps             # a closed PS the caller still holds must hold no group

        kept = one()              # lazy one-time allocations
        before = census()
        for _ in range(n):
            kept = one()
        after = census()
        del kept
        dist.barrier()                    # the caller's own default group still works
        dist.destroy_process_group()
        q.put((rank, {"before": before, "after": after}))
    except Exception:
        import traceback
        q.put((rank, {"error": traceback.format_exc()}))


def p2p_update_once(ps, rank: int, address: str) -> None:
    """Register fresh random tensors, gather, and P2P-update the engine worker of rank 1 from every rank."""
    import torch

    from support.engine import make_req_func
    gen = torch.Generator().manual_seed(rank)
    ps.register_checkpoint("census", named_tensors={f"r{rank}.w{i}": torch.randn(4096, generator=gen)
                                                    for i in range(4)})
    ps.gather_metas("census")
    ps.update("census", make_req_func(address) if rank == 1 else (lambda handles: None), ranks=[1], timeout=60)


def assert_census_clean(got: dict[int, dict], *, device_slack: int | None = None) -> None:
    """What ``group_census`` saw: every rank ends with the process groups it began with, at most
    4 more fds and, with ``device_slack``, no less free device memory than that below the start."""
    for r, c in got.items():
        before, after = c["before"], c["after"]
        assert after["groups"] == before["groups"], f"rank {r} leaked process groups: {c}"
        assert after["fds"] <= before["fds"] + 4, f"rank {r} leaked descriptors: {c}"
        if device_slack is not None:
            assert after["device_free"] >= before["device_free"] - device_slack, f"rank {r} leaked device memory: {c}"


def group_census(kind: str, n: int, mode: str, world: int = 2, p2p: str | None = None) -> dict[int, dict]:
    """Each rank's process-group count and open fds before and after ``n`` ParameterServers were
    created in (and closed or aborted out of) a default group the caller initialised; with ``p2p``
    (an engine front serving rank 1's worker), each did a P2P update into rank 1 first."""
    from support.procs import CTX, run_world

    def ranks(port: int):
        q = CTX.Queue()
        return [CTX.Process(target=_group_census_main, args=(r, world, port, kind, n, mode, q, p2p), daemon=True)
                for r in range(world)], q

    out = run_world(ranks, "group census world", 300, join_s=10)
    assert all("error" not in v for v in out.values()), out
    return out


# -- close() or unregister_checkpoint() while an update runs (issue 14, defect 4) --------------------
def act_mid_update(ps: PsWorld, front: EngineFront, name: str, marks, action_rank: int, action: str,
                   ranks: list[int] | None = None) -> dict:
    """The engines take 0.3 s per bucket; ``action`` ("close" or "unregister") runs on ``action_rank``
    once the front's first worker is inside bucket 1. ``ranks``: a P2P update into those ranks.
    Returns each rank's {"update", "action", "order"}."""
    mark = str(marks / f"w{front.devices[0]}-b1")   # a worker marks files with its device index
    slow = {i: {"sleep_s": 0.3, "mark_dir": str(marks), "timeout": WORKER_TIMEOUT_S} for i in range(len(front.procs))}
    args = {r: (name, front.address, 30, slow, mark, action if r == action_rank else None, ranks)
            for r in range(ps.size)}
    got = ps.collect(ps.send("act_during_update", per_rank=args), timeout=120)
    assert all(o.ok for o in got.values()), got
    return {r: o.value for r, o in got.items()}


def close_a_rank_mid_update(kind: str, front: EngineFront, marks, world: int = 2) -> None:
    """The last rank is closed mid-update: its update and every other rank's fail naming it and
    close(); close() returns only after the update left; the engines aborted (they keep the
    previous weights)."""
    victim = world - 1
    with PsWorld(kind, world, init=INIT, env=ENV) as ps:
        ckpts = FreshCheckpoints(ps, seed=44)
        first, want = ckpts.new("before")
        assert all(o.ok for o in ps.update(first, front, 30).values())
        name, _ = ckpts.new("closing")
        got = act_mid_update(ps, front, name, marks, victim, "close")
        assert got[victim]["action"] == "ok" and got[victim]["order"] == ["update ended", "close returned"], got
        for r in range(world):
            assert got[r]["update"].startswith("RemoteWorkerError"), got
            assert f"[rank {victim}]" in got[r]["update"] and "close() was called" in got[r]["update"], got
        for i in range(world):
            held = front.digests(i)
            assert {n: held.get(n) for n in want} == want, f"engine worker {i} committed a failed update"
        again = ps.all("update", (name, None, 10, None), ranks=[victim])[victim]
        assert not again.ok and again.error == "ClosedError", again
        report_case(f"close() on rank {victim} mid-update ({kind}, {world} ranks)",
                    f"RemoteWorkerError [rank {victim}] close() on every rank; "
                    "freed after the update left", None)


def update_refused_by_precheck(ps, rank, name, address, timeout, refuse_on):
    """An update whose req_func on rank ``refuse_on`` carries a ``precheck`` that refuses (as
    ``SglangClient.req_func`` does for a model its server cannot reload); rank 0 posts to the engines."""
    from ckpt_core.errors import ConfigError
    from support.engine import make_req_func

    inner = make_req_func(address) if rank == 0 else (lambda h: None)

    def req_func(handles):
        return inner(handles)
    if rank == refuse_on:
        def precheck():
            raise ConfigError("this engine cannot load the checkpoint in place (injected)")
        req_func.precheck = precheck
    return ps.update(name, req_func, timeout=timeout)
