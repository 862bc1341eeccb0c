"""The simulated engine worker of the update benchmark, and the "engine front" rank 0 drives.

One worker process per PS rank, on the same device. It preallocates one
parameter per checkpoint tensor and, when told to update, calls
``ckpt_core.update_weights_from_ipc`` with a ``run`` that copies every received
tensor into its parameter (what an engine's ``load_weights`` does). It answers
two peers: its own PS rank over a Pipe (allocate, zero, checksum, free, stop)
and rank 0's ``req_func`` over a ``multiprocessing`` connection (update), whose
address every rank publishes with ``all_gather_object``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener, wait

AUTH = b"ckpt-bench"
CTX = mp.get_context("spawn")


# ---------------------------------------------------------------------------------------- worker process
class _Engine:
    def __init__(self, kind: str, index: int):
        import torch
        import zmq

        from ckpt_core import local_device_key
        self.torch, self.kind, self.index = torch, kind, index
        if kind == "cuda":
            torch.cuda.set_device(index)
        self.device = torch.device(kind, index) if kind != "cpu" else torch.device("cpu")
        self.key = local_device_key(kind, index)
        self.zmq_ctx = zmq.Context()
        self.params: dict = {}
        self.slices = None   # (plan digest, engine rank) this worker loads by, as a vLLM worker does; None: whole
        # how run() copies a bucket into the parameters: "tensor" (one copy_ each, as engines' loaders do) or
        # "foreach" (torch._foreach_copy_ per dtype: an engine that batches, so our own per-tensor cost shows)
        self.copy_mode = "tensor"
        # every update goes through the project's delta receiver: a full update makes its version held, a
        # delta of it is scattered into the live parameters and digest-checked (update_bench --delta-density)
        from ckpt_core.delta.apply import DeltaReceiver
        self.rx = DeltaReceiver(live=lambda name: self.params.get(name))

    def sync(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.synchronize(self.index)

    def alloc(self, specs) -> int:
        self.free()
        self.rx.held = None
        self.params = {n: self.torch.empty(shape, dtype=dtype, device=self.device) for n, shape, dtype in specs}
        self.sync()
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def zero(self) -> None:
        self.rx.held = None   # the parameters no longer hold any version
        for p in self.params.values():
            p.zero_()
        self.sync()

    def checksum(self) -> dict:
        from _bench_cases import checksums
        return checksums(self.params)

    def free(self) -> None:
        from _bench_cases import free_weight_cache
        self.params = {}
        free_weight_cache()
        gc.collect()
        if self.kind == "cuda":
            self.torch.cuda.empty_cache()

    def update(self, handles: dict, stage: bool = False, profile: str | None = None,
               version: str | None = None) -> dict:
        from _bench_profile import profiled
        if stage:
            self.rx.held = None   # staged updates bypass the receiver: what they make live is not tracked
            return self.stage(handles)
        with profiled(profile, cuda=self.kind == "cuda"):
            return self._update(handles, version)

    def _update(self, handles: dict, version: str | None = None) -> dict:
        from ckpt_core import update_weights_from_ipc
        seen: set[str] = set()
        buckets = [0]
        engine_cpu = [0.0]   # this thread's CPU time inside run(): the engine's own work, not ours

        def run(weights) -> None:
            c0 = time.thread_time()
            batched: dict = {}   # --engine-copy foreach: dtype -> (parameters, received)
            for name, t in weights:
                p = self.params.get(name)
                if p is None:
                    raise KeyError(f"received tensor {name!r} that the engine does not have")
                if name in seen:
                    raise ValueError(f"received tensor {name!r} twice in one update")
                if p.shape != t.shape or p.dtype != t.dtype:
                    raise ValueError(f"{name}: received {t.dtype}{tuple(t.shape)}, "
                                     f"parameter is {p.dtype}{tuple(p.shape)}")
                if self.copy_mode == "foreach":
                    dst, src = batched.setdefault(p.dtype, ([], []))
                    dst.append(p)
                    src.append(t)
                else:
                    p.copy_(t)
                seen.add(name)
            for dst, src in batched.values():   # one list per dtype: a mixed list takes torch's per-tensor route
                self.torch._foreach_copy_(dst, src)
            engine_cpu[0] += time.thread_time() - c0

        def post_hook() -> None:
            if tx.delta is not None:   # a delta: the receiver applied and checked it (changed tensors only)
                self.sync()
                return
            if len(seen) != len(self.params):
                missing = sorted(set(self.params) - seen)
                raise ValueError(f"{len(missing)} parameters were not updated, e.g. {missing[:3]}")
            self.sync()

        def counted(weights):   # every bucket, a delta's (the receiver's apply) and a full update's
            buckets[0] += 1
            return tx.run(weights)

        t0, c0 = time.perf_counter(), time.thread_time()
        with self.rx.update(run=run, post_hook=post_hook, version=version, pipelined=True) as tx:
            update_weights_from_ipc(self.zmq_ctx, handles[self.key], self.index, run=counted, on_plan=tx.on_plan,
                                    post_hook=tx.post_hook, slices=self.slices)
        self.sync()
        # CPU seconds of this thread: the whole call (the receive loop, ours) and inside run() (the engine's)
        out = {"seconds": time.perf_counter() - t0, "buckets": buckets[0], "tensors": len(seen),
               "cpu_s": time.thread_time() - c0, "engine_cpu_s": engine_cpu[0]}
        if self.rx.last.get("delta"):
            out["delta"] = {k: v for k, v in self.rx.last.items() if k != "scattered_tensors"}
        return out

    def stage(self, handles: dict) -> dict:
        """Receive the update into a staging area on the device (what ckpt_vllm's worker does), not
        into the parameters; :meth:`commit` then copies it in."""
        from ckpt_core import update_weights_from_ipc
        from ckpt_core.wire.staging import StagingArea

        self.staged = StagingArea("bench", self.device, device_limit=1 << 50)
        t0 = time.perf_counter()
        update_weights_from_ipc(self.zmq_ctx, handles[self.key], self.index, run=self.staged.add, slices=self.slices)
        return {"seconds": time.perf_counter() - t0, "buckets": len(self.staged.buckets),
                "tensors": self.staged.tensors, "staged_bytes": self.staged.nbytes}

    def commit(self) -> dict:
        """Staged -> live: one batched device-to-device copy (the simulated engine has no reload step)."""
        area = getattr(self, "staged", None)
        if area is None:
            raise ValueError("nothing is staged")
        pairs = [(self.params[n], t) for bucket in area.buckets for n, t in bucket]
        if len(pairs) != len(self.params):
            raise ValueError(f"{len(self.params) - len(pairs)} parameters were not staged")
        by_dtype: dict = {}   # one list per dtype: a mixed list takes the per-tensor (slow) route
        for p, t in pairs:
            dst, src = by_dtype.setdefault(p.dtype, ([], []))
            dst.append(p)
            src.append(t)
        self.sync()
        t0 = time.perf_counter()
        for dst, src in by_dtype.values():
            self.torch._foreach_copy_(dst, src)
        self.sync()
        seconds = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        area.free()
        self.staged = None
        if self.kind == "cuda":
            self.torch.cuda.empty_cache()
        return {"seconds": seconds, "bytes": nbytes, "tensors": len(pairs)}

    def handle(self, cmd: tuple):
        op = cmd[0]
        if op == "alloc":
            return self.alloc(cmd[1])
        if op == "zero":
            return self.zero()
        if op == "checksum":
            return self.checksum()
        if op == "free":
            return self.free()
        if op == "update":
            return self.update(cmd[1], *cmd[2:])
        if op == "commit":
            return self.commit()
        if op == "slices":
            self.slices = cmd[1]
            return None
        if op == "copy_mode":
            self.copy_mode = cmd[1]
            return None
        raise ValueError(f"unknown command {op!r}")


def worker_main(kind: str, index: int, conn, parent_pid: int) -> None:
    listener = Listener(("127.0.0.1", 0), authkey=AUTH)
    fronts: list = []
    threading.Thread(target=lambda: fronts.append(listener.accept()), daemon=True).start()
    try:
        engine = _Engine(kind, index)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", listener.address))
    while True:
        ready = wait([conn] + fronts, timeout=1.0)
        if os.getppid() != parent_pid:
            return  # our PS rank died: do not linger on the device
        for c in ready:
            try:
                cmd = c.recv()
            except (EOFError, OSError):
                if c is conn:
                    return
                fronts.remove(c)
                continue
            if cmd[0] == "stop":
                c.send(("ok", None))
                return
            if cmd[0] == "connected":
                c.send(("ok", bool(fronts)))
                continue
            try:
                c.send(("ok", engine.handle(cmd)))
            except Exception:
                c.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------------------------- PS-side handles
class EngineWorker:
    """The PS rank's handle on its colocated worker process."""

    def __init__(self, kind: str, index: int, timeout: float = 600.0):
        self.index, self.timeout = index, timeout
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=worker_main, args=(kind, index, child, os.getpid()), daemon=True,
                                name=f"bench-engine-{index}")
        self.proc.start()
        child.close()
        self._address = None

    @property
    def address(self):
        """The worker's listening address; waits for the process to start (it imports torch)."""
        if self._address is None:
            self._address = self._answer("start")
        return self._address

    def _answer(self, what: str):
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"engine worker {self.index} did not answer {what!r} within {self.timeout} s")
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine worker {self.index} failed on {what!r}:\n{payload}")
        return payload

    def call(self, *cmd):
        self.conn.send(cmd)
        return self._answer(cmd[0])

    def wait_connected(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.call("connected"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not connect to engine worker {self.index}")
            time.sleep(0.05)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("stop")
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class EngineFront:
    """Rank 0's stand-in for an engine's update API: fans the handles out to every worker."""

    def __init__(self, addresses: list, timeout: float = 600.0):
        self.timeout = timeout
        self.stage = False   # the next updates stage (the workers' "commit" makes them live)
        self.profile = None  # a path prefix: the workers cProfile the next update into <prefix>-w<i>
        self.version = None  # the version the next update makes live (the workers' delta receivers hold it)
        self.conns = [Client(tuple(a) if isinstance(a, list) else a, authkey=AUTH) for a in addresses]
        self.last: list = []

    def req_func(self, handles) -> None:
        for i, c in enumerate(self.conns):
            c.send(("update", dict(handles), self.stage, None if self.profile is None else f"{self.profile}-w{i}",
                    self.version))
        results = []
        for i, c in enumerate(self.conns):
            if not c.poll(self.timeout):
                raise TimeoutError(f"engine worker of rank {i} did not finish the update within {self.timeout} s")
            results.append(c.recv())
        errors = [f"worker of rank {i}:\n{r[1]}" for i, r in enumerate(results) if r[0] != "ok"]
        if errors:
            raise RuntimeError("engine worker failed: " + "\n".join(errors))
        self.last = [r[1] for r in results]

    def close(self) -> None:
        for c in self.conns:
            c.close()
