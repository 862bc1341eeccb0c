"""Push a checkpoint from parameter-server ranks into running vLLM servers (torchrun driver).

One PS rank per device of the engines, on the same host as its device; every rank registers its
share of the checkpoint's safetensors files. ``req_func`` runs on every rank; as in
checkpoint-engine's examples/update.py, the first rank of each inference group (ranks
``[g*n, (g+1)*n)`` for ``--inference-parallel-size n``) posts its group's handles to its own
engine::

    torchrun --nproc-per-node 8 examples/vllm_update.py --checkpoint-path /ckpt/step-7 \\
        --endpoint http://127.0.0.1:8000 --inference-parallel-size 8

With k engines (``world size = k * n``), ``--endpoint`` and ``--uds`` take either one value, used
by every group (each node's own ``localhost``), or k comma-separated values, one per group (two
engines on one node, each on its own port or Unix socket: only its group's first rank needs to
reach it). The vLLM servers must run with ``VLLM_SERVER_DEV_MODE=1`` and
``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension`` (``--path extension``, the
default) or ``--weight-transfer-config '{"backend": "ckpt"}'`` (``--path backend``). The first
rank of each group prints one JSON line per update: its timings and its engine's report.

P2P (the ``p2p`` extra, Mooncake): ``--update-method p2p`` makes every rank pull the checkpoint
from the owners' host memory instead of broadcasting it (``all``: broadcast, then p2p). Owners
started with ``--save-metas-file m.json --sleep-time 600`` keep serving; a separate, joining
torchrun world started with ``--load-metas-file m.json`` (no ``--checkpoint-path``) registers
nothing and pulls the checkpoint into its own engines. Owners serve their host memory over P2P
only with ``p2p``/``all`` or ``--save-metas-file`` (``serve_p2p``; who can then reach it: docs/p2p.md).

Versions and staged updates (``--path extension``): ``--version v8`` names the weights an update
makes live (the workers record it; vLLM's ``/update_weight_version`` where the server has it).
``--stage --version v8`` receives the checkpoint into every worker's staging area while the
servers keep generating; ``--commit`` then switches each server to it in one short pause
(``--commit-pause keep``: running requests freeze and continue on the new weights) and prints a
line with ``"method": "commit"``. ``--commit --version v8`` without a checkpoint only commits what
an earlier ``--stage`` left staged.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from ckpt_core import ConfigError, ParameterServer, split_checkpoint_files
from ckpt_core.engines import (GIB_OR_NONE, MAX_DEVICES, SECONDS, TIMEOUT, UPDATE_METHODS, count, emit_json_line,
                               group_handles, prepare_checkpoint, run_updates, serves_p2p, slices_wanted, update_methods)
from ckpt_core.planning import write_plan_file
from ckpt_vllm import VllmClient


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-path", help="directory of safetensors files (an HF checkpoint)")
    ap.add_argument("--checkpoint-name", default="my-checkpoint-iter-0")
    ap.add_argument("--update-method", choices=UPDATE_METHODS, default="broadcast",
                    help="broadcast from every rank's share; p2p: every rank pulls from the owners' host "
                         "memory (Mooncake, the p2p extra); all: broadcast, then p2p")
    ap.add_argument("--inference-parallel-size", type=count(MAX_DEVICES), default=None,
                    help="devices of one engine (default: the world size)")
    ap.add_argument("--endpoint", default="http://localhost:19730",
                    help="vLLM server URL: one for every group, or comma-separated, one per group")
    ap.add_argument("--uds", default=None,
                    help="talk HTTP over this Unix socket: one for every group, or one per group")
    ap.add_argument("--save-metas-file", default=None, help="rank 0 writes the gathered metas here (JSON)")
    ap.add_argument("--load-metas-file", default=None,
                    help="join: register nothing, load these metas and pull the checkpoint from its owners (P2P)")
    ap.add_argument("--sleep-time", type=SECONDS, default=0.0,
                    help="seconds to keep the checkpoint registered after the update (owners serving joiners)")
    # ckpt-engine additions
    ap.add_argument("--path", choices=("extension", "backend"), default="extension",
                    help="worker extension (/collective_rpc) or the ckpt weight-transfer backend")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    ap.add_argument("--timeout", type=TIMEOUT, default=600.0, help="seconds for the whole update")
    ap.add_argument("--ready-timeout", type=TIMEOUT, default=300.0, help="seconds to wait for the servers")
    ap.add_argument("--pause", choices=("abort", "wait", "keep"), default=None,
                    help="pause generation around the update (default: keep serving)")
    ap.add_argument("--version", default=None, help="the weight version the update makes live (with --stage: stages)")
    ap.add_argument("--stage", action="store_true",
                    help="stage the checkpoint as --version while the servers keep generating")
    ap.add_argument("--prepare", action="store_true",
                    help="with --stage: also turn the staged weights into kernel format between engine steps "
                         "(the commit is then one device copy where the model allows; docs/vllm.md)")
    ap.add_argument("--stage-device-gib", type=GIB_OR_NONE, default=0.0,
                    help="with --stage: device memory each worker may stage into (beyond it: pinned host memory)")
    ap.add_argument("--commit", action="store_true",
                    help="switch the servers to the staged --version in one short pause (after --stage, or alone)")
    ap.add_argument("--commit-pause", choices=("keep", "wait", "abort"), default="keep",
                    help="how --commit pauses generation")
    ap.add_argument("--slices", action="store_true",
                    help="send each engine rank only the slices its loaders read (one engine, recorded "
                         "from it first; broadcast and P2P updates, either path, staged or not)")
    ap.add_argument("--direct", action="store_true",
                    help="copy the tensors of layers that read them verbatim straight into the live model, once the "
                         "engine recorded this plan (its first --direct update reloads and records; docs/vllm.md)")
    ap.add_argument("--save-slice-plan", metavar="FILE",
                    help="with --slices: rank 0 writes the recorded plan there (JSON; `ckpt-engine plan "
                         "--slices-plan FILE` predicts other topologies from it)")
    return ap.parse_args(argv)


def _per_group(flag: str, value: str | None, groups: int) -> list[str | None]:
    """One value per inference group: a single value is shared, else exactly ``groups`` values."""
    if value is None:
        return [None] * groups
    values = [v.strip() for v in value.split(",") if v.strip()]
    if len(values) == 1:
        return values * groups
    if len(values) != groups:
        raise ConfigError(f"{groups} engine(s) need one {flag} or {groups} comma-separated ones, "
                          f"got {len(values)}: {values}")
    return values


def check_args(args: argparse.Namespace, world_size: int) -> tuple[int, list[str], list[str | None]]:
    """Validate flags before any collective or wait; returns the group size and, per group, the
    engine's endpoint and Unix socket."""
    if (args.stage or args.commit) and not args.version:
        raise ConfigError("--stage and --commit need --version (the version staged and committed)")
    if args.stage and (args.pause is not None or args.path != "extension"):
        raise ConfigError("--stage takes the extension path and no --pause: the servers keep generating while it "
                          "stages; --commit pauses")
    if args.save_slice_plan and not args.slices:
        raise ConfigError("--save-slice-plan needs --slices (the plan is recorded from the engine for a sliced update)")
    if args.prepare and not args.stage:
        raise ConfigError("--prepare applies to --stage")
    commit_only = args.commit and not args.stage
    if commit_only and (args.checkpoint_path or args.load_metas_file):
        raise ConfigError("--commit without --stage moves no checkpoint: drop --checkpoint-path/--load-metas-file, "
                          "or add --stage")
    if not commit_only and not args.checkpoint_path and not args.load_metas_file:
        raise ConfigError("--checkpoint-path (or --load-metas-file, to join) is required")
    ips = world_size if args.inference_parallel_size is None else args.inference_parallel_size
    if ips <= 0 or world_size % ips:
        raise ConfigError(f"--inference-parallel-size must be a positive divisor of the world size "
                          f"{world_size}, got {args.inference_parallel_size}")
    groups = world_size // ips
    if args.slices and groups != 1:
        raise ConfigError("--slices takes one engine here (replicas of it: ParameterServer.update(..., slices=plan) "
                          "with every engine's plan installed, docs/architecture.md, Slices)")
    return ips, _per_group("--endpoint", args.endpoint, groups), _per_group("--uds", args.uds, groups)


