"""torchrun worlds of this host for the tests, on a port of ``free_port()``'s, launched again when
another process took that port first.

``free_port()`` answers with a port that was free when it looked; torchrun's agent binds it as its
rendezvous store a second or more later (it imports torch first). On the suite's busy 2-core CI,
another process of the two halves was handed the port in between, and the agent failed with
EADDRINUSE before any rank ran (72bccc6). That failure alone launches the world again, on another
port: every other outcome, a rank's own "address already in use" included, is returned for the
caller to judge, so a retry never hides a failure of what the test runs.

    run = run_torchrun([SCRIPT, "--endpoint", url], nproc=2, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from support.ports import lost_port, on_a_free_port

START_S = 120.0   # start_torchrun's bound on the agent binding its store and starting a rank (seconds on a busy host)


def torchrun_cmd(nproc: int, port: int, script_args, *, python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run`` of ``script_args`` on ``nproc`` ranks of one node meeting
    at 127.0.0.1:``port``."""
    return [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port), *map(str, script_args)]


def store_port_lost(returncode: int | None, stderr: str, port: int, *, ran: bool) -> bool:
    """Whether torchrun failed because its agent could not bind its store on ``port``, another process
    holding it, before any rank ran. The evidence, all of it: it failed; no rank ran (``ran``: the
    script printed something or a rank process was seen) and none failed (torchrun reports a failed
    rank as ChildFailedError); its stderr says "address already in use" and names ``port`` (torch:
    ``DistNetworkError: ... port: P, useIpv6: false, code: -98, name: EADDRINUSE, message: address
    already in use``)."""
    return (bool(returncode) and not ran and "ChildFailedError" not in stderr and lost_port(stderr)
            and re.search(rf"\b{port}\b", stderr) is not None)


def run_torchrun(script_args, *, nproc: int, timeout: float, env: dict | None = None,
                 python: str = sys.executable, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """torchrun of ``script_args`` (``torchrun_cmd``) to its end, stdout and stderr captured as text;
    launched again on another port, ``LAUNCHES`` times in all, only when its store lost its port
    (``store_port_lost``). ``timeout``: each launch's, as ``subprocess.run``'s."""
    def launch(port: int) -> subprocess.CompletedProcess:
        return subprocess.run(torchrun_cmd(nproc, port, script_args, python=python), env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)

    def lost(run, port: int) -> bool:
        return isinstance(run, subprocess.CompletedProcess) and store_port_lost(run.returncode, run.stderr, port,
                                                                                ran=bool(run.stdout.strip()))

    return on_a_free_port(launch, lost, "torchrun's store")


def _children(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return bool(f.read().split())
    except OSError:
        return False


def _a_rank_started(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether torchrun started a rank process, seen before it ended. The agent starts its ranks only
    once its store is bound; a torchrun still starting after ``timeout`` counts as started (the port
    question is then the caller's waits' to answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _children(proc.pid):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return True


def start_torchrun(script_args, *, nproc: int, out: Path, err: Path | None = None, env: dict | None = None,
                   python: str = sys.executable, cwd: str | Path | None = None,
                   start_new_session: bool = False) -> subprocess.Popen:
    """torchrun of ``script_args`` in the background, its stdout into the file ``out`` and its stderr
    into ``err`` (``None``: into ``out`` as well); returns once it started a rank (its store holds its
    port then) or ended. Launched again on another port, ``LAUNCHES`` times in all, only when its store
    lost its port (``store_port_lost``); read what it printed from the files, not from the process."""
    def launch(port: int) -> tuple[subprocess.Popen, bool]:
        stdout = open(out, "w")
        stderr = open(err, "w") if err else subprocess.STDOUT
        try:
            proc = subprocess.Popen(torchrun_cmd(nproc, port, script_args, python=python), env=env, cwd=cwd,
                                    stdout=stdout, stderr=stderr, start_new_session=start_new_session)
        finally:   # the child keeps its own copies
            stdout.close()
            if err:
                stderr.close()
        ran = _a_rank_started(proc, START_S)
        if not ran:
            proc.wait()
        return proc, ran

    def lost(started, port: int) -> bool:
        if not isinstance(started, tuple) or started[1]:   # it raised, or a rank started
            return False
        return store_port_lost(started[0].returncode, Path(err or out).read_text(errors="replace"), port, ran=False)

    return on_a_free_port(launch, lost, "torchrun's store")[0]
