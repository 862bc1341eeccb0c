"""`ckpt-engine` run as a process of its own, as `python -m ckpt_core.cli ARGS` would run it, forked
from a helper that imported the CLI (and torch) once (tests/support/forked.py): the CLI tests start dozens."""

from __future__ import annotations

import os
import subprocess
import sys

from support.forked import Zygote, run_python
from support.procs import pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the project
_ENV = dict(os.environ, PYTHONPATH=pythonpath(ROOT))
# The CLI itself imports torch only in the subcommands that need it: the helper imports it (and the
# parameter server) up front, so that forked runs of inspect/plan/serve do not each import it again.
_CLI = Zygote(sys.executable, "import torch, ckpt_core.cli, ckpt_core._ps", env=_ENV, cwd=ROOT)


def run_cli(*argv: str, cwd=None, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ckpt_core.cli *argv``; ``env`` defaults to this process's environment with the
    checkout first on PYTHONPATH. A run past ``timeout`` is killed (return code -9)."""
    try:
        return run_python(_CLI, sys.executable, ["-m", "ckpt_core.cli", *argv], cwd=cwd or ROOT,
                          env=_ENV if env is None else env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:   # spawned (forks off)
        return subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", exc.stderr or "")
