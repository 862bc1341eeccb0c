"""A parameter-server process that SIGKILLs itself after handing its vLLM worker some buckets.

For tests of a PS that dies mid-update (``test_vllm_live``) or mid-stage (``test_vllm_staged``):
``popen(server, weights, ...)`` starts it on a fresh port; it pushes ``weights`` through the server's
worker extension as a version or as a stage named ``doomed`` and dies, in its progress callback, once
the transfer handed ``kill_after`` buckets.
"""

from __future__ import annotations

import os
import subprocess
import sys

from support.ports import free_port

SCRIPT = """
import os, signal, sys
from ckpt_core import ParameterServer
from ckpt_vllm.client import VllmClient

endpoint, uds, weights, port, kill_after, bucket_gb, wait_s, how = sys.argv[1:]
client = VllmClient(endpoint, uds=uds or None, timeout=60)

def progress(operation, phase, done, total):
    if operation == "update" and phase == "transfer" and done is not None and done >= int(kill_after):
        print(f"handed {done} of {total} buckets: the PS dies", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1", master_port=int(port),
                     max_bucket_gb=float(bucket_gb)) as ps:
    ps.register_checkpoint("doomed", files=[weights])
    ps.gather_metas("doomed")
    ps.progress = progress
    ps.update("doomed", client.req_func(path="extension", timeout=float(wait_s), **{how: "doomed"}),
              timeout=float(wait_s))
print("the update ended: the PS was to die first", flush=True)
"""


def popen(server, weights, *, how: str, bucket_gb: float, wait_s: float, kill_after: int = 3,
          env: dict | None = None) -> subprocess.Popen:
    """Start the dying PS (``how``: ``"version"`` for an update, ``"stage"`` for a stage); its output is
    stdout, stderr merged into it."""
    assert how in ("version", "stage"), how
    full = {**os.environ, **(env or {}),
            "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-c", SCRIPT, server.endpoint, str(server.uds or ""), str(weights),
                             str(free_port()), str(kill_after), str(bucket_gb), str(wait_s), how],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full)
