"""Every environment variable ckpt-engine reads, in one place.

Explicit arguments always win; these are the fallbacks. ``rank=0`` passed by a
caller means 0 (we test ``is None``, never truthiness).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

from ckpt_core.errors import ConfigError

__all__ = ["Settings", "ENV_VARS", "load_settings", "gc_pause_enabled", "fault_threads", "cpu_visible_devices",
           "delta_kernel", "delta_threads", "host_copy_mib", "host_copy_threads", "p2p_env", "cpu_event_delay_s",
           "delta_triton", "service_token",
           "engine_serve", "update_seconds",
           "NO_DEADLINE_S", "progress_log_s", "liveness", "MIN_TOKEN_CHARS"]

# name -> (type, default, meaning); docs/api.md lists the same (tests/unit/test_docs_env.py checks it).
ENV_VARS: dict[str, tuple[str, str, str]] = {
    "RANK": ("int", "0", "this parameter-server rank"),
    "WORLD_SIZE": ("int", "1", "number of parameter-server ranks"),
    "LOCAL_RANK": ("int", "RANK", "device index of this rank on its host (also its engine worker's)"),
    "LOCAL_WORLD_SIZE": ("int", "1", "parameter-server ranks on this host (torchrun sets it); shares the host's "
                         "cores among them where a thread count is automatic (PS_DELTA_THREADS)"),
    "MASTER_ADDR": ("str", "127.0.0.1", "address of rank 0's rendezvous store"),
    "MASTER_PORT": ("int", "29500", "port of rank 0's rendezvous store"),
    "PS_MAX_BUCKET_SIZE_GB": ("float", "8", "upper bound of one bucket (one slot of the IPC buffer), GiB"),
    "PS_MEM_FRACTION": ("float", "0.9", "fraction of free device memory the IPC buffer may take"),
    "PS_NUM_SLOTS": ("int", "4", "buckets in flight (slots of the IPC buffer ring)"),
    "PS_DELTA_BUCKETS": ("int", "8", "buckets per parameter-server rank a delta update aims at (its payloads "
                         "sized so, within PS_MAX_BUCKET_SIZE_GB and 64 MiB..1 GiB); the engine worker's apply costs "
                         "a fixed host time per bucket, so fewer trade the pipeline's overlap for less of it; 1..64"),
    "PS_COLLECTIVE_TIMEOUT_S": ("float", "600", "timeout of every collective and store wait, seconds"),
    "PS_PAUSE_GC": ("bool", "1", "pause Python's cyclic GC during register/gather/update and while an engine "
                    "worker receives (0: leave it running)"),
    "PS_FAULT_THREADS": ("int", "4", "threads per rank that fault in fresh host memory before it is pinned "
                         "(registration); more contend in the kernel and were slower on 2 ranks per host"),
    "PS_DELTA_THREADS": ("int", "auto", "threads of a registration's delta on the host (its compare, its payloads' "
                         "writing, lin64 of host tensors), 1..1024; `auto`: this process's usable cores shared "
                         "among the host's PS ranks (LOCAL_WORLD_SIZE), at least 4 where the cores allow, at most 16"),
    "CKPT_HOST_COPY_MIB": ("int", "256", "page-locked staging of an engine worker's host copies of what it "
                           "receives (a full update with deltas=True keeps them as the delta base), MiB, in 4 chunks, "
                           "allocated once per worker; 0: one pageable copy per tensor instead; 0..65536"),
    "CKPT_HOST_COPY_THREADS": ("int", "4", "threads that copy the staging's chunks into the host copies (memcpy and "
                               "first-touch page faults of the fresh copies), 1..1024"),
    "PS_DELTA_KERNEL": ("str", "auto", "`auto`: a registration's delta compare runs a small C pass, compiled on "
                        "first use by the host's C compiler (`$CC`, else `cc`) into ~/.cache/ckpt-engine/kernels; "
                        "`numpy`: never compiled, numpy only (also what `auto` does without a compiler); the "
                        "payloads are the same"),
    "PS_CPU_VISIBLE_DEVICES": ("str", "", "cpu kind only, like CUDA_VISIBLE_DEVICES: comma-separated host-wide "
                               "device numbers; local device i of this process is the i-th (e.g. `2,3` for the "
                               "workers of a second engine on the host); empty: i itself"),
    "PS_P2P_STORE_RDMA_DEVICES": ("str", "", "comma-separated RDMA NICs for the P2P store"),
    "NCCL_IB_HCA": ("str", "", "read as a fallback for PS_P2P_STORE_RDMA_DEVICES"),
    "NCCL_IB_DISABLE": ("bool", "0", "1: the P2P store uses TCP even where RDMA NICs exist (NCCL's meaning)"),
    "PS_P2P_HOST": ("str", "(route to MASTER_ADDR)", "address this rank's P2P store publishes in the metas "
                    "(default: the local address that routes to MASTER_ADDR, or, when that is loopback, the "
                    "outward interface's); Mooncake itself listens on every interface"),
    "PS_P2P_SERVE": ("bool", "0", "serve this rank's registered checkpoints to P2P readers (Mooncake; also "
                     "`ParameterServer(serve_p2p=True)`); off: no checkpoint memory is registered with Mooncake"),
    "CKPT_TEST_CPU_EVENT_DELAY_S": ("float", "0", "tests only: `cpu` device events report done this long after "
                                    "they were recorded, so the pipeline's waits and deferrals run on CPU"),
    "CKPT_TEST_DELTA_DROP_ONE": ("bool", "0", "tests only: an engine worker applying a delta drops one changed "
                                 "element (the mutation check: the post-apply digest check must fail the update)"),
    "CKPT_DELTA_TRITON": ("str", "gaps", "where an engine worker's delta runs fused Triton kernels on CUDA devices "
                          "where Triton imports: 0 nowhere (torch ops), check: the post-apply lin64 check, "
                          "gaps: the check and a bucket's gap16 payloads decoded and swapped in two passes, "
                          "1 or all: the check, the gap16 passes and the other scatters; the results are the same"),
    "CKPT_SERVICE_TOKEN": ("str", "", "bearer token of `ckpt-engine serve` on TCP (else `--token-file`)"),
    "CKPT_ENGINE_SERVE": ("str", "", "managed mode: `uds:PATH` (`{rank}` filled in) or `tcp:HOST:PORT` (local "
                          "rank i on PORT+i; needs CKPT_SERVICE_TOKEN); each engine worker starts its PS rank "
                          "serving there (docs/operations.md)"),
    "CKPT_PROGRESS_LOG_S": ("float", "10", "`ckpt-engine serve` with stderr not a terminal: log a progress line "
                            "of a running register/update this often, seconds (0: only the start and end lines)"),
    "CKPT_HEARTBEAT_S": ("float", "1", "`ckpt-engine serve`: each rank's service beats in the rendezvous store "
                         "this often, seconds"),
    "CKPT_PEER_TIMEOUT_S": ("float", "10", "`ckpt-engine serve`: /v1/healthz turns 503 once a peer rank's beat "
                            "(or the store itself) has been silent this long, seconds; a collective posted to "
                            "this rank only is logged and shown in /v1/status after this long"),
    "CKPT_ENGINE_SERVE_MASTER": ("str", "127.0.0.1:29555", "managed mode: `host:port` where the managed PS ranks "
                                 "of one engine meet"),
    "CKPT_SLICES": ("bool", "1", "0 turns sliced updates off where a driver asks for them (the service's "
                    "`slices`, `examples/vllm_update.py --slices`): they update whole tensors instead and say so "
                    "once in the log"),
}


# Upper bounds of the numeric settings: far above any real use, below what would overflow a conversion
# (int(GiB * 2**30), timedelta(seconds=...), time.sleep) or start a loop, list or thread per unit.
MAX_BUCKET_GB = float(1 << 20)   # 1 PiB
MAX_NUM_SLOTS = 1 << 10          # the command line's --slots has the same bound
MAX_DELTA_BUCKETS = 64          # PS_DELTA_BUCKETS: more would only be a slower full pipeline
MAX_FAULT_THREADS = 1 << 10
MAX_SETTING_S = 1e8              # ~3 years: a timeout, beat or interval longer than this is a typo


def _get(name: str, conv, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return conv(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not a valid {conv.__name__}") from exc


@dataclass(frozen=True)
class Settings:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    max_bucket_bytes: int
    mem_fraction: float
    num_slots: int
    collective_timeout_s: float
    rdma_devices: tuple[str, ...]
    serve_p2p: bool = False   # register checkpoints with the P2P store (Mooncake): opt-in, see docs/p2p.md
    delta_buckets: int = 8    # PS_DELTA_BUCKETS: buckets per owner rank of a delta's payloads

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise ConfigError(f"local rank must be >= 0, got {self.local_rank}")
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"mem_fraction (PS_MEM_FRACTION) must be in (0, 1], got {self.mem_fraction}")
        if self.max_bucket_bytes < 1024:
            raise ConfigError(f"the bucket size bound must be >= 1 KiB, got {self.max_bucket_bytes} bytes")
        if not 1 <= self.num_slots <= MAX_NUM_SLOTS:
            raise ConfigError(f"PS_NUM_SLOTS must be in 1..{MAX_NUM_SLOTS}, got {self.num_slots}")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"master_port must be in 1..65535, got {self.master_port}")
        _finite_positive("PS_COLLECTIVE_TIMEOUT_S", self.collective_timeout_s, MAX_SETTING_S)
        if not 1 <= self.delta_buckets <= MAX_DELTA_BUCKETS:
            raise ConfigError(f"PS_DELTA_BUCKETS must be in 1..{MAX_DELTA_BUCKETS}, got {self.delta_buckets}")


def _finite_positive(what: str, value: float, high: float | None = None) -> float:
    """``value`` if it is a finite number > 0 (and <= ``high``); else a ConfigError naming ``what`` (NaN,
    inf and huge values included: they would surface later as a misleading rendezvous error or a raw
    ValueError/OverflowError)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a finite number > 0, got {value!r}")
    if high is not None and value > high:
        raise ConfigError(f"{what} must be <= {high:g}, got {value!r}")
    return value


