"""Push a checkpoint into running SGLang servers: ``python -m ckpt_sglang.update``.

Same flags and defaults as SGLang's own launcher (``sglang.srt.checkpoint_engine.update``), so
switching is a module name::

    python -m sglang.launch_server --model-path DIR --tp 8 --port 19730 --load-format dummy \\
        --checkpoint-engine-wait-weights-before-ready
    python -m ckpt_sglang.update --checkpoint-path DIR --inference-parallel-size 8

Without ``RANK`` in the environment it re-executes itself under torchrun with
``--inference-parallel-size`` processes on this host. Each rank registers its share of the
checkpoint's files; the first rank of each inference group (ranks ``[k*n, (k+1)*n)``) waits
for its server (``GET /model_info``) and posts ``/update_weights_from_ipc`` with its group's
handles; the PS speaks the stock wire that SGLang's embedded worker expects.

P2P (the ``p2p`` extra, Mooncake; docs/p2p.md): ``--update-method p2p`` makes every rank pull
the checkpoint from the owners' host memory, ``all`` broadcasts then pulls. Owners started with
``--save-metas-file m.json --sleep-time 600`` keep the checkpoint registered; a joining launcher
with ``--load-metas-file m.json`` (no ``--checkpoint-path``) registers nothing and pulls it into
its own server (``ckpt_core/engines/driver.py`` holds this flow, shared with examples/vllm_update.py).
Rank 0 prints one JSON line of figures per update, as soon as that update ends.

Staged (the server started with ``--custom-weight-loader ckpt_sglang.staging.load``):
``--stage --weight-version v8`` receives the checkpoint into the servers' staging areas while
they keep generating; ``--commit`` then switches each server to it in one short pause (rank 0
prints a JSON line with ``"method": "commit"`` and the pause). ``--commit --weight-version v8``
without ``--checkpoint-path`` only commits what an earlier ``--stage`` left staged.

Deltas (docs/deltas.md, "SGLang"; the server runs our loader): ``--deltas`` loads the checkpoint whole
through our loader and keeps what later deltas need, its version the checkpoint's name. A later run
with ``--base A --base-checkpoint-path DIR_A`` registers A (not sent) and the checkpoint with base A,
and sends only their delta (``--delta-mode fallback``, the default: the whole checkpoint when the
server does not hold A; ``strict``: refused). Broadcast only; with ``--stage`` the delta is staged
and ``--commit`` applies it.

Direct (``--via loader``, or ``--via auto`` where the server runs our loader): a plain update loads
through our loader's ``load`` op instead of SGLang's IPC route (docs/sglang.md); a server started
with ``--checkpoint-engine-wait-weights-before-ready`` still gets its first weights through the IPC
route under ``auto``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

from ckpt_core import ParameterServer, split_checkpoint_files
from ckpt_core.delta.versions import accepts_deltas
from ckpt_core.engines import GIB_OR_NONE, MAX_DEVICES, SECONDS, TIMEOUT, count
from ckpt_core.engines.base import Prechecked
from ckpt_core.engines.driver import (
    UPDATE_METHODS,
    emit_json_line,
    prepare_checkpoint,
    run_updates,
    serves_p2p,
    update_methods,
)
from ckpt_core.errors import CkptError, ConfigError
from ckpt_core.wire.stock import WIRES

from .client import BUSY_MODES, COMMIT_PAUSE_MODES, PAUSE_MODES, SglangClient

log = logging.getLogger("ckpt_sglang.update")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ckpt_sglang.update", description=__doc__.splitlines()[0])
    # SGLang's launcher flags, same defaults
    ap.add_argument("--checkpoint-path", default=None, help="directory of safetensors files (an HF checkpoint)")
    ap.add_argument("--save-metas-file", default=None, help="rank 0 writes the gathered metas here (JSON)")
    ap.add_argument("--load-metas-file", default=None,
                    help="join: register nothing, load these metas and pull the checkpoint from its owners (P2P)")
    ap.add_argument("--sleep-time", type=SECONDS, default=0,
                    help="seconds to keep the checkpoint registered after the updates (owners serving joiners)")
    ap.add_argument("--endpoint", default="http://localhost:19730", help="the SGLang server of this host")
    ap.add_argument("--inference-parallel-size", type=count(MAX_DEVICES), default=8,
                    help="devices of one SGLang server")
    ap.add_argument("--checkpoint-name", default="my-checkpoint-iter-0")
    ap.add_argument("--update-method", choices=UPDATE_METHODS, default="broadcast",
                    help="p2p: pull from the owners' host memory (Mooncake, the p2p extra); all: broadcast, then p2p")
    ap.add_argument("--uds", default=None, help="talk HTTP over this Unix socket")
    ap.add_argument("--weight-version", "--version", dest="weight_version", default=None,
                    help="version string the server reports afterwards (with --stage: the staged version)")
    # ckpt-engine additions
    ap.add_argument("--wire", choices=[w for w in WIRES if w != "native"], default="stock",
                    help="stock worker generation embedded in the server: 'stock' (checkpoint-engine >= 0.4), "
                         "'stock-0.3' (0.2.1-0.3.4)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    ap.add_argument("--timeout", type=TIMEOUT, default=600.0, help="seconds for the whole update")
    ap.add_argument("--ready-timeout", type=TIMEOUT, default=300.0, help="seconds to wait for the server")
    ap.add_argument("--pause", choices=PAUSE_MODES, default=None, help="pause generation around the update")
    ap.add_argument("--busy", choices=BUSY_MODES, default="retract",
                    help="requests in flight kept the cache from being flushed: pause this way, flush, "
                         "continue ('fail': raise)")
    ap.add_argument("--via", choices=("auto", "loader", "ipc"), default="auto",
                    help="how a plain update loads: 'loader' through our loader (--custom-weight-loader "
                         "ckpt_sglang.staging.load on the server), 'ipc' through SGLang's /update_weights_from_ipc; "
                         "'auto': the loader where the server runs it, except for a server's first weights")
    ap.add_argument("--stage", action="store_true",
                    help="stage the checkpoint as --weight-version while the servers keep generating "
                         "(needs --custom-weight-loader ckpt_sglang.staging.load on the server)")
    ap.add_argument("--stage-device-gib", type=GIB_OR_NONE, default=0.0,
                    help="with --stage: device memory each server rank may stage into (beyond it: pinned host memory)")
    ap.add_argument("--commit", action="store_true",
                    help="switch the servers to the staged --weight-version in one short pause (after --stage, "
                         "or alone: what an earlier --stage left)")
    ap.add_argument("--commit-pause", choices=COMMIT_PAUSE_MODES, default="retract",
                    help="how --commit pauses generation (no request is dropped)")
    ap.add_argument("--deltas", action="store_true",
                    help="load through our loader and keep what later deltas need (the version: --checkpoint-name)")
    ap.add_argument("--base", default=None,
                    help="send only the delta against this version (registered from --base-checkpoint-path, not "
                         "sent), which the servers hold from an update with --deltas; implies --deltas")
    ap.add_argument("--base-checkpoint-path", default=None, help="the files of --base (as --checkpoint-path)")
    ap.add_argument("--delta-mode", choices=("fallback", "strict"), default="fallback",
                    help="with --base: a server that does not hold the base gets the checkpoint whole (fallback) or "
                         "the update fails with DeltaBaseError (strict)")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Refuse what cannot work before any process group or server is touched."""
    if (args.stage or args.commit) and not (args.weight_version or args.deltas or args.base):
        raise ConfigError("--stage and --commit need --weight-version (the version staged and committed)")
    if (args.stage or args.commit) and args.via != "auto":
        raise ConfigError("--via chooses how a plain update loads: --stage and --commit always use our loader")
    if args.stage and args.pause is not None:
        raise ConfigError("--stage takes no --pause: the servers keep generating while it stages; --commit pauses")
    commit_only = args.commit and not args.stage
    if commit_only and (args.checkpoint_path or args.load_metas_file):
        raise ConfigError("--commit without --stage moves no checkpoint: drop --checkpoint-path/--load-metas-file, "
                          "or add --stage")
    if not commit_only and not args.checkpoint_path and not args.load_metas_file:
        raise ConfigError("--checkpoint-path (or --load-metas-file, to join) is required")
    if (args.base is None) != (args.base_checkpoint_path is None):
        raise ConfigError("--base and --base-checkpoint-path go together (the base's name and its files)")
    if args.deltas or args.base is not None:
        if args.via == "ipc":
            raise ConfigError("--deltas and --base load through our loader: not with --via ipc")
        if args.update_method != "broadcast" or args.load_metas_file:
            raise ConfigError("--deltas and --base go by broadcast: not with --update-method p2p/all or "
                              "--load-metas-file")
        if args.weight_version and args.weight_version != args.checkpoint_name:
            raise ConfigError("with --deltas the version the servers hold is the checkpoint's name (a delta names its "
                              f"base by it): drop --weight-version or make it {args.checkpoint_name!r}")
    n = args.inference_parallel_size
    if n <= 0 or world_size % n:
        raise ConfigError(f"world size {world_size} is not a multiple of --inference-parallel-size {n}")


