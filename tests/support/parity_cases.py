"""Drop-in parity with checkpoint-engine: the reference's test scenario, written by us, shared by the
CPU integration test and the GPU test (same code, other device kind).

Shape of the reference's own update test: every PS rank runs in its own process with its own
engine worker process beside it, and every rank's ``req_func`` is ``inbox.put``: it hands the
handles to *its own* worker. So an update works only if ``req_func`` runs on every rank.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
import traceback

import torch

from ckpt_core.checkpoint.safetensors import write_file
from support.data import FAULT_DTYPES, digest, fresh_tensor
from support.e2e_cases import ShmDir
from support.engine import queue_worker_main
from support.procs import CTX, run_world

WORKER_RESULT_S = 120.0   # generous: how long a PS rank waits for its worker's report
HANG_TIMEOUT_S = 10.0     # the update timeout that must bound a req_func that never returns
STALL_TIMEOUT_S = 30.0    # stall1's: rank 0's worker, whose req_func returns, must connect within it even on a
                          # loaded 2-core host (at 10 s it sometimes did not: rank 0 timed out too, first)
LATE_TIMEOUT_S, LATE_S = 5.0, 9.0   # late1: rank 1 calls update LATE_S after rank 0, whose timeout is shorter


# ---------------------------------------------------------------- data
def random_tensors(rng: random.Random, gen: torch.Generator, rank: int, n: int) -> dict[str, torch.Tensor]:
    """``n`` tensors with random names, random shapes (1 to 3 dims) and the four dtypes."""
    out = {}
    for i in range(n):
        shape = tuple(rng.randint(1, 48) for _ in range(rng.randint(1, 3)))
        out[f"r{rank}.{rng.getrandbits(40):010x}.{i}"] = fresh_tensor(shape, FAULT_DTYPES[rng.randrange(4)], gen)
    return out


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Share:
    """One rank's share of one checkpoint: a disk file, a /dev/shm file and named tensors, with
    byte-identical duplicates across the three (the reference's files test registers such)."""

    def __init__(self, rng, gen, rank: int, ckpt: str, tmp_dir, shm: ShmDir):
        disk = random_tensors(rng, gen, rank, 7)
        dup = list(disk)
        in_shm = random_tensors(rng, gen, rank, 4) | {dup[0]: disk[dup[0]].clone(), dup[1]: disk[dup[1]].clone()}
        named = random_tensors(rng, gen, rank, 5) | {dup[1]: disk[dup[1]].clone()}
        shm_only = [n for n in in_shm if n not in disk]
        named[shm_only[0]] = in_shm[shm_only[0]].clone()
        self.disk_path = str(tmp_dir / f"{ckpt}-rank{rank}.safetensors")
        write_file(self.disk_path, disk)
        self.shm_path = shm.write(f"{ckpt}-rank{rank}.safetensors", in_shm)
        self.kwargs = {"files": [self.disk_path, self.shm_path], "named_tensors": named}
        self.tensors = disk | in_shm | named
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.file_digests = {p: file_digest(p) for p in (self.disk_path, self.shm_path)}


# ---------------------------------------------------------------- PS rank process
def _req_func(mode: str, rank: int, inbox, release: threading.Event):
    """The req_func of one rank: puts the handles into its own worker's inbox (the reference's
    ``queue.put``); ``mode`` injects a req_func fault on rank 1."""
    def req_func(handles):
        if mode == "raise1" and rank == 1:
            raise RuntimeError("injected: rank 1's req_func failed")
        if mode == "stall1" and rank == 1:   # stuck before it reached the engine
            release.wait(600)
            return
        inbox.put(handles)
        if mode == "hang1" and rank == 1:
            release.wait(600)
    return req_func


def _update(ps, rank: int, inbox, outbox, name: str, mode: str, timeout: float) -> tuple:
    if mode == "fail0" and rank == 0:
        inbox.put({"fail_bucket": 1})
    if mode == "late1" and rank == 0:   # its worker connects after the PS gave up: it need not wait long
        inbox.put({"timeout": 10})
    if mode == "late1" and rank == 1:
        time.sleep(LATE_S)
    release = threading.Event()
    try:
        info = ps.update(name, _req_func(mode, rank, inbox, release), timeout=timeout)
        result = ("ok", {"bytes": info["bytes"], "buckets": info["buckets"]})
    except Exception as exc:
        result = ("error", type(exc).__name__, str(exc), getattr(exc, "rank", None))
    release.set()
    puts = not (mode in ("raise1", "stall1") and rank == 1)
    worker = outbox.get(timeout=WORKER_RESULT_S) if puts else None
    return result + (worker,)


def parity_ps_main(rank: int, world: int, port: int, kind: str, steps: list, init: dict, out, barrier) -> None:
    """One PS rank with its own engine worker process; runs ``steps``, reports each outcome. The
    ranks start each update together (``barrier``): a rank still collecting its worker's answer to
    the last update must not spend the next one's timeout of the others (late1 does that on purpose)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from ckpt_core import ParameterServer
    inbox, outbox = CTX.Queue(), CTX.Queue()
    worker = CTX.Process(target=queue_worker_main, args=(kind, rank, inbox, outbox), daemon=True)
    worker.start()
    results: list = []
    try:
        ready = outbox.get(timeout=WORKER_RESULT_S)
        assert ready[0] == "ready", ready
        with ParameterServer(rank, world, device=kind, master_addr="127.0.0.1", master_port=port, **init) as ps:
            for step, name, arg in steps:
                if step == "update":
                    barrier.wait(WORKER_RESULT_S + 60)
                t0 = time.monotonic()
                if step == "register":
                    ps.register_checkpoint(name, **arg[rank])
                    results.append(("ok",))
                elif step == "gather":
                    ps.gather_metas(name)
                    results.append(("ok",))
                elif step == "update":
                    mode, timeout = arg
                    results.append(_update(ps, rank, inbox, outbox, name, mode, timeout) + (time.monotonic() - t0,))
    except Exception:
        results.append(("fatal", traceback.format_exc()))
    finally:
        inbox.put(None)
        worker.join(10)
        if worker.is_alive():
            worker.kill()
        out.put((rank, results))


def run_parity_world(kind: str, world: int, steps: list, *, init: dict | None = None,
                     timeout: float = 300) -> dict[int, list]:
    """``world`` PS rank processes (not daemons: each starts its own worker) running ``steps``."""
    # held here for the whole run: Process.start() drops its args, and a barrier collected before a rank
    # unpickled it is gone (its named semaphore unlinked). A world started again reuses it untouched: its
    # ranks wait on it only after their ParameterServer was built, which the first world's never was.
    barrier = CTX.Barrier(world)

    def ranks(port: int):
        q = CTX.Queue()
        return [CTX.Process(target=parity_ps_main, args=(r, world, port, kind, steps, dict(init or {}), q, barrier))
                for r in range(world)], q

    return run_world(ranks, "parity world", timeout, join_s=10)


# ---------------------------------------------------------------- cases
def case_reference_scenario(kind: str, world: int, tmp_path, *, seed: int = 20261130) -> dict[int, list]:
    """Three broadcast updates of three checkpoints (mixed sources with duplicates) on one PS,
    every rank's req_func feeding its own worker; then rank 0's worker fails: every rank must
    fail naming rank 0; then a retry delivers."""
    rng, gen, shm = random.Random(seed), torch.Generator().manual_seed(seed), ShmDir()
    try:
        shares = {c: {r: Share(rng, gen, r, c, tmp_path, shm) for r in range(world)} for c in ("c0", "c1", "c2")}
        steps = []
        for c in shares:
            steps += [("register", c, {r: s.kwargs for r, s in shares[c].items()}), ("gather", c, None),
                      ("update", c, ("all", 60))]
        steps += [("update", "c2", ("fail0", 60)), ("update", "c2", ("all", 60))]
        res = run_parity_world(kind, world, steps, init={"max_bucket_gb": 0.00002})
        for r in range(world):
            assert len(res[r]) == len(steps) and all(x[0] != "fatal" for x in res[r]), f"rank {r}: {res[r]}"
        for k, c in enumerate(shares):
            want = {n: digest(t) for s in shares[c].values() for n, t in s.tensors.items()}
            for r in range(world):
                upd = res[r][3 * k + 2]
                assert upd[0] == "ok", f"update of {c} on rank {r}: {upd}"
                assert upd[1]["buckets"] > 1, "the case must span several buckets"
                assert upd[1]["bytes"] == sum(s.nbytes for s in shares[c].values()), "duplicates registered once"
                assert upd[2][0] == "ok" and upd[2][2] == want, f"worker of rank {r} after {c}: {upd[2][:2]}"
        for r in range(world):
            failed = res[r][9]
            assert failed[:2] == ("error", "RemoteWorkerError") and failed[3] == 0, f"rank {r}: {failed}"
            assert "injected engine failure at bucket 1" in failed[2], failed[2]
            worker = failed[4]
            assert worker[0] == "error", f"worker of rank {r} should have left the failed update: {worker}"
            retry = res[r][10]
            assert retry[0] == "ok" and retry[2][2] == {n: digest(t) for s in shares["c2"].values()
                                                        for n, t in s.tensors.items()}, f"retry on rank {r}"
        for s in (s for per in shares.values() for s in per.values()):
            assert {p: file_digest(p) for p in s.file_digests} == s.file_digests, "source files changed"
        return res
    finally:
        shm.close()


def case_req_func_faults_on_rank_1(kind: str) -> dict[int, list]:
    """2 ranks. raise1: rank 1's req_func raises (rank 0's worker is mid-update); hang1: it never
    returns; stall1: it never returns and never reached the engine (whichever wait expires first,
    req_func is named); late1: rank 1 calls update after rank 0's timeout passed (rank 0 fails
    before its handshake whatever its worker answers, with the note that its time went in the first
    exchange)."""
    gen = torch.Generator().manual_seed(7)
    data = {r: {f"w{r}.{i}": fresh_tensor((64, 8), torch.bfloat16, gen) for i in range(4)} for r in range(2)}
    steps = [("register", "c", {r: {"named_tensors": d} for r, d in data.items()}), ("gather", "c", None),
             # raise1 and all end by themselves: their timeout only bounds them, generously (on a
             # loaded 2-core machine 30 s could pass before the handshake, and the deadline then
             # fails the wait for the worker before rank 1's req_func thread had raised)
             ("update", "c", ("raise1", 120)), ("update", "c", ("hang1", HANG_TIMEOUT_S)),
             ("update", "c", ("stall1", STALL_TIMEOUT_S)), ("update", "c", ("all", 120)),
             ("update", "c", ("late1", LATE_TIMEOUT_S)), ("update", "c", ("all", 120))]
    res = run_parity_world(kind, 2, steps, init={"max_bucket_gb": 0.00002})
    for r in range(2):
        raised, hung, stalled, after, late, again = res[r][2:8]
        assert raised[:2] == ("error", "RemoteWorkerError") and raised[3] == 1, f"rank {r}: {raised}"
        assert "rank 1: req_func raised" in raised[2] and "injected: rank 1's req_func failed" in raised[2]
        assert hung[:2] == ("error", "UpdateTimeoutError"), f"rank {r}: {hung}"
        assert "[rank 1] req_func did not return within the update timeout" in hung[2], hung[2]
        assert hung[5] < HANG_TIMEOUT_S + 60, "the hang is bounded by the update timeout (generous ceiling)"
        assert stalled[:2] == ("error", "UpdateTimeoutError"), f"rank {r}: {stalled}"
        assert "[rank 1] req_func did not return within the update timeout" in stalled[2], stalled[2]
        assert "never connected" in stalled[2] and "to connect" in stalled[2], stalled[2]
        assert after[0] == "ok" and len(after[2][2]) == 8, f"the next update on rank {r}: {after}"
        assert late[:2] == ("error", "UpdateTimeoutError"), f"rank {r}: {late}"
        assert late[2].startswith("[rank 0] timed out before the handshake"), late[2]
        assert "before the handshake" in late[2] and "another rank called update() late" in late[2], late[2]
        assert again[0] == "ok" and len(again[2][2]) == 8, f"the update after late1 on rank {r}: {again}"
    assert res[0][2][4][0] == "error", "rank 0's worker must leave the update rank 1 failed"
    return res
