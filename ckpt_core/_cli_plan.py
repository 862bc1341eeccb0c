"""``ckpt-engine plan``: predicted update time and memory for a model on a topology, with and without
slices (``planning/capacity.py``, ``planning/slice_estimate.py``)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from ckpt_core._cli_args import GIB, MAX_DEVICES, MAX_NODES, MAX_SLOTS, MAX_TENSORS, MIB, RATE, count, number, renamed
from ckpt_core.errors import ConfigError

GiB = float(1 << 30)
GBPS_WHY = "the value is GB/s, gigabytes per second, not Gb/s"
# vLLM 0.26's layerwise reload of 15.23 GB of staged bf16 tensors in 0.122 s on one H200
# (benchmarks/results/2026-12-01-1xH200-40ab867-vllm026-7b-stage-commit.json, commit_phases.load).
REAL_VLLM_RELOAD_GBPS = 125.0


def model_config(path: str) -> dict:
    """The ``config.json`` beside a checkpoint ({} when there is none)."""
    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    config_path = os.path.join(where, "config.json")
    if not os.path.exists(config_path):
        return {}
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_path!r}: {exc}") from exc
    # Multimodal and some MoE configs keep the language model's numbers in text_config.
    return {**config, **(config.get("text_config") or {})} if isinstance(config, dict) else {}


def slice_load(args, spec, tensors: list[tuple] | None):
    """What each engine rank receives with slices: a recorded plan (exact), else an estimate from the
    checkpoint (``--model``), else ``--sharded-fraction`` of the bytes split over ``--slices-tp``."""
    from ckpt_core.planning import slice_estimate
    from ckpt_core.planning.slice_json import read_plan_file
    if args.slices_plan:
        plan = read_plan_file(args.slices_plan)
        if args.slices_tp and args.slices_tp != len(plan.ranks):
            raise ConfigError(f"--slices-tp {args.slices_tp} but the plan {args.slices_plan!r} has "
                              f"{len(plan.ranks)} engine ranks")
        return slice_estimate.from_plan(plan)
    if not args.slices_tp:
        return None
    if tensors is not None and args.sharded_fraction is None:
        shapes = {t[0]: (t[2], t[5]) for t in tensors}
        return slice_estimate.estimate(shapes, model_config(args.model), args.slices_tp, ep=args.slices_ep)
    if args.slices_ep:
        raise ConfigError("--slices-ep needs the checkpoint (--model DIR: which tensors are experts, and how many)")
    fraction = 0.98 if args.sharded_fraction is None else args.sharded_fraction
    return slice_estimate.from_fraction(spec.total_bytes, spec.tensors, args.slices_tp, fraction)


def plan_report(args, tensors: list[tuple] | None) -> tuple[dict, str]:
    """The prediction of ``ckpt-engine plan`` as its JSON document and its text. ``tensors``: the
    checkpoint's (``cli.checkpoint_tensors``) with ``--model``; else None."""
    from ckpt_core.planning.capacity import Calibration, ModelSpec, Topology, h2d_default, predict
    cal = Calibration() if args.reload_gb_per_s is None else replace(Calibration(), reload_gbps=args.reload_gb_per_s)
    if tensors is not None:
        spec = ModelSpec(sum(t[3] for t in tensors), len(tensors), max((t[3] for t in tensors), default=0))
    elif args.size_gib and args.tensors:
        total = int(args.size_gib * GiB)
        largest = int(args.largest_mib * (1 << 20)) if args.largest_mib else max(total // args.tensors, total // 16)
        spec = ModelSpec(total, args.tensors, largest)
    else:
        raise ConfigError("give a model directory (--model DIR) or its size and tensor count (--size-gib, --tensors)")
    h2d = args.h2d_gb_per_s if args.h2d_gb_per_s is not None else h2d_default(args.devices)
    topo = Topology(nodes=args.nodes, devices_per_node=args.devices, h2d_gbps=h2d,
                    broadcast_gbps=args.d2d_gb_per_s, nic_gbps=args.nic_gb_per_s, device_free_gib=args.device_free_gib,
                    slots=args.slots, max_bucket_gib=args.max_bucket_gib)
    try:
        doc = predict(spec, topo, mode=args.mode, cal=cal)
    except ConfigError as exc:
        if tensors is None and not args.largest_mib:   # the size was guessed, not given
            raise ConfigError(f"{exc}; that largest tensor is a guess (1/16 of the model): give --largest-mib "
                              "(e.g. the embedding's size), or --model DIR") from exc
        raise
    load = slice_load(args, spec, tensors)
    if load is not None:
        doc["with_slices"] = predict(spec, topo, mode=args.mode, cal=cal, slices=load)
    delta_lines: list[str] = []
    if args.delta_density is not None:
        from ckpt_core.planning.delta_estimate import DeltaCalibration, delta_text, predict_delta
        dcal = DeltaCalibration()
        if args.delta_apply_gb_per_s is not None:
            dcal = replace(dcal, apply_gbps=args.delta_apply_gb_per_s)
        if args.delta_check_gb_per_s is not None:
            dcal = replace(dcal, digest_gbps=args.delta_check_gb_per_s)
        doc["with_delta"] = predict_delta(doc, args.delta_density, item_bytes=_item_bytes(tensors), cal=dcal)
        delta_lines = delta_text(doc["with_delta"])
    return doc, "\n".join([_text(args, spec, doc), *_slices_text(doc, load), *delta_lines])


def _item_bytes(tensors: list[tuple] | None) -> int:
    """Bytes per element of the checkpoint's largest share of bytes (bf16 without --model)."""
    if not tensors:
        return 2
    by_size: dict[int, int] = {}
    for t in tensors:   # (name, dtype, shape, nbytes, file, itemsize)
        by_size[t[5]] = by_size.get(t[5], 0) + t[3]
    return max(by_size, key=by_size.__getitem__)


def _text(args, spec, doc: dict) -> str:
    st = doc["stages_s"]
    return "\n".join([
        f"{doc['mode']} update of {spec.total_bytes / GiB:.2f} GiB ({spec.tensors} tensors) into "
        f"{args.nodes} node(s) x {args.devices} device(s):",
        *[f"  {k:>9}: {v:8.3f} s" for k, v in st.items()],
        f"  {'fixed':>9}: {doc['fixed_s']:8.3f} s",
        f"  update ~ {doc['update_s']:.3f} s ({doc['model_gbps']:.1f} GB/s of model bytes); bottleneck: "
        f"{doc['bottleneck']}{'' if doc['pipelined'] else ' (one slot: stages do not overlap)'}",
        f"  {doc['buckets']} buckets of <= {doc['bucket_bytes'] / (1 << 20):.0f} MiB, {doc['slots']} slot(s)",
        f"  memory per rank: host {doc['host_bytes_per_rank'] / GiB:.2f} GiB (pinned), device "
        f"{doc['device_bytes_per_rank'] / GiB:.2f} GiB; per node host {doc['host_bytes_per_node'] / GiB:.2f} GiB",
        f"  registration ~ {doc['register_s']:.2f} s per rank; calibrated on {doc['calibration']['source']}",
        f"  staged update: {doc['staging']['bytes_per_worker'] / GiB:.2f} GiB per engine worker "
        f"{'fits in' if doc['staging']['fits_device'] else 'does not fit in'} its device memory "
        f"({doc['staging']['device_room_bytes'] / GiB:.2f} GiB left beside the PS's buffer): staged in "
        f"{doc['staging']['where']} memory, commit (the pause) ~ {doc['staging']['commit_s']:.3f} s with the "
        "calibrated engine reload (a real vLLM's own reload adds its per-layer processing)"])


def _slices_text(doc: dict, load) -> list[str]:
    if load is None:
        return []
    sl = doc["with_slices"]
    stages = ", ".join(f"{k} {v:.3f} s" for k, v in sl["stages_s"].items())
    st = sl["staging"]
    return [f"  with slices (TP {load.tp}{', experts by EP' if load.ep else ''}, {load.source}): "
            f"{load.most_bytes / GiB:.2f} GiB received per rank, update ~ {sl['update_s']:.3f} s ({stages}); "
            f"staged in {st['where']} memory, commit ~ {st['commit_s']:.3f} s",
            f"    per engine rank: {', '.join(f'{b / GiB:.2f}' for b in load.received_bytes)} GiB; "
            f"{load.everywhere_bytes / GiB:.2f} GiB read whole by every rank"]


def plan_parser(sub, common) -> None:
    pl = sub.add_parser("plan", help="predict update time and memory for a model on a topology")
    common(pl, False)
    pl.add_argument("--model", help="checkpoint directory or file (else --size-gib and --tensors)")
    pl.add_argument("--size-gib", type=GIB)
    pl.add_argument("--tensors", type=count(MAX_TENSORS, "far more than any checkpoint holds"))
    pl.add_argument("--largest-mib", type=MIB, help="largest tensor (default: the larger of mean and 1/16)")
    pl.add_argument("--nodes", type=count(MAX_NODES), default=1)
    pl.add_argument("--devices", type=count(MAX_DEVICES), default=8, help="devices per node (default 8)")
    renamed(pl, "--h2d-gb-per-s", "--h2d-gbps", GBPS_WHY, type=RATE, default=None,
            help="host-to-device per device, GB/s (default: measured, 49.3 with 2 H200 copying, 55.4 for one alone)")
    renamed(pl, "--d2d-gb-per-s", "--d2d-gbps", GBPS_WHY, type=RATE, default=347.0,
            help="intra-node broadcast, GB/s (default 347: 2xH200 NVLink)")
    renamed(pl, "--nic-gb-per-s", "--nic-gbps", GBPS_WHY, type=RATE, default=50.0,
            help="per node, all NICs together, GB/s: gigaBYTES (default 50, i.e. one 400 Gb/s NIC)")
    pl.add_argument("--device-free-gib", type=GIB, default=16.0, help="free device memory per device (default 16)")
    pl.add_argument("--slots", type=count(MAX_SLOTS), default=4)
    pl.add_argument("--max-bucket-gib", type=GIB, default=8.0)
    pl.add_argument("--mode", choices=("broadcast", "p2p"), default="broadcast")
    pl.add_argument("--reload-gb-per-s", type=RATE, default=None,
                    help="the engine's reload rate per rank, GB/s (default: the calibrated device copy, 2125; a "
                         f"real vLLM 0.26's layerwise reload measured {REAL_VLLM_RELOAD_GBPS:g} for a 7B bf16 on one "
                         "H200: slices shorten it most)")
    pl.add_argument("--slices-tp", type=count(MAX_DEVICES), default=None,
                    help="also predict an update where each engine rank receives only its slices, for an "
                         "engine of this tensor-parallel size (with --model: estimated from the checkpoint's "
                         "names, shapes and config.json by vLLM's loader conventions)")
    pl.add_argument("--slices-ep", action="store_true",
                    help="with --slices-tp and --model: the experts under expert parallelism (vLLM's "
                         "--enable-expert-parallel): each rank holds 1/T of them whole")
    pl.add_argument("--slices-plan", metavar="FILE",
                    help="a slice plan recorded from the engine (JSON, examples/vllm_update.py --save-slice-plan): "
                         "exact figures per engine rank instead of an estimate")
    pl.add_argument("--sharded-fraction", type=number(float, low=0, low_open=False, high=1), default=None,
                    help="with --slices-tp: the fraction of the bytes split over the ranks, instead of the "
                         "checkpoint's estimate (default without --model: 0.98, a dense model whose KV heads "
                         "are not replicated)")
    pl.add_argument("--delta-density", type=number(float, low=0, low_open=False, high=1), default=None,
                    help="also predict a delta update (docs/deltas.md) at this fraction of changed elements "
                         "(measured: ~0.02 per AdamW step at lr 1e-6, ~0.12 at 1e-5)")
    pl.add_argument("--delta-apply-gb-per-s", type=RATE, default=None,
                    help="with --delta-density: the engine worker's decode-and-scatter rate per rank, GB/s of the "
                         "changed tensors' bytes (default: measured on a CPU worker, 0.43)")
    pl.add_argument("--delta-check-gb-per-s", type=RATE, default=None,
                    help="with --delta-density: the engine's post-apply digest rate per rank, GB/s (default: "
                         "the host SHA-256 measured, 0.43)")
