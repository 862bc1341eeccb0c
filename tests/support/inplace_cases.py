"""Registering in-place /dev/shm files this process may not write or read (issue 14, defect 3).

Permissions only bind an unprivileged process, so ``register_as_unprivileged`` runs
``build_checkpoint`` (what ``register_checkpoint`` calls) in a child process that drops to an
unprivileged user after its imports when the tests run as root. Used by the CPU tests and, with
``kind="cuda"`` (where a read-only file cannot be pinned in place and is copied), by the GPU tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.e2e_cases import ShmDir
from support.procs import pythonpath

NOBODY = 65534
CHILD = r"""
import json, os, sys
import torch
from ckpt_core.checkpoint.sources import build_checkpoint
from ckpt_core.devices import get_backend
from ckpt_core.errors import CkptError
from support.data import digest
files, unlink, kind = json.loads(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
backend = get_backend(kind)
if kind == "cuda":
    torch.cuda.init()   # the driver's files are opened before the privileges go
if os.geteuid() == 0:
    os.setgid(%(uid)d); os.setuid(%(uid)d)
out = {}
try:
    ckpt = build_checkpoint("c", backend, files=files, unlink_inplace_files=unlink)
    out["ok"] = True
    out["in_place"] = [r.source_check is not None for r in ckpt.regions.values()]
    out["digests"] = {m.name: digest(ckpt.host_tensor(m)) for m in ckpt.metas}
    out["exist"] = [os.path.exists(f) for f in files]
    ckpt.release()
except CkptError as exc:
    out = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
except BaseException as exc:
    out = {"ok": False, "error": "raw " + type(exc).__name__, "message": str(exc)}
out.setdefault("exist", [os.path.exists(f) for f in files])
print("RESULT " + json.dumps(out))
""" % {"uid": NOBODY}


def register_as_unprivileged(files: list[str], *, unlink: bool, kind: str = "cpu") -> dict:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # this file is in tests/support/
    env = dict(os.environ, PYTHONPATH=pythonpath(os.path.dirname(tests), tests))
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(files), "1" if unlink else "0", kind],
                          capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child failed: {proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def write_owned(shm: ShmDir, name: str, tensors: dict, mode: int) -> str:
    path = shm.write(name, tensors)
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    os.chmod(path, mode)
    return path
