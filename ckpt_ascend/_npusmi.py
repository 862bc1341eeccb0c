"""The NPU device key: which physical chip the calling process uses, read from ``npu-smi``.

torch_npu reports an all-zero device UUID, so the key is ``NPU-{host ip}-{chip}``
with ``chip = npu_id * chip_count + chip_id``, the numbering stock checkpoint-engine
uses (engines that embed its worker look themselves up by the same key). The
parameter-server rank and the engine worker beside it each find their own pid in
``npu-smi info -t proc-mem -i <npu_id>``; both land on the same physical chip even
when their ``ASCEND_RT_VISIBLE_DEVICES`` differ (the logical index does not matter).

Output of ``npu-smi info -t proc-mem -i N`` (documented format; the process lines of
a chip come before that chip's ``Chip ID`` line)::

        NPU ID                         : 4
        Chip Count                     : 2
        Process id:48211  Process name:python3  Process memory(MB):3127
        Chip ID                        : 0
        Process id:48307  Process name:python3  Process memory(MB):3130
        Chip ID                        : 1
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

from ckpt_core.errors import ConfigError

__all__ = ["ProcMem", "parse_proc_mem", "visible_devices", "find_chip", "device_key", "host_ip"]

log = logging.getLogger("ckpt_ascend")

NPU_SMI = "npu-smi"
NPU_SMI_TIMEOUT_S = 60.0   # all queries of one lookup; npu-smi answers in well under a second each
MAX_NPU_IDS = 16           # npu ids scanned (A3 boxes have 8 NPUs of 2 chips, Box16 has 16)
VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"

_NPU_ID = re.compile(r"^\s*NPU ID\s*:\s*(\d+)\s*$")
_CHIP_COUNT = re.compile(r"^\s*Chip Count\s*:\s*(\d+)\s*$")
_CHIP_ID = re.compile(r"^\s*Chip ID\s*:\s*(\d+)\s*$")
_PROCESS = re.compile(r"^\s*Process id\s*:\s*(\d+)\b.*Process memory\(MB\)\s*:\s*\d+\s*$")
_IGNORED = re.compile(r"^\s*$|^\s*No process in device\.?\s*$")


@dataclass
class ProcMem:
    """One NPU's ``proc-mem`` report: its chip count and the pids on each chip."""
    npu_id: int
    chip_count: int
    pids: dict[int, list[int]] = field(default_factory=dict)   # chip id -> pids

    def chips_of(self, pid: int) -> list[int]:
        return sorted(chip for chip, pids in self.pids.items() if pid in pids)


def parse_proc_mem(text: str, *, source: str = "npu-smi") -> ProcMem:
    """Parse one ``npu-smi info -t proc-mem -i N`` output; raises ConfigError on anything unexpected.

    A process line belongs to the first ``Chip ID`` line after it. Lines we do not
    recognise are errors, not skipped: a silently misread table would give two
    processes on one chip different keys.
    """
    npu_id = chip_count = None
    pending: list[int] = []
    pids: dict[int, list[int]] = {}

    def bad(why: str) -> ConfigError:
        head = "\n".join(text.strip().splitlines()[:6])
        return ConfigError(f"cannot parse the output of {source}: {why}; it began with:\n{head}")

    if "does not support" in text:
        raise ConfigError(f"{source}: this device does not report per-process memory (proc-mem), so the NPU "
                          f"device key cannot be derived: {text.strip()[:200]}")
    for line in text.splitlines():
        if m := _NPU_ID.match(line):
            npu_id = int(m.group(1))
        elif m := _CHIP_COUNT.match(line):
            chip_count = int(m.group(1))
        elif m := _PROCESS.match(line):
            pending.append(int(m.group(1)))
        elif m := _CHIP_ID.match(line):
            pids.setdefault(int(m.group(1)), []).extend(pending)
            pending = []
        elif not _IGNORED.match(line):
            raise bad(f"unexpected line {line.strip()[:120]!r}")
    if npu_id is None or chip_count is None or chip_count < 1:
        raise bad("no 'NPU ID' and 'Chip Count' lines")
    if pending:
        raise bad(f"process lines {pending} are not followed by a 'Chip ID' line")
    if any(chip >= chip_count for chip in pids):
        raise bad(f"chip ids {sorted(pids)} do not fit 'Chip Count : {chip_count}'")
    return ProcMem(npu_id, chip_count, pids)


