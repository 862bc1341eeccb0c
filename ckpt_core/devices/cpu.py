"""The ``cpu`` kind: gloo collectives and a POSIX shared-memory IPC buffer.

Used on machines without accelerators (CI, the vLLM-CPU engine) and by tests.
The IPC buffer is a file in /dev/shm that the worker maps by path.
"""

from __future__ import annotations

import mmap
import os
import socket
import time
from typing import Any

import torch

from ckpt_core._settings import cpu_event_delay_s, cpu_visible_devices
from ckpt_core.errors import ConfigError, TransportError

from ._base import DeviceBackend, IpcBuffer, NullEvent

SHM_DIR = "/dev/shm"


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                value = f.read().strip()
            if value:
                return value[:12]
        except OSError:
            continue
    return socket.gethostname()


class _Mapping:
    """Owns one mmap; closing drops it (tensors that view it must be gone first)."""

    def __init__(self, mm: mmap.mmap):
        self.mm: mmap.mmap | None = mm

    def close(self) -> None:
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # A tensor still views the map; the OS frees it when the last view dies.
                pass


class LateEvent:
    """Tests only (CKPT_TEST_CPU_EVENT_DELAY_S): an event that reports done ``delay`` seconds after
    it was recorded, as a device's would, so that the pipeline's waiting and deferral paths run
    for real on CPU (the work itself is synchronous here, so the data is there already)."""

    def __init__(self, delay: float):
        self.delay = delay
        self.done_at: float | None = None

    def record(self, stream=None) -> None:
        self.done_at = time.monotonic() + self.delay

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return self.done_at is None or time.monotonic() >= self.done_at

    def synchronize(self) -> None:
        if self.done_at is not None:
            time.sleep(max(0.0, self.done_at - time.monotonic()))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_namespace() -> int:
    """Inode of our pid namespace: a pid means something only inside its namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _sweep_orphans() -> None:
    """Unlink our IPC buffers whose owning process is gone (same user, same pid namespace only)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    ns = str(_pid_namespace())
    for n in names:
        _, sep, owner = n.rpartition("-p")
        pid, sep2, owner_ns = owner.partition("n")
        if not (n.startswith("ckpt-") and sep and sep2 and pid.isdigit() and owner_ns == ns):
            continue
        if _pid_alive(int(pid)):
            continue
        path = os.path.join(SHM_DIR, n)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
        except OSError:
            pass


class CpuBackend(DeviceBackend):
    kind = "cpu"
    collective_backend = "gloo"
    pins_host_memory = False

    def is_available(self) -> bool:
        return True

    def device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def mem_get_info(self, index: int) -> tuple[int, int]:
        st = os.statvfs(SHM_DIR) if os.path.isdir(SHM_DIR) else None
        if st is None:
            return (1 << 30, 1 << 30)
        return (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)

    def device_key(self, index: int) -> str:
        """``CPU-<machine>-<n>``: n is ``index`` mapped through PS_CPU_VISIBLE_DEVICES (like CUDA's
        visible devices), so two engines on one host can each number their workers from 0."""
        visible = cpu_visible_devices()
        index = int(index)
        if visible:
            if not 0 <= index < len(visible):
                raise ConfigError(f"cpu device {index} is not visible: PS_CPU_VISIBLE_DEVICES lists "
                                  f"{len(visible)} device(s) {list(visible)}")
            index = visible[index]
        return f"CPU-{_machine_id()}-{index}"

    def new_event(self):
        delay = cpu_event_delay_s()
        return LateEvent(delay) if delay else NullEvent()

    def alloc_ipc(self, nbytes: int, index: int, name: str) -> IpcBuffer:
        _sweep_orphans()
        # The owner's pid is part of the name, so the next PS on the host can reclaim the
        # buffer of one that was SIGKILLed (nothing else ever would: /dev/shm outlives it).
        path = os.path.join(SHM_DIR, f"ckpt-{name}-p{os.getpid()}n{_pid_namespace()}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create the shared-memory buffer {path}: {exc}") from exc
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except OSError as exc:
            os.unlink(path)
            raise TransportError(f"cannot size the shared-memory buffer {path} to {nbytes} bytes: {exc}") from exc
        finally:
            os.close(fd)
        mapping = _Mapping(mm)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)

        def close() -> None:
            mapping.close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

        return IpcBuffer(tensor, {"kind": "cpu", "path": path, "nbytes": nbytes}, close)

    def open_ipc(self, descriptor: dict[str, Any], index: int):
        path, nbytes = descriptor.get("path"), descriptor.get("nbytes")
        if not isinstance(path, str) or not path.startswith(SHM_DIR + "/ckpt-") or ".." in path:
            raise TransportError(f"refusing to map {path!r}: not a ckpt-engine shared-memory buffer")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TransportError(f"cannot open the shared-memory buffer {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise TransportError(f"shared-memory buffer {path} has {size} bytes, the PS announced {nbytes}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return torch.frombuffer(mm, dtype=torch.uint8), _Mapping(mm)
