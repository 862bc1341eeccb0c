"""`ckpt-engine` run as a process of its own, as `python -m ckpt_core.cli ARGS` would run it, at the
cost of a fork instead of a fresh interpreter.

A spawned `python -m ckpt_core.cli` spends seconds importing torch before it reads its first
argument, and the CLI tests start dozens (minutes of CI's 2 cores). Here one helper process
imports the CLI once; each run is a child forked from it: its own process, its own stdout and
stderr (files), working directory, environment and exit code, running the module as ``__main__``
exactly as ``-m`` does, an uncaught exception printed as a traceback with exit code 1. A run that
outlives its timeout is killed (return code -9). Tests that need a fresh interpreter (what is
imported at start, an installed console script) still spawn one.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HELPER = r"""
import json, os, runpy, signal, sys, time, traceback
import ckpt_core.cli   # noqa: F401  (what every run imports first: torch and the package)

def child(req):
    out = os.open(req["out"], os.O_WRONLY | os.O_TRUNC)
    err = os.open(req["err"], os.O_WRONLY | os.O_TRUNC)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = ["ckpt_core.cli", *req["argv"]]
    code = 0
    try:
        runpy.run_module("ckpt_core.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)

for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        child(req)
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rc = -9
            break
        time.sleep(0.005)
    sys.stdout.write(json.dumps({"rc": rc}) + "\n")
    sys.stdout.flush()
"""

_lock = threading.Lock()
_helper: subprocess.Popen | None = None


def _start() -> subprocess.Popen:
    global _helper
    if _helper is None or _helper.poll() is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        _helper = subprocess.Popen([sys.executable, "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, cwd=ROOT, env=env)
        atexit.register(_helper.kill)
    return _helper


def run_cli(*argv: str, cwd=None, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ckpt_core.cli *argv`` (see the module's docstring); ``env`` defaults to this
    process's environment with the checkout first on PYTHONPATH."""
    if env is None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    with _lock, tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for path in (out, err):
            open(path, "w").close()
        helper = _start()
        helper.stdin.write(json.dumps({"argv": list(argv), "cwd": str(cwd or ROOT), "env": env, "out": out,
                                       "err": err, "timeout": timeout}) + "\n")
        helper.stdin.flush()
        reply = helper.stdout.readline()
        if not reply:
            raise RuntimeError(f"the CLI runner's helper process died (exit code {helper.wait()})")
        with open(out) as f_out, open(err) as f_err:
            return subprocess.CompletedProcess(["ckpt-engine", *argv], json.loads(reply)["rc"], f_out.read(),
                                               f_err.read())
