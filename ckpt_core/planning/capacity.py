"""Capacity planner: predicted update time per stage and memory, for clusters we never ran on.

Pure: plain numbers in, plain data out (``ckpt-engine plan`` prints it). The model follows
what the transfer does (docs/architecture.md):

- **h2d**: each owner copies its share from pinned host memory to a device slot. At most
  ``slots`` buckets are in flight (a slot must be free on every rank), so at most
  ``min(slots, ranks)`` ranks copy at once: ``max(largest share / h2d, model / (h2d x that))``.
- **broadcast**: every bucket is broadcast once to every rank: ``model / bw``, where ``bw`` is the
  intra-node broadcast bandwidth, or the NIC bandwidth of a node when that is lower and there
  is more than one node (each bucket crosses every node's NIC once).
- **reload**: the engine copies what it received into its parameters: ``model / reload`` plus a
  per-tensor cost (Python and kernel launches per tensor; it is what makes MoE slower).
- **p2p** (``mode="p2p"``, late-joining ranks): the joining node pulls the whole model over its
  NIC from the owners' host memory, then broadcasts locally; replaces h2d. Measured on one
  H200 over TCP on loopback, a P2P update ran at 0.93 to 1.0 of a plain Mooncake read of the
  same bytes (benchmarks/results/README.md), which is what this assumes; RDMA NIC rates are
  not measured here.

Stages overlap over the ring of slots: ``fixed + max(stages) + (sum - max) / buckets`` (the
pipeline's fill and drain); with one slot nothing overlaps and the stages add up.

The defaults are calibrated on this project's measured 2xH200 run
(``benchmarks/results/2026-11-30-2xH200-7b50b1f-all-cases.json``, see :func:`calibrate`): within 10 % of every
case of that run (tests/unit/test_capacity.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ckpt_core.errors import ConfigError
from ckpt_core.planning.buckets import choose_layout
from ckpt_core.planning.slice_estimate import SliceLoad

GB = 1e9
GiB = float(1 << 30)


@dataclass(frozen=True)
class Calibration:
    """Costs that no ceiling measures; fitted on benchmark runs (``calibrate``, ``fit_per_tensor``)."""
    fixed_s: float = 0.0102          # per update: plan, handshake, agreements (tiny case)
    # engine-side cost per tensor, overlapped with the other stages: our worker (~2.6 us) and the
    # benchmark's simulated engine (~12.8 us, its copy into parameters), fitted on moe128 (19,162
    # tensors, whole: 0.364 s on one H100, 2026-12-06); 17.1 us on one H200 on 2026-12-03, 29.2 us on
    # the run of 2026-11-30
    per_tensor_s: float = 1.56e-05
    reload_gbps: float = 2125.0      # device-to-device copy into parameters (half the D2D read+write rate)
    register_gbps: float = 3.95      # one rank's registration (copy into pinned memory), GB/s of its share
    source: str = ("benchmarks/results/2026-11-30-2xH200-7b50b1f-all-cases.json; per tensor: "
                   "benchmarks/results/2026-12-06-1xH100-f8f819f-update-bench-moe8-moe128-tp8.json")


@dataclass(frozen=True)
class ModelSpec:
    total_bytes: int
    tensors: int
    largest_tensor: int

    def __post_init__(self):
        if self.total_bytes <= 0 or self.tensors <= 0:
            raise ConfigError(f"model size and tensor count must be positive, got {self.total_bytes} bytes, "
                              f"{self.tensors} tensors")
        if not 0 < self.largest_tensor <= self.total_bytes:
            raise ConfigError(f"largest tensor must be in (0, model size], got {self.largest_tensor}")


@dataclass(frozen=True)
class Topology:
    nodes: int = 1
    devices_per_node: int = 2
    h2d_gbps: float = 49.3            # per device, all devices copying at once (measured 2xH200; see h2d_default)
    broadcast_gbps: float = 347.0     # intra-node device broadcast (NVLink, measured 2xH200)
    nic_gbps: float = 50.0            # per node, all NICs together (GB/s; 8x400 Gb/s ~ 400)
    device_free_gib: float = 130.0    # free device memory per device before the update
    mem_fraction: float = 0.9
    slots: int = 4
    max_bucket_gib: float = 8.0

    def __post_init__(self):
        for name in ("nodes", "devices_per_node", "slots"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("h2d_gbps", "broadcast_gbps", "nic_gbps", "device_free_gib", "max_bucket_gib"):
            value = getattr(self, name)   # NaN and inf would surface later as a raw ValueError/OverflowError
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")

    @property
    def ranks(self) -> int:
        return self.nodes * self.devices_per_node


H2D_ALONE_GBPS = 55.4   # one H200 copying alone (measured 1xH200): no other device shares host memory


def h2d_default(devices_per_node: int) -> float:
    """Measured host-to-device rate per device: alone on its host, or with every device copying."""
    return H2D_ALONE_GBPS if devices_per_node == 1 else Topology.h2d_gbps


def predict(model: ModelSpec, topo: Topology, *, mode: str = "broadcast", cal: Calibration = Calibration(),
            slices: SliceLoad | None = None) -> dict:
    """Predicted seconds per stage, the update's total, and host/device memory (plain data).

    ``slices``: each engine rank receives only its slices (``planning/slices.py``), as a
    :class:`~ckpt_core.planning.slice_estimate.SliceLoad` says (from a recorded plan, or estimated
    from the checkpoint, or ``slice_estimate.from_fraction``: a fraction of the bytes split over the
    ranks, the rest whole on every rank). A broadcast
    update then moves and reloads only the most any rank receives; a P2P update still reads every
    byte over the network (each target its own slices) but broadcasts in the target group only what
    every rank reads whole.
    """
    if mode not in ("broadcast", "p2p"):
        raise ConfigError(f"mode must be 'broadcast' or 'p2p', got {mode!r}")
    ranks = topo.ranks
    if slices is not None and mode == "broadcast" and ranks % slices.tp:
        raise ConfigError(f"a sliced broadcast feeds engine rank p % T from PS rank p: {ranks} rank(s) are not a "
                          f"multiple of the engine's {slices.tp}")
    share = math.ceil(model.total_bytes / ranks)   # the registration spreads bytes evenly (largest first)
    share = max(share, model.largest_tensor)
    bucket, slots = choose_layout(int(topo.device_free_gib * GiB), mem_fraction=topo.mem_fraction,
                                  max_slots=topo.slots, max_bucket_bytes=int(topo.max_bucket_gib * GiB),
                                  largest_tensor=model.largest_tensor, largest_owner_total=share)
    if bucket < model.largest_tensor:
        raise ConfigError(f"the largest tensor ({model.largest_tensor / GiB:.2f} GiB) does not fit in "
                          f"{topo.mem_fraction:g} of {topo.device_free_gib:g} GiB of free device memory")
    buckets = ranks * max(1, math.ceil(share / bucket))
    slots = max(1, min(slots, buckets))
    bcast_bw = topo.broadcast_gbps if topo.nodes == 1 else min(topo.broadcast_gbps, topo.nic_gbps)
    received = model.total_bytes if slices is None else slices.most_bytes
    reloaded = model.tensors if slices is None else max(slices.tensors)
    stages = {"broadcast": 0.0 if ranks == 1 else received / (bcast_bw * GB),
              "reload": received / (cal.reload_gbps * GB) + reloaded * cal.per_tensor_s}
    if mode == "broadcast":
        stages["h2d"] = max(share / (topo.h2d_gbps * GB),
                            model.total_bytes / (topo.h2d_gbps * GB * min(slots, ranks)))
    else:
        stages["p2p"] = model.total_bytes / (topo.nic_gbps * GB)
        local = model.total_bytes if slices is None else slices.everywhere_bytes
        stages["broadcast"] = 0.0 if topo.devices_per_node == 1 else local / (topo.broadcast_gbps * GB)
    total_stages = sum(stages.values())
    longest = max(stages, key=stages.__getitem__)
    overlap = slots > 1
    update = cal.fixed_s + (stages[longest] + (total_stages - stages[longest]) / buckets if overlap else total_stages)
    return {
        "mode": mode, "ranks": ranks, "nodes": topo.nodes, "devices_per_node": topo.devices_per_node,
        "model_bytes": model.total_bytes, "tensors": model.tensors, "received_bytes_per_rank": received,
        "slices": None if slices is None else slices.to_json(),
        "bucket_bytes": bucket, "slots": slots, "buckets": buckets, "pipelined": overlap,
        "stages_s": {k: round(v, 6) for k, v in stages.items()}, "fixed_s": cal.fixed_s,
        "bottleneck": longest, "update_s": round(update, 6), "model_gbps": model.total_bytes / update / GB,
        "register_s": round(share / (cal.register_gbps * GB), 3),
        "host_bytes_per_rank": share, "host_bytes_per_node": share * topo.devices_per_node,
        "device_bytes_per_rank": bucket * slots,
        "staging": staging(model, topo, bucket * slots, stages["reload"], received),
        "calibration": asdict(cal), "topology": asdict(topo),
    }


def staging(model: ModelSpec, topo: Topology, ps_device_bytes: int, reload_s: float,
            staged_bytes: int | None = None) -> dict:
    """A staged update (stage while generating, commit under a pause): every engine worker holds a
    whole copy of the checkpoint (with slices: of its slices, ``staged_bytes``) until the commit. It
    fits in device memory when that copy and the PS's IPC buffer fit in ``mem_fraction`` of the
    free device memory; else it goes to pinned host memory on the engine's side, and the commit
    adds a host-to-device pass of every staged byte."""
    staged = model.total_bytes if staged_bytes is None else staged_bytes
    room = int(topo.device_free_gib * GiB * topo.mem_fraction) - ps_device_bytes
    fits = staged <= room
    commit = reload_s + (0.0 if fits else staged / (topo.h2d_gbps * GB))
    return {"bytes_per_worker": staged, "device_room_bytes": max(room, 0), "fits_device": fits,
            "where": "device" if fits else "pinned host", "commit_s": round(commit, 6)}


def calibrate(run: dict, *, base: Calibration = Calibration()) -> Calibration:
    """Fit ``fixed_s``, ``per_tensor_s`` and ``register_gbps`` on a benchmark JSON (update_bench.py).

    ``fixed_s`` comes from the smallest case, ``per_tensor_s`` from the case with the most
    tensors (:func:`fit_per_tensor`: the cost that makes the prediction equal its measured update).
    """
    cases = run.get("cases") or []
    if not cases:
        raise ConfigError("the benchmark run has no cases")
    topo = topology_of(run)
    tiny = min(cases, key=lambda c: c["bytes"])
    fixed = max(0.0, tiny["update"]["best_s"] - predict(_spec(tiny), topo, cal=replace(base, fixed_s=0.0))["update_s"])
    many = max(cases, key=lambda c: c["tensors"])
    per_tensor = fit_per_tensor(_spec(many), topo, many["update"]["best_s"], replace(base, fixed_s=fixed))
    reg = [max(c["share_bytes"]) / c["register_s"] for c in cases if c.get("register_s") and c["bytes"] > 1 << 30]
    return replace(base, fixed_s=round(fixed, 4), per_tensor_s=float(f"{per_tensor:.3g}"),
                   register_gbps=round(min(reg) / GB, 2) if reg else base.register_gbps)


def fit_per_tensor(model: ModelSpec, topo: Topology, measured_s: float, cal: Calibration = Calibration()) -> float:
    """The engine-side cost per tensor with which :func:`predict` gives ``measured_s`` for ``model`` on
    ``topo`` (bisection: the prediction grows with it). It sits in the reload stage, which overlaps
    the others bucket by bucket, so it shows in the update only once the reload is the longest stage;
    0 when the prediction without it already reaches ``measured_s``."""
    def at(per_tensor: float) -> float:
        return predict(model, topo, cal=replace(cal, per_tensor_s=per_tensor))["update_s"]

    if at(0.0) >= measured_s:
        return 0.0
    low, high = 0.0, 1e-6
    while at(high) < measured_s:
        low, high = high, high * 2
        if high > 1.0:
            raise ConfigError(f"no per-tensor cost gives {measured_s} s for {model.tensors} tensors")
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if at(mid) < measured_s else (low, mid)
    return (low + high) / 2


def topology_of(run: dict) -> Topology:
    """The single-node topology a benchmark JSON measured (its ceilings and memory limit)."""
    meta, ceil = run["meta"], run.get("ceilings") or {}
    h2d = ceil.get("h2d_gbps") or [Topology.h2d_gbps]
    free = meta.get("free_mem_gib") or (meta.get("device_memory_bytes", 0) / GiB) or Topology.device_free_gib
    return Topology(nodes=1, devices_per_node=meta["world_size"], h2d_gbps=sum(h2d) / len(h2d),
                    broadcast_gbps=ceil.get("broadcast_gbps") or Topology.broadcast_gbps, device_free_gib=free)


def _spec(case: dict) -> ModelSpec:
    # Benchmark cases split evenly; their largest tensor is the embedding (or an expert), well under a bucket.
    return ModelSpec(case["bytes"], case["tensors"], case.get("largest_tensor") or max(1, case["bytes"] // 16))


# ------------------------------------------------------------------------------------ host memory
def check_host_memory(needed_bytes: int, available_bytes: int | None, *, what: str = "this registration") -> None:
    """ConfigError unless ``needed_bytes`` of new host memory fit in ``available_bytes`` (None: unknown,
    nothing is checked). Pure; :func:`host_memory_available` measures the second argument. Checked before
    a registration allocates, so that a checkpoint too large for the host is a clear refusal up front
    rather than ``OSError: Cannot allocate memory`` halfway through (or the kernel's OOM killer)."""
    if available_bytes is None or needed_bytes <= available_bytes:
        return
    raise ConfigError(f"{what} needs {needed_bytes / GiB:.2f} GiB of new host memory but only "
                      f"{available_bytes / GiB:.2f} GiB are available on this host (MemAvailable, and the "
                      "cgroup's limit where one is set): unregister a checkpoint, free host memory, or register "
                      "the files in place from /dev/shm")


def host_memory_available(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of host memory a new allocation can take: the kernel's MemAvailable, lowered to what this
    cgroup (v2) may still use when it has a limit (limit - usage + inactive page cache). None where
    neither can be read (not Linux)."""
    found = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{cgroup}/memory.max") as f:
            limit = f.read().strip()
        with open(f"{cgroup}/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            # usage counts the page cache; its inactive part is reclaimed on demand (kubelet's working set)
            with open(f"{cgroup}/memory.stat") as f:
                stat = dict(line.split() for line in f if line.count(" ") == 1)
            found.append(max(0, int(limit) - current + int(stat.get("inactive_file", 0))))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
