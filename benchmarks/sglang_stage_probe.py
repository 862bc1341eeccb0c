"""Probe: a receiving thread beside a spinning thread, with Python's default switch interval and a lowered one.

Why: SGLang's scheduler thread spins in Python between steps. Our loader's stage receives in a
thread of that process (the stock worker loop: a ZeroMQ reply per bucket, small tensor ops), and
every time it blocks and wakes it must wait for the spinner to hand over the GIL, which a CPython
thread does only after the switch interval (5 ms by default). An H200 probe saw a 0.10 s stage take
10.6 s. ckpt_sglang/_stock_loop.py lowers the interval while a stage or a direct load receives.

This reproduces the effect without SGLang or a GPU: a child process echoes small messages (the
parameter server's side, ``--remote-ms`` per message); a thread in this process sends and waits for
each echo (many small tasks, each blocking once), first alone, then beside a spinning thread at the default interval and
at the lowered one. Runs on any CPU::

    python benchmarks/sglang_stage_probe.py [--tasks 300] [--bytes 4096] [--remote-ms 1] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import threading
import time

try:
    from ckpt_sglang._stock_loop import SWITCH_INTERVAL_S
except ImportError:   # run from a checkout without the package installed
    SWITCH_INTERVAL_S = 0.0001


def echo(conn, remote_s: float) -> None:
    """The other process: answer every message with itself after ``remote_s`` (the parameter
    server preparing the next bucket: long enough for the spinner to take the GIL), until an empty one."""
    while True:
        msg = conn.recv_bytes()
        if not msg:
            return
        if remote_s > 0:
            time.sleep(remote_s)
        conn.send_bytes(msg)


def receive(conn, tasks: int, payload: bytes) -> float:
    """``tasks`` round trips, each a little Python work and one blocking wait; the seconds taken."""
    t0 = time.perf_counter()
    for i in range(tasks):
        conn.send_bytes(payload)
        got = conn.recv_bytes()
        if len(got) != len(payload):
            raise RuntimeError(f"task {i}: {len(got)} bytes echoed, {len(payload)} sent")
    return time.perf_counter() - t0


def spin(stop: threading.Event, counter: list) -> None:
    """A scheduler's busy loop: pure Python, never blocking."""
    n = 0
    while not stop.is_set():
        n += 1
    counter.append(n)


def measure(conn, tasks: int, payload: bytes, *, spinning: bool, interval_s: float) -> dict:
    saved = sys.getswitchinterval()
    stop, counter = threading.Event(), []
    spinner = threading.Thread(target=spin, args=(stop, counter), daemon=True) if spinning else None
    sys.setswitchinterval(interval_s)
    try:
        if spinner is not None:
            spinner.start()
            time.sleep(0.05)   # the spinner holds the GIL by now
        seconds = receive(conn, tasks, payload)
    finally:
        stop.set()
        if spinner is not None:
            spinner.join(10)
        sys.setswitchinterval(saved)
    return {"spinning": spinning, "switch_interval_ms": interval_s * 1e3, "tasks": tasks, "seconds": round(seconds, 4),
            "ms_per_task": round(seconds / tasks * 1e3, 4), "spinner_iterations": counter[0] if counter else 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=300, help="round trips per case")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes per message")
    ap.add_argument("--remote-ms", type=float, default=1.0,
                    help="the other process's time per task before it answers (ms)")
    ap.add_argument("--interval-ms", type=float, default=SWITCH_INTERVAL_S * 1e3,
                    help="the lowered switch interval (ms; ckpt_sglang's while receiving is the default)")
    ap.add_argument("--out", default=None, help="also write the rows here (JSON)")
    args = ap.parse_args(argv)
    if args.tasks <= 0 or args.bytes <= 0 or args.interval_ms <= 0 or args.remote_ms < 0:
        ap.error("--tasks, --bytes and --interval-ms must be positive, --remote-ms not negative")
    default = sys.getswitchinterval()
    mine, theirs = mp.Pipe()
    child = mp.get_context("spawn").Process(target=echo, args=(theirs, args.remote_ms / 1e3), daemon=True)
    child.start()
    payload = b"x" * args.bytes
    try:
        receive(mine, 10, payload)   # warm up
        rows = [measure(mine, args.tasks, payload, spinning=False, interval_s=default),
                measure(mine, args.tasks, payload, spinning=True, interval_s=default),
                measure(mine, args.tasks, payload, spinning=True, interval_s=args.interval_ms / 1e3)]
    finally:
        mine.send_bytes(b"")
        child.join(10)
    for row in rows:
        what = "beside a spinning thread" if row["spinning"] else "alone"
        print(f"{what:>26}, switch interval {row['switch_interval_ms']:.3f} ms: {row['tasks']} tasks in "
              f"{row['seconds']:.3f} s ({row['ms_per_task']:.3f} ms each)")
    slow, fast = rows[1]["seconds"], rows[2]["seconds"]
    print(f"lowering the interval to {args.interval_ms:g} ms: {slow / max(fast, 1e-9):.1f}x faster beside the spinner")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "speedup": slow / max(fast, 1e-9)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
