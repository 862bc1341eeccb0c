"""Inside SGLang: read what the live model holds, in the scheduler process.

Start SGLang with ``--custom-weight-loader ckpt_sglang.probe.load`` (beside
``ckpt_sglang.staging.load`` if staged updates are wanted: the flag takes several); then
``SglangClient.state_digests()`` returns, per TP rank, a digest of every parameter and buffer of
the model (``_digest.py``). That is how an update is checked against a cold load of the same
checkpoint byte for byte on a real server (``tests/gpu/test_sglang_gpu.py``,
``benchmarks/sglang_bench.py``). The loader changes nothing; it speaks ``_protocol.py`` (one JSON
reply per rank on the client's socket) and, like every custom loader, never raises (an exception
there would end SGLang's scheduler).
"""

from __future__ import annotations

import logging
import time
import traceback

from ._digest import state_digests
from ._protocol import decode_command, loader_tp_rank, reply

__all__ = ["load"]

log = logging.getLogger("ckpt_sglang.probe")
REPLY_TIMEOUT_S = 10.0


def _digests(model, cmd: dict) -> dict:
    t0 = time.perf_counter()
    out = state_digests(model, str(cmd.get("mode", "sha256")))
    return {"digests": out, "seconds": time.perf_counter() - t0}


OPS = {"digests": _digests}


def load(model, named_tensors) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader ckpt_sglang.probe.load``); never raises."""
    import zmq

    try:
        cmd = decode_command(named_tensors)
    except Exception:   # noqa: BLE001 - not ours: nothing to answer to
        log.error("ckpt_sglang.probe.load was called with something that is not our command:\n%s",
                  traceback.format_exc())
        return
    message = {"tp_rank": loader_tp_rank(), "op": cmd["op"], "ok": True}
    try:
        if cmd["op"] not in OPS:
            raise ValueError(f"ckpt_sglang.probe.load answers {sorted(OPS)}, not {cmd['op']!r}")
        message["result"] = OPS[cmd["op"]](model, cmd)
    except Exception as exc:   # noqa: BLE001 - travels to the client
        message.update(ok=False, error=str(exc), error_type=type(exc).__name__, traceback=traceback.format_exc())
    try:
        reply(zmq.Context.instance(), cmd["reply"], message, REPLY_TIMEOUT_S)
    except Exception:   # noqa: BLE001
        log.error("ckpt_sglang.probe: could not answer %s on %s:\n%s", cmd["op"], cmd["reply"], traceback.format_exc())