def make_req_func(client: VllmClient | None, rank: int, ips: int, args: argparse.Namespace, reports: list,
                  slices: str | None = None):
    """Every rank's req_func: the first rank of each group posts its group's handles to its engine."""
    def req_func(handles):
        mine = group_handles(handles, rank, ips)
        if mine is not None:
            reports.append(client.update(mine, path=args.path, timeout=args.timeout, pause=args.pause,
                                         version=None if args.stage else args.version,
                                         stage=args.version if args.stage else None,
                                         stage_device_bytes=int(args.stage_device_gib * (1 << 30)),
                                         prepare=args.prepare,
                                         **({"slices": slices} if slices else {}),
                                         **({"direct": True} if args.direct else {})))
    return req_func


def commit(client: VllmClient | None, rank: int, group: int, args: argparse.Namespace) -> None:
    """The first rank of each group switches its engine to the staged version and prints the pause."""
    if client is None:
        return
    report = client.commit(args.version, pause=args.commit_pause, timeout=args.timeout)
    emit_json_line({"checkpoint": args.checkpoint_name, "method": "commit", "rank": rank, "group": group,
                    "version": args.version, "paused_ms": round(report.seconds["paused"] * 1e3, 3),
                    "engines": [report.__dict__]})


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    ips, endpoints, socks = check_args(args, world_size)
    if not slices_wanted(args.slices, logging.getLogger("vllm_update")):   # the operator's switch wins over --slices
        args.slices, args.save_slice_plan = False, None
    # A missing or empty checkpoint directory is reported now, not after waiting for the servers.
    commit_only = args.commit and not args.stage
    files = None if args.load_metas_file or commit_only else split_checkpoint_files(args.checkpoint_path, rank,
                                                                                      world_size)
    group, leader = rank // ips, rank % ips == 0
    client = VllmClient(endpoints[group], uds=socks[group], timeout=args.timeout) if leader else None
    try:
        if client is not None:
            client.wait_ready(timeout=args.ready_timeout)
        if commit_only:
            commit(client, rank, group, args)
            return 0
        serve = serves_p2p(args.update_method, joining=bool(args.load_metas_file), save_metas_file=args.save_metas_file)
        with ParameterServer(device=args.device, serve_p2p=serve) as ps:   # owners serve P2P only when asked
            t_register = prepare_checkpoint(ps, args.checkpoint_name, files=files, load_metas_file=args.load_metas_file,
                                            save_metas_file=args.save_metas_file)
            methods = update_methods(args.update_method, joining=bool(args.load_metas_file))
            plan = None
            if args.slices:   # recorded from the engine by rank 0, shared with every rank
                recorded = client.slice_plan(ps.tensor_specs(args.checkpoint_name)) if ps.rank == 0 else None
                plan = ps.share_slice_plan(recorded)
                if args.save_slice_plan and ps.rank == 0:   # for `ckpt-engine plan --slices-plan FILE`
                    write_plan_file(args.save_slice_plan, plan)
            make = lambda reports: make_req_func(client, ps.rank, ips, args, reports,   # noqa: E731
                                                 plan.digest if plan else None)
            for method, result, reports in run_updates(ps, args.checkpoint_name, methods, make, timeout=args.timeout,
                                                       slices=plan):
                if leader:
                    emit_json_line({"checkpoint": args.checkpoint_name, "method": method, "rank": ps.rank,
                                    "group": group, "register_and_gather_s": round(t_register, 4),
                                    "ps": result, "engines": [r.__dict__ for r in reports]})
            if args.commit:   # every rank's update returned: every engine holds the version staged
                commit(client, ps.rank, group, args)
            if args.sleep_time > 0:
                time.sleep(args.sleep_time)
    finally:
        if client is not None:
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