def visible_devices() -> list[int] | None:
    """The physical chips behind logical indices 0, 1, ... (``ASCEND_RT_VISIBLE_DEVICES``), or None."""
    raw = os.environ.get(VISIBLE_ENV, "").strip()
    if not raw:
        return None
    try:
        ids = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{VISIBLE_ENV}={raw!r} is not a comma-separated list of chip numbers") from None
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise ConfigError(f"{VISIBLE_ENV}={raw!r} lists a chip twice or a negative chip")
    return ids


def _query(npu_id: int, deadline: float) -> ProcMem | None:
    """One npu id's report; None when npu-smi says that id does not exist here (non-zero exit)."""
    exe = shutil.which(NPU_SMI)
    if exe is None:
        raise ConfigError(f"{NPU_SMI} is not on PATH: the NPU device key is read from "
                          f"'{NPU_SMI} info -t proc-mem' (install the Ascend driver tools or add them to PATH)")
    cmd = [exe, "info", "-t", "proc-mem", "-i", str(npu_id)]
    try:
        left = max(0.1, deadline - time.monotonic())
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=left, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"'{' '.join(cmd)}' did not answer (the device-key lookup may take "
                          f"{NPU_SMI_TIMEOUT_S:g} s in all)") from exc
    except OSError as exc:
        raise ConfigError(f"cannot run '{' '.join(cmd)}': {exc}") from exc
    if done.returncode != 0:
        log.debug("%s: exit %d: %s", " ".join(cmd), done.returncode, done.stderr.strip()[:200])
        return None
    return parse_proc_mem(done.stdout, source=" ".join(cmd))


def find_chip(pid: int, hint: int | None = None) -> int:
    """The physical chip (``npu_id * chip_count + chip_id``) process ``pid`` runs on.

    ``hint`` is the chip the caller expects (its logical index mapped through
    ``ASCEND_RT_VISIBLE_DEVICES``); it is asked first and settles the choice when the
    process appears on several chips. Raises ConfigError when npu-smi is missing, its
    output cannot be parsed, or the process is on no chip.
    """
    order = list(range(MAX_NPU_IDS))
    if hint is not None:   # its NPU is hint (one chip per NPU) or hint // 2 (two): ask those first
        first = [i for i in dict.fromkeys((hint // 2, hint)) if i < MAX_NPU_IDS]
        order = first + [i for i in order if i not in first]
    found: list[int] = []
    answered = 0
    deadline = time.monotonic() + NPU_SMI_TIMEOUT_S
    for npu_id in order:
        report = _query(npu_id, deadline)
        if report is None:
            continue
        answered += 1
        found += [npu_id * report.chip_count + chip for chip in report.chips_of(pid)]
        if hint is not None and found == [hint]:
            break
    if answered == 0:
        raise ConfigError(f"'{NPU_SMI} info -t proc-mem -i N' failed for every npu id 0..{MAX_NPU_IDS - 1}")
    if not found:
        raise ConfigError(f"process {pid} uses no NPU according to '{NPU_SMI} info -t proc-mem' (npu ids "
                          f"0..{MAX_NPU_IDS - 1}): set the device first (torch.npu.set_device); in a container, "
                          "npu-smi lists host pids, so run it in the host pid namespace (--pid=host)")
    if len(found) == 1:
        return found[0]
    if hint in found:
        return hint
    raise ConfigError(f"process {pid} uses NPU chips {sorted(found)}; cannot tell which is its device "
                      f"(expected chip {hint} from {VISIBLE_ENV}): set {VISIBLE_ENV} to one chip per process")


_ip: str | None = None
_keys: dict[tuple[int, int], str] = {}
_lock = threading.Lock()


def host_ip() -> str:
    """This host's address on its default route (no packet is sent), else its hostname's address.

    Chosen exactly as stock checkpoint-engine chooses it (route towards 8.8.8.8), so that an
    engine embedding the stock worker (SGLang) computes the same key on a multi-homed host.
    """
    global _ip
    if _ip is None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("8.8.8.8", 80))   # routing only: a UDP connect sends nothing
                _ip = s.getsockname()[0]
        except OSError:
            _ip = socket.gethostbyname(socket.gethostname())
    return _ip


def device_key(index: int) -> str:
    """``NPU-{ip}-{chip}`` of logical device ``index`` of this process; cached per (pid, index)."""
    pid = os.getpid()
    with _lock:
        if (pid, index) not in _keys:
            visible = visible_devices()
            if visible is not None and not 0 <= index < len(visible):
                raise ConfigError(f"device index {index} is outside {VISIBLE_ENV}={os.environ[VISIBLE_ENV]!r}")
            hint = visible[index] if visible is not None else index
            _keys[(pid, index)] = f"NPU-{host_ip()}-{find_chip(pid, hint)}"
        return _keys[(pid, index)]
