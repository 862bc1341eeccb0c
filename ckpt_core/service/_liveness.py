"""Peer liveness of one rank's service: heartbeats through the world's rendezvous store.

Without it, a rank whose peer died stays healthy until its next collective fails (up to
``PS_COLLECTIVE_TIMEOUT_S`` later), and a collective posted to one rank only waits in silence.
Each rank's service runs one daemon thread that, every ``beat_s`` seconds, writes
``ckpt/live/{rank}`` = ``{"beat": n, "running": [operation, checkpoint] or null}`` into the
rendezvous store (rank 0's TCPStore, over its own client connection so that it never queues
behind the collectives' store waits) and reads every peer's key. Ages are measured on this
host's monotonic clock from the last time a peer's ``beat`` changed, so clocks need not agree.

- :meth:`Liveness.problem` (``/v1/healthz`` 503, ``ckpt_healthy`` 0): a peer whose beat has not
  changed for ``timeout_s``, or a store that has not answered for ``timeout_s`` (rank 0, which
  serves it, is gone); while the store fails, only its silence counts (the beats come through it).
- a collective (gather, update) that has run here for ``timeout_s`` while a peer runs something
  else is logged once at WARNING, naming the ranks, and shown as ``running.waiting_for`` in
  ``/v1/status``, until the peers join or the operation ends.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

from ckpt_core.ops.log import rank_logger

from ._state import COLLECTIVE

KEY = "ckpt/live/{rank}"


class Liveness:
    """Owns the heartbeat thread of one rank; ``close()`` is idempotent."""

    def __init__(self, state, rank: int, world_size: int, host: str, port: int, *, beat_s: float,
                 timeout_s: float, clock=time.monotonic):
        self.state, self.rank, self.world_size = state, rank, world_size
        self.where, self.beat_s, self.timeout_s, self.clock = f"{host}:{port}", beat_s, timeout_s, clock
        self.log = rank_logger(f"service rank {rank}/{world_size}")
        self._host, self._port = host, port
        self._store = None
        self._store_error: str | None = None
        # A short store timeout: an op must fail (and be retried) rather than block the thread for long.
        self._store_timeout_s = max(0.5, min(5.0, timeout_s / 2))
        now = clock()
        self._seen = {r: (None, now, None) for r in range(world_size) if r != rank}   # beat, when it changed, running
        self._store_ok = now
        self._warned: tuple | None = None   # the operation a "waiting" warning was logged for
        self._beat = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ckpt-liveness-r{rank}", daemon=True)

    def start(self) -> "Liveness":
        """Connect (here, once: rank 0's store is up, the PS has just used it) and start beating. Never
        reconnected from the thread: a connection attempt retries for longer than any bounded wait at
        exit, and once rank 0 is gone the world is over anyway."""
        try:
            self._store = self._connect()
        except Exception as exc:
            self._store_error = f"cannot connect: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            self.log.warning("phase=serve no peer heartbeats: the rendezvous store at %s: %s", self.where,
                             self._store_error)
            return self
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and wait for it (bounded by one store timeout): a daemon thread still inside a
        store call when the interpreter exits aborts the process (C++ ``terminate``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self._store_timeout_s + self.beat_s + 1.0)

    # -- what the service asks -----------------------------------------------------------------
    def problem(self) -> str | None:
        """Why this rank cannot work with its peers, or None."""
        now = self.clock()
        with self._lock:
            if now - self._store_ok > self.timeout_s:
                return (f"the rendezvous store at {self.where} (served by rank 0) has not answered for "
                        f"{now - self._store_ok:.1f} s ({self._store_error}): rank 0 is gone or unreachable; "
                        "restart this world")
            if self._store_error is not None:
                # The beats are heard through the store: while it fails, a peer's age says nothing of the
                # peer (when rank 0 dies its last beats may be older than the store's last answer, and its
                # silence would be blamed on it rather than on the store it served); the store's own
                # silence above decides, within the same timeout.
                return None
            silent = sorted(r for r, (_, t, _) in self._seen.items() if now - t > self.timeout_s)
            if silent:
                return (f"rank(s) {silent} sent no heartbeat for more than {self.timeout_s:g} s: dead or "
                        "unreachable; restart this world")
        return None

    def peers(self) -> dict[str, dict]:
        """rank -> {"age_s": seconds since its beat changed, "running": what it runs} (for /v1/status)."""
        now = self.clock()
        with self._lock:
            return {str(r): {"age_s": round(now - t, 3), "running": running}
                    for r, (_, t, running) in sorted(self._seen.items())}

    # -- the thread ----------------------------------------------------------------------------
    def _connect(self):
        import torch.distributed as dist
        return dist.TCPStore(self._host, self._port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=self._store_timeout_s))

    def _loop(self) -> None:
        # While the store fails, try it only every timeout_s: each failure makes torch log a stack.
        while not self._stop.wait(self.beat_s if self._store_error is None else self.timeout_s):
            try:
                self._exchange(self._store)
            except Exception as exc:   # the store is gone or slow: counted by age (problem())
                with self._lock:
                    self._store_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            self._check_waiting()
        self._store = None

    def _exchange(self, store) -> None:
        running = self.state.snapshot()
        mine = [running["operation"], running.get("checkpoint")] if running else None
        self._beat += 1
        store.set(KEY.format(rank=self.rank), json.dumps({"beat": self._beat, "running": mine}))
        keys = {r: KEY.format(rank=r) for r in self._seen}
        present = [r for r, k in keys.items() if store.check([k])]
        values = {r: json.loads(store.get(keys[r])) for r in present}
        now = self.clock()
        with self._lock:
            self._store_ok, self._store_error = now, None
            for r, doc in values.items():
                beat, changed, _ = self._seen[r]
                self._seen[r] = (doc.get("beat"), now if doc.get("beat") != beat else changed, doc.get("running"))

    def _check_waiting(self) -> None:
        """A collective running here for ``timeout_s`` while peers run something else: say so, once."""
        running = self.state.snapshot()
        if not running or running["operation"] not in COLLECTIVE:
            self._warned = None
            return
        want = [running["operation"], running.get("checkpoint")]
        with self._lock:
            missing = sorted(r for r, (_, _, theirs) in self._seen.items() if theirs != want)
        if running["elapsed_s"] < self.timeout_s:
            return
        self.state.set_waiting(missing or None)
        key = (running["operation"], running.get("checkpoint"), running["started_unix"])
        if missing and self._warned != key:
            self._warned = key
            self.log.warning("phase=%s checkpoint=%s waiting for rank(s) %s, whose service was not asked for "
                             "this %s (a collective: post it to every rank's service); %.1f s so far",
                             running["operation"], running.get("checkpoint"), missing, running["operation"],
                             running["elapsed_s"])
