"""A verl world of real processes for the ckpt backend's tests: T trainer processes (the actor
group) and R rollout processes (one replica: verl's CheckpointEngineWorker each), all under
``CKPT_VERL_PYTHON``, driven the way verl's ``CheckpointEngineManager.update_weights`` drives them:
prepare on every worker, ``build_topology`` (verl's registry looks the class up), init_process_group
on every worker with its slice of the topology, then send/receive at once, then finalize.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from support.ports import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
START_S = 240.0   # importing torch, transformers and verl in several processes at once on 2 cores


@dataclass
class Reply:
    ok: bool
    value: object = None
    error: str | None = None
    message: str = ""
    mro: tuple = ()
    seconds: float = 0.0
    traceback: str = ""

    def typed(self) -> bool:
        """A failure typed by ckpt_core's hierarchy (what every side must answer)."""
        return not self.ok and "CkptError" in self.mro


class Proc:
    """One worker process; JSON lines in, ``@@ {json}`` lines out (its other output goes to a log)."""

    def __init__(self, side: str, rank: int, world: int, port: int, env: dict, log: Path):
        self.side, self.rank = side, rank
        full = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO),
                    PS_P2P_HOST="127.0.0.1", NCCL_IB_DISABLE="1", VERL_USE_EXTERNAL_PLUGINS="none", **env)
        self.log = log
        self.p = subprocess.Popen([os.environ["CKPT_VERL_PYTHON"], str(HERE / "worker.py"), side], env=full,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "ab"),
                                  text=True, bufsize=1)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith("@@ "):
                self._replies.put(json.loads(line[3:]))
        self._replies.put({"ok": False, "error": "ProcessExited", "message": f"{self} exited"})

    def send(self, op: str, **fields) -> None:
        self.p.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.p.stdin.flush()

    def recv(self, timeout: float) -> Reply:
        try:
            raw = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self} gave no answer within {timeout:.0f} s (log: {self.log})") from None
        return Reply(**{k: (tuple(v) if k == "mro" else v) for k, v in raw.items()})

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
                self.p.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()

    def __repr__(self) -> str:
        return f"{self.side} {self.rank} (pid {self.p.pid})"


class VerlWorld:
    def __init__(self, tmp: Path, trainers: int = 2, rollouts: int = 2, env: dict | None = None,
                 engine_kwargs: dict | None = None):
        self.tmp, self.env = tmp, dict(env or {})
        self.env["CKPT_VERL_ENGINE_KWARGS"] = json.dumps(engine_kwargs or {"timeout_s": 60})
        self.trainers: list[Proc] = []
        self.rollouts: list[Proc] = []
        self.new_trainers(trainers)
        self.new_rollouts(rollouts)
        self.step = 0

    def _start(self, side: str, n: int) -> list[Proc]:
        port = free_port()
        procs = [Proc(side, r, n, port, self.env, self.tmp / f"{side}-{r}-{port}.log") for r in range(n)]
        got = self.each(procs, "start", timeout=START_S)
        assert all(g.ok for g in got), [g.traceback or g.message for g in got]
        assert {(g.value["module"], g.value["class"]) for g in got} == {("ckpt_verl.backend", "CkptCheckpointEngine")}, got
        return procs

    def new_trainers(self, n: int) -> None:
        for p in self.trainers:
            p.stop()
        self.trainers = self._start("trainer", n)

    def new_rollouts(self, n: int) -> None:
        for p in self.rollouts:
            p.stop()
        self.rollouts = self._start("rollout", n)

    @property
    def procs(self) -> list[Proc]:
        return self.trainers + self.rollouts

    @staticmethod
    def each(procs, op: str, per: list[dict] | None = None, timeout: float = 120.0, **fields) -> list[Reply]:
        for i, p in enumerate(procs):
            p.send(op, **(per[i] if per else fields))
        with ThreadPoolExecutor(len(procs)) as pool:
            return list(pool.map(lambda p: p.recv(timeout), procs))

    def connect(self) -> None:
        """prepare -> build_topology -> init_process_group, as verl's manager runs them every update."""
        meta = self.each(self.procs, "call", method="prepare")
        assert all(m.ok for m in meta), meta
        json.dumps([m.value for m in meta])   # plain data: verl ships it between processes
        t, r = len(self.trainers), len(self.rollouts)
        self.trainers[0].send("topology", args=[t, r, [m.value for m in meta]])
        topo = self.trainers[0].recv(30)
        assert topo.ok, topo
        actor, rollout = topo.value
        per = [{"method": "init_process_group", "kwargs": {k: v[i] for k, v in actor.items()}} for i in range(t)]
        per += [{"method": "init_process_group", "kwargs": {k: v[i] for k, v in rollout.items()}} for i in range(r)]
        got = self.each(self.procs, "call", per=per, timeout=120)
        assert all(g.ok for g in got), [g.traceback or g.message for g in got]

    def start_round(self, seed: int, slow: dict | None = None, bad: str | None = None) -> None:
        self.connect()
        self.step += 1
        for p in self.trainers:
            p.send("round", kwargs={"seed": seed, "step": self.step, **({"bad": bad} if bad else {})})
        for p in self.rollouts:
            p.send("round", kwargs={"seed": seed, "step": self.step, "slow": slow})

    def finish_round(self, timeout: float = 120.0, procs: list[Proc] | None = None) -> dict[str, list[Reply]]:
        procs = self.procs if procs is None else procs
        with ThreadPoolExecutor(len(procs)) as pool:
            got = list(pool.map(lambda p: p.recv(timeout), procs))
        fin = self.each(procs, "call", method="finalize")
        assert all(f.ok for f in fin), fin
        return {"trainer": [g for p, g in zip(procs, got) if p.side == "trainer"],
                "rollout": [g for p, g in zip(procs, got) if p.side == "rollout"]}

    def round(self, seed: int, **kw) -> dict[str, list[Reply]]:
        self.start_round(seed, **kw)
        return self.finish_round()

    def close(self) -> None:
        for p in self.procs:
            p.stop()


def wait_for(path: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)


__all__ = ["VerlWorld", "Reply", "wait_for"]