def _seconds_or_zero(name: str, default: float) -> float:
    """Environment variable ``name`` as a finite number >= 0 (else a ConfigError naming it)."""
    value = _get(name, float, default)
    if not (math.isfinite(value) and 0 <= value <= MAX_SETTING_S):
        raise ConfigError(f"{name} must be a finite number in [0, {MAX_SETTING_S:g}], got {value!r}")
    return value


def _number(what: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be a number, got {value!r}") from exc


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not a valid bool (0 or 1)")


def load_settings(*, rank=None, world_size=None, master_addr=None, master_port=None,
                  mem_fraction=None, max_bucket_gb=None, serve_p2p=None) -> Settings:
    """Merge explicit arguments over the environment and validate the result."""
    rank = _get("RANK", int, 0) if rank is None else int(rank)
    world_size = _get("WORLD_SIZE", int, 1) if world_size is None else int(world_size)
    if max_bucket_gb is None:
        bucket_gb = _finite_positive("PS_MAX_BUCKET_SIZE_GB", _get("PS_MAX_BUCKET_SIZE_GB", float, 8.0),
                                     MAX_BUCKET_GB)
    else:
        bucket_gb = _finite_positive("max_bucket_gb", _number("max_bucket_gb", max_bucket_gb), MAX_BUCKET_GB)
    rdma = _get("PS_P2P_STORE_RDMA_DEVICES", str, "") or _get("NCCL_IB_HCA", str, "")
    return Settings(
        rank=rank,
        world_size=world_size,
        local_rank=_get("LOCAL_RANK", int, rank),
        master_addr=master_addr if master_addr is not None else _get("MASTER_ADDR", str, "127.0.0.1"),
        master_port=int(master_port) if master_port is not None else _get("MASTER_PORT", int, 29500),
        max_bucket_bytes=int(bucket_gb * (1 << 30)),
        mem_fraction=(_number("mem_fraction", mem_fraction) if mem_fraction is not None
                      else _get("PS_MEM_FRACTION", float, 0.9)),
        num_slots=_get("PS_NUM_SLOTS", int, 4),
        collective_timeout_s=_get("PS_COLLECTIVE_TIMEOUT_S", float, 600.0),
        rdma_devices=tuple(d for d in rdma.split(",") if d),
        serve_p2p=_bool("PS_P2P_SERVE", False) if serve_p2p is None else _explicit_bool("serve_p2p", serve_p2p),
        delta_buckets=_get("PS_DELTA_BUCKETS", int, 8),
    )


def _explicit_bool(what: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{what} must be True or False, got {value!r}")
    return value


def slices_enabled() -> bool:
    """CKPT_SLICES, read at each use: the operator's switch that turns sliced updates off."""
    return _bool("CKPT_SLICES", True)


def gc_pause_enabled() -> bool:
    """PS_PAUSE_GC, read at each use (engine workers read it in the engine's process)."""
    raw = os.environ.get("PS_PAUSE_GC", "1").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"environment variable PS_PAUSE_GC={raw!r} is not a valid bool (0 or 1)")


def fault_threads() -> int:
    """PS_FAULT_THREADS, read at each registration."""
    n = _get("PS_FAULT_THREADS", int, 4)
    if not 1 <= n <= MAX_FAULT_THREADS:
        raise ConfigError(f"PS_FAULT_THREADS must be in 1..{MAX_FAULT_THREADS}, got {n}")
    return n


AUTO_DELTA_THREADS = (4, 16)   # the automatic choice's bounds: a floor where the cores allow it, a ceiling


def usable_cores() -> int:
    """The cores this process may run on (its affinity, else the host's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):   # pragma: no cover - not Linux
        return os.cpu_count() or 1


def auto_delta_threads(cores: int, local_ranks: int) -> int:
    """The automatic PS_DELTA_THREADS: ``cores`` shared among ``local_ranks`` PS ranks of the host (they
    register at once), at least 4 (where there are 4 cores) and at most 16. The compare is memory-bound:
    on a 16-core host its compiled pass read 22.8 GB/s on 4 threads and 58.4 on 16 (docs/deltas.md)."""
    low, high = AUTO_DELTA_THREADS
    return max(1, min(cores, high, max(low, cores // max(1, local_ranks))))


def delta_threads() -> int:
    """PS_DELTA_THREADS, read at each registration with a base: the threads of its compare, of its
    payloads' writing and of lin64 on the host; unset or ``auto``: :func:`auto_delta_threads` of this
    process's cores and LOCAL_WORLD_SIZE (the PS ranks of this host, as torchrun sets it)."""
    raw = os.environ.get("PS_DELTA_THREADS", "").strip().lower()
    if raw in ("", "auto"):
        local = _get("LOCAL_WORLD_SIZE", int, 1)
        return auto_delta_threads(usable_cores(), local)
    n = _get("PS_DELTA_THREADS", int, 4)
    if not 1 <= n <= MAX_FAULT_THREADS:
        raise ConfigError(f"PS_DELTA_THREADS must be in 1..{MAX_FAULT_THREADS}, got {n}")
    return n


MAX_HOST_COPY_MIB = 1 << 16


def host_copy_mib() -> int:
    """CKPT_HOST_COPY_MIB, read when an engine worker's host copier is made (its first full update with
    deltas=True): MiB of page-locked staging, 0 for none (pageable copies, one per tensor)."""
    n = _get("CKPT_HOST_COPY_MIB", int, 256)
    if not 0 <= n <= MAX_HOST_COPY_MIB:
        raise ConfigError(f"CKPT_HOST_COPY_MIB must be in 0..{MAX_HOST_COPY_MIB}, got {n}")
    return n


def host_copy_threads() -> int:
    """CKPT_HOST_COPY_THREADS, read with CKPT_HOST_COPY_MIB: the host copier's threads."""
    n = _get("CKPT_HOST_COPY_THREADS", int, 4)
    if not 1 <= n <= MAX_FAULT_THREADS:
        raise ConfigError(f"CKPT_HOST_COPY_THREADS must be in 1..{MAX_FAULT_THREADS}, got {n}")
    return n


def delta_kernel() -> str:
    """PS_DELTA_KERNEL, read at each use: ``auto`` or ``numpy`` (``delta/_scan.py``)."""
    raw = os.environ.get("PS_DELTA_KERNEL", "").strip().lower() or "auto"
    if raw not in ("auto", "numpy"):
        raise ConfigError(f"PS_DELTA_KERNEL must be 'auto' or 'numpy', got {raw!r}")
    return raw


def cpu_visible_devices() -> tuple[int, ...]:
    """PS_CPU_VISIBLE_DEVICES as numbers (empty: no mapping), read at each use."""
    raw = os.environ.get("PS_CPU_VISIBLE_DEVICES", "").strip()
    if not raw:
        return ()
    try:
        out = tuple(int(x) for x in raw.split(","))
    except ValueError as exc:
        raise ConfigError(f"environment variable PS_CPU_VISIBLE_DEVICES={raw!r} is not a comma-separated "
                          f"list of device numbers") from exc
    if any(d < 0 for d in out) or len(set(out)) != len(out):
        raise ConfigError(f"PS_CPU_VISIBLE_DEVICES={raw!r} must list distinct non-negative numbers")
    return out


def p2p_env() -> dict:
    """The P2P store's raw settings, read when the store is created: ``PS_P2P_HOST`` as set ("" when
    unset: ``p2p.store.store_host`` picks the address) and the raw NIC selections (``planning.nics``
    parses them: NCCL_IB_HCA has its own syntax)."""
    ib_off = _get("NCCL_IB_DISABLE", str, "0").strip().lower() in ("1", "true", "yes", "on")
    return {"host": _get("PS_P2P_HOST", str, "").strip(), "ps_devices": _get("PS_P2P_STORE_RDMA_DEVICES", str, ""),
            "nccl_ib_hca": _get("NCCL_IB_HCA", str, ""), "rdma": not ib_off}


def cpu_event_delay_s() -> float:
    """CKPT_TEST_CPU_EVENT_DELAY_S (tests only), read when a cpu event is made; 0 means events are done at once."""
    return _seconds_or_zero("CKPT_TEST_CPU_EVENT_DELAY_S", 0.0)


def delta_drop_one() -> bool:
    """CKPT_TEST_DELTA_DROP_ONE (tests only), read at each delta apply."""
    return _get("CKPT_TEST_DELTA_DROP_ONE", str, "0").strip().lower() in ("1", "true", "yes", "on")


def delta_triton() -> str:
    """CKPT_DELTA_TRITON, read when a delta kernel is about to run (``delta/_kernels.py``): ``off`` (0),
    ``check`` (the lin64 row sums only), ``gaps`` (the row sums, and a bucket's gap16 payloads decoded and
    swapped by two kernels, ``delta/_gap_route.py``) or ``all`` (1: every scatter too)."""
    raw = os.environ.get("CKPT_DELTA_TRITON", "").strip().lower()
    if raw == "":
        return "gaps"   # on an H100: dense16 at 2 % 65.7 ms (check 82.2), a real vLLM 7B 55.9 ms (check 69.1)
    if raw in ("check", "gaps", "all"):
        return raw
    try:
        return "all" if _bool("CKPT_DELTA_TRITON", False) else "off"
    except ConfigError:
        raise ConfigError(f"environment variable CKPT_DELTA_TRITON={raw!r} is not valid: 0, 1 (all), check, "
                          "gaps or all") from None


MIN_TOKEN_CHARS = 16   # a bearer token shorter than this is guessable; `openssl rand -hex 16` gives 32


def service_token() -> str | None:
    """CKPT_SERVICE_TOKEN (None when unset or empty)."""
    return _get("CKPT_SERVICE_TOKEN", str, "") or None


def progress_log_s() -> float:
    """CKPT_PROGRESS_LOG_S: seconds between progress log lines (0: none)."""
    return _seconds_or_zero("CKPT_PROGRESS_LOG_S", 10.0)


def liveness() -> tuple[float, float]:
    """(CKPT_HEARTBEAT_S, CKPT_PEER_TIMEOUT_S), the second at least twice the first."""
    beat = _finite_positive("CKPT_HEARTBEAT_S", _get("CKPT_HEARTBEAT_S", float, 1.0), MAX_SETTING_S)
    timeout = _finite_positive("CKPT_PEER_TIMEOUT_S", _get("CKPT_PEER_TIMEOUT_S", float, 10.0), MAX_SETTING_S)
    if timeout < 2 * beat:
        raise ConfigError(f"CKPT_PEER_TIMEOUT_S ({timeout:g}) must be at least twice CKPT_HEARTBEAT_S ({beat:g})")
    return beat, timeout


def engine_serve() -> tuple[str, str, int] | None:
    """(CKPT_ENGINE_SERVE, master address, master port) when managed mode is asked for, else None."""
    spec = _get("CKPT_ENGINE_SERVE", str, "")
    if not spec:
        return None
    master = _get("CKPT_ENGINE_SERVE_MASTER", str, "127.0.0.1:29555")
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"CKPT_ENGINE_SERVE_MASTER={master!r} is not host:port")
    return spec, host, int(port)


# An update timeout above this (float("inf"), timedelta.max, ...) means "no deadline for the
# update as a whole"; it is clamped here because thread joins and socket polls overflow on larger
# values. The collectives stay bounded by PS_COLLECTIVE_TIMEOUT_S, and a worker that goes away is
# still noticed at once.
NO_DEADLINE_S = 1e8   # ~3 years

def update_seconds(timeout) -> float:
    """The update's ``timeout`` (seconds or a timedelta) as seconds; ConfigError unless > 0 and not NaN."""
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise ConfigError(f"update timeout must be seconds (a number) or a timedelta, got {timeout!r}")
    if math.isnan(value) or value <= 0:
        raise ConfigError(f"update timeout must be positive, got {timeout!r}")
    return min(value, NO_DEADLINE_S)
