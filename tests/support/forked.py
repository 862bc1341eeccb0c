"""Run a Python script or module as a process of its own, forked from a helper process that has
imported the heavy libraries once, instead of a fresh interpreter importing them again.

The suite starts hundreds of short Python processes (the CLI, tiny-model builds and transformers
references); each fresh one spends seconds of a core importing torch or transformers before its
first line of work, minutes of CI's 2 cores in all. A
:class:`Zygote` is one long-lived helper (``python -c ...``) that imports ``preload`` and then,
per run, forks a child: its own pid, stdout and stderr (files), working directory, environment,
argv and exit code; the script runs as ``__main__`` (``python FILE`` / ``python -m MODULE``), an
uncaught exception is printed as a traceback with exit code 1. Runs may overlap (the helper
forks at once and reports each exit when it comes); one that outlives its timeout is killed
(return code -9). ``CKPT_TEST_FORK_RUNS=0`` runs everything as fresh processes instead.

What a fork cannot give: an interpreter that imported nothing yet. Tests of import-time
behaviour, installed console scripts and vLLM cold loads (a forked one once gave the GPTQ model
rotary caches a spawned server did not) still spawn one.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import tempfile
import threading

_HELPER = r"""
import json, os, runpy, sys, threading, traceback
PRELOAD
sys.stdout.flush()

def child(req):
    os.setpgid(0, 0)   # its own process group: a timeout kills what it started too
    out = os.open(req["out"], os.O_WRONLY | os.O_TRUNC)
    err = os.open(req["err"], os.O_WRONLY | os.O_TRUNC)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in (null, out, err):
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    code = 0
    try:
        if req["argv"][0] == "-m":
            sys.argv = [req["argv"][1], *req["argv"][2:]]
            runpy.run_module(req["argv"][1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(req["argv"])
            sys.path.insert(0, os.path.dirname(os.path.abspath(req["argv"][0])))
            runpy.run_path(req["argv"][0], run_name="__main__")
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

lock = threading.Lock()

def reply(msg):
    with lock:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

def reap(pid, tag):
    _, status = os.waitpid(pid, 0)
    reply({"tag": tag, "rc": os.waitstatus_to_exitcode(status)})

for line in sys.stdin:
    req = json.loads(line)
    with lock:
        sys.stdout.flush()
        pid = os.fork()
    if pid == 0:
        child(req)
    reply({"tag": req["tag"], "pid": pid})
    threading.Thread(target=reap, args=(pid, req["tag"]), daemon=True).start()
"""


class Zygote:
    """One helper process of ``python`` that imported ``preload`` (Python statements) with
    ``env``; started at the first run, stopped at exit."""

    def __init__(self, python: str, preload: str, env: dict | None = None, cwd: str | None = None):
        self.python, self.preload, self.env, self.cwd = python, preload, env, cwd
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._waiting: dict[int, dict] = {}
        self._tags = 0

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("CKPT_TEST_FORK_RUNS", "1") != "0"

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([self.python, "-c", _HELPER.replace("PRELOAD", self.preload)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          env=self.env, cwd=self.cwd)
            atexit.register(self._proc.kill)
            threading.Thread(target=self._read, args=(self._proc,), daemon=True, name="zygote-replies").start()
        return self._proc

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            msg = json.loads(line)
            with self._lock:
                slot = self._waiting.get(msg["tag"])
            if slot is not None:
                slot.update(msg)
                slot["event" if "rc" in msg else "started"].set()
        with self._lock:   # the helper died: nobody waits forever
            for slot in self._waiting.values():
                slot.setdefault("rc", None)
                slot["started"].set()
                slot["event"].set()

    def run(self, argv: list[str], *, cwd=None, env: dict | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """``python *argv`` (``argv[0]`` a script path, or ``"-m", module``) as a forked child."""
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            for path in (out, err):
                open(path, "w").close()
            slot = {"event": threading.Event(), "started": threading.Event()}
            with self._lock:
                self._tags += 1
                tag = self._tags
                self._waiting[tag] = slot
                proc = self._start()
                proc.stdin.write(json.dumps({"tag": tag, "argv": [str(a) for a in argv], "out": out, "err": err,
                                             "cwd": str(cwd or os.getcwd()),
                                             "env": dict(os.environ if env is None else env)}) + "\n")
                proc.stdin.flush()
            try:
                if not slot["event"].wait(timeout):
                    if slot["started"].wait(5) and "pid" in slot:
                        try:
                            os.killpg(slot["pid"], signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    slot["event"].wait(30)
                    slot["rc"] = -9
            finally:
                with self._lock:
                    self._waiting.pop(tag, None)
            if slot.get("rc") is None:
                raise RuntimeError(f"the fork helper of {self.python} died (exit code {proc.poll()})")
            with open(out) as f_out, open(err) as f_err:
                return subprocess.CompletedProcess([self.python, *argv], slot["rc"], f_out.read(), f_err.read())


def run_python(zygote: Zygote | None, python: str, argv: list[str], *, cwd=None, env: dict | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``python *argv`` forked from ``zygote``, or spawned when there is none or forks are off
    (same result either way; a spawned run past ``timeout`` raises ``subprocess.TimeoutExpired``)."""
    if zygote is not None and Zygote.enabled():
        return zygote.run(argv, cwd=cwd, env=env, timeout=timeout)
    return subprocess.run([python, *map(str, argv)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)