def make_req_func(client: SglangClient | None, rank: int, n: int, args: argparse.Namespace, reports: list):
    """The reference's req_func contract: it runs on every rank; the first rank of each group of ``n``
    posts that group's handles to its own server, the others return at once. That rank's
    ``precheck`` asks its server whether its model can be reloaded at all, so a refusal (FP8 per
    tensor, ...) is one ``ConfigError`` on every rank before anything moves."""
    deltas = bool(args.deltas or args.base is not None)

    def req_func(handles):
        if client is None:
            return None
        first = rank - rank % n
        mine = handles[first:first + n]
        if args.stage:
            reports.append(client.stage(mine, args.weight_version, timeout=args.timeout,
                                        device_bytes=int(args.stage_device_gib * (1 << 30)), deltas=deltas))
        else:
            reports.append(client.update(mine, weight_version=args.weight_version, timeout=args.timeout,
                                         pause=args.pause, busy=args.busy,
                                         via=None if args.via == "auto" else args.via, deltas=deltas))
        return reports[-1]
    out = req_func if client is None else Prechecked(req_func, client.check_reloadable)
    return accepts_deltas(out) if deltas else out   # every rank's: the first of each group posts to our loader


def torchrun_command(argv: list[str], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--module", "ckpt_sglang.update", *argv]


def run_torchrun(cmd: list[str]) -> int:
    """torchrun in a child process; a SIGTERM to this launcher is passed on to it (torchrun passes it
    to its ranks), so stopping the launcher stops its ranks: an owner sleeping ``--sleep-time``
    with its checkpoint registered would otherwise live on, orphaned. (Ctrl-C reaches the whole
    foreground process group by itself.)"""
    proc = subprocess.Popen(cmd)
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: proc.send_signal(signum))
    try:
        return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> None:
    """One rank's work: prepare the checkpoint, run the updates (rank 0 prints each one's figures)."""
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    check_args(args, world_size)
    n = args.inference_parallel_size
    client = SglangClient(args.endpoint, uds=args.uds, timeout=args.timeout) if rank % n == 0 else None
    try:
        if client is not None:
            waited = client.wait_ready(timeout=args.ready_timeout)
            log.info("rank %d: %s answers /model_info (waited %.1f s)", rank, client.where, waited)
        if args.commit and not args.stage:
            commit(client, rank, args)
            return
        if (args.deltas or args.base is not None) and not args.weight_version:
            args.weight_version = args.checkpoint_name
        files = None if args.load_metas_file else split_checkpoint_files(args.checkpoint_path, rank, world_size)
        if args.base is not None:
            delta(client, rank, world_size, files, args)
            return
        serve = serves_p2p(args.update_method, joining=bool(args.load_metas_file), save_metas_file=args.save_metas_file)
        with ParameterServer(device=args.device, wire=args.wire, serve_p2p=serve) as ps:
            register_s = prepare_checkpoint(ps, args.checkpoint_name, files=files, load_metas_file=args.load_metas_file,
                                            save_metas_file=args.save_metas_file)
            methods = update_methods(args.update_method, joining=bool(args.load_metas_file))
            make = lambda reports: make_req_func(client, ps.rank, n, args, reports)   # noqa: E731
            for method, result, reports in run_updates(ps, args.checkpoint_name, methods, make, timeout=args.timeout):
                if ps.rank == 0:   # as soon as it ends: a joiner may wait for the owners' updates
                    emit_json_line({"checkpoint": args.checkpoint_name, "method": method,
                                    "register_and_gather_s": round(register_s, 4), "ps": result,
                                    "engine": [r.__dict__ for r in reports]}, default=str)
            if args.commit:   # every rank's update returned: every server holds the version staged
                commit(client, ps.rank, args)
            if args.sleep_time > 0:
                time.sleep(args.sleep_time)
    finally:
        if client is not None:
            client.close()


