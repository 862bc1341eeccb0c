"""Requests back to back while a test updates the engine: the traffic of the staged and traffic tests.

One thread, whatever the engine: ``request(on_token)`` sends one request and calls ``on_token(t)``
for each token that comes (``t``: when, on the clock the test compares with; a vLLM stream stamps
each chunk as it arrives, SGLang's test engine reports its own decode times).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

Request = Callable[[Callable[[float], None]], None]


class Traffic(threading.Thread):
    """Sends ``request`` back to back until ``stop`` is set; keeps every token's time (``stamps``)
    and each failed request's error (``failures``).

    ``running`` is set while a request is generating (a token of it came), ``seq`` numbers the
    requests and ``done`` counts those that ended well: an update that starts and ends within one
    ``seq`` while ``running`` is set ran under traffic. ``quiet()`` holds the traffic between two
    requests until ``resume()``. As a context manager it starts, waits for the first token (at most
    ``first_token_s``), and on exit stops and joins (at most ``join_s``).
    """

    def __init__(self, request: Request, *, first_token_s: float = 120.0, join_s: float = 130.0):
        super().__init__(daemon=True, name="traffic")
        self.request, self.first_token_s, self.join_s = request, first_token_s, join_s
        self.stop, self.hold, self.idle, self.running = (threading.Event() for _ in range(4))
        self.stamps: list[float] = []
        self.failures: list[str] = []
        self.seq = self.done = 0

    def run(self) -> None:
        while not self.stop.is_set():
            if self.hold.is_set():
                self.idle.set()
                self.stop.wait(0.05)
                continue
            self.idle.clear()
            self.seq += 1
            try:
                self.request(self._token)
                self.done += 1
            except Exception as exc:   # noqa: BLE001 - reported by the test
                self.failures.append(f"{type(exc).__name__}: {exc}")
            finally:
                self.running.clear()

    def _token(self, t: float) -> None:
        self.stamps.append(t)
        self.running.set()

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(t0 <= s <= t1 for s in list(self.stamps))

    def quiet(self) -> None:
        """Hold the traffic once its current request has finished."""
        self.hold.set()
        assert self.idle.wait(120), "the traffic's last request did not finish"

    def resume(self) -> None:
        self.hold.clear()

    def __enter__(self) -> Traffic:
        self.start()
        deadline = time.time() + self.first_token_s
        while not self.stamps and time.time() < deadline:
            time.sleep(0.05)
        assert self.stamps, "the traffic never produced a token"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(self.join_s)
