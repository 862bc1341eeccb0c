import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- where the suite's time goes: wall seconds and busy CPU seconds per test file --------------------
# "busy" is the whole machine's (/proc/stat: every process, the tests' servers and worlds included,
# and anything else running here); on a machine of its own it says how much of the cores the suite
# used. CKPT_TEST_TIMES=FILE also writes the per-file figures as JSON.
_TIMES: dict[str, list[float]] = {}


def _busy_seconds() -> float:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import time
    t0, c0 = time.monotonic(), _busy_seconds()
    yield
    entry = _TIMES.setdefault(item.location[0], [0.0, 0.0, 0])
    entry[0] += time.monotonic() - t0
    entry[1] += _busy_seconds() - c0
    entry[2] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _TIMES:
        return
    wall = sum(e[0] for e in _TIMES.values())
    busy = sum(e[1] for e in _TIMES.values())
    tr = terminalreporter
    tr.section("time per test file (wall s, busy CPU s of the machine, tests)")
    for path, (w, c, n) in sorted(_TIMES.items(), key=lambda kv: -kv[1][0])[:20]:
        tr.write_line(f"{w:8.1f} {c:8.1f}  {n:4d}  {path}")
    tr.write_line(f"all tests: {wall:.0f} s wall, {busy:.0f} s busy CPU: {busy / max(wall, 1e-9):.2f} of "
                  f"{os.cpu_count()} cores busy on average")
    try:   # what the tests left open in this process (worlds leaked 6 each once, and select() broke past 1024)
        tr.write_line(f"descriptors this pytest process holds at the end: {len(os.listdir('/proc/self/fd'))}")
    except OSError:
        pass
    out = os.environ.get("CKPT_TEST_TIMES")
    if out:
        import json
        with open(out, "w") as f:
            json.dump({p: {"wall_s": w, "busy_cpu_s": c, "tests": n} for p, (w, c, n) in _TIMES.items()}, f, indent=1)