def delta(client: SglangClient | None, rank: int, world_size: int, files: list[str] | None,
          args: argparse.Namespace) -> None:
    """``--base``: register the base (not sent) and the checkpoint against it, send the delta."""
    n = args.inference_parallel_size
    base_files = split_checkpoint_files(args.base_checkpoint_path, rank, world_size)
    with ParameterServer(device=args.device, wire=args.wire) as ps:
        t0 = time.perf_counter()
        ps.register_checkpoint(args.base, files=base_files)
        ps.gather_metas(args.base)
        ps.register_checkpoint(args.checkpoint_name, files=files, base=args.base)
        ps.gather_metas(args.checkpoint_name)
        register_s = time.perf_counter() - t0
        reports: list = []
        result = ps.update(args.checkpoint_name, make_req_func(client, ps.rank, n, args, reports),
                           timeout=args.timeout, delta="fallback" if args.delta_mode == "fallback" else True)
        if ps.rank == 0:
            emit_json_line({"checkpoint": args.checkpoint_name, "method": "delta", "base": args.base,
                            "register_and_gather_s": round(register_s, 4), "ps": result,
                            "engine": [r.__dict__ for r in reports]}, default=str)
        if args.commit:
            commit(client, ps.rank, args)


def commit(client: SglangClient | None, rank: int, args: argparse.Namespace) -> None:
    """The first rank of each inference group switches its server to the staged version."""
    if client is None:
        return
    report = client.commit(args.weight_version, pause=args.commit_pause, timeout=args.timeout)
    if rank == 0:
        emit_json_line({"checkpoint": args.checkpoint_name, "method": "commit", "version": args.weight_version,
                        "paused_ms": round(report.seconds["paused"] * 1e3, 3), "engine": [report.__dict__]},
                       default=str)


def say_error(line: str) -> None:
    """One line to stderr in one write: the ranks share the stream and run unbuffered (torchrun's
    ``python -u``), where ``print`` writes the text and the newline apart and two ranks' lines merge."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:   # refuse bad flags before starting processes (under torchrun: world size = the group's size)
        check_args(args, int(os.environ.get("WORLD_SIZE", args.inference_parallel_size)))
    except ConfigError as exc:
        say_error(f"ckpt_sglang.update: ConfigError: {exc}")
        return 2
    if os.environ.get("RANK") is None:
        # Like SGLang's launcher: one process per device of the server, on this host.
        cpus = os.cpu_count() or 1
        if args.inference_parallel_size > cpus:
            print(f"ckpt_sglang.update: ConfigError: --inference-parallel-size {args.inference_parallel_size} "
                  f"would start that many processes on this host of {cpus} CPUs (run it under torchrun "
                  "yourself to spread the ranks over hosts)", file=sys.stderr, flush=True)
            return 2
        cmd = torchrun_command(argv, args.inference_parallel_size)
        print("running: " + " ".join(cmd), file=sys.stderr, flush=True)
        return run_torchrun(cmd)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(args)
    except CkptError as exc:
        say_error(f"ckpt_sglang.update: {type(exc).__name__}: {exc}")
        return 2 if isinstance(exc, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
