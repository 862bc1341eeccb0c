"""``ckpt-engine``: serve a parameter-server rank, inspect a checkpoint, plan a cluster, benchmark.

Exit codes (also with ``--json``, whose error form is ``{"error": {"type", "message"}}``):

| code | meaning |
|---|---|
| 0 | success |
| 1 | internal error (a bug: please report it) |
| 2 | bad command line (argparse) |
| 3 | ``CheckpointFormatError``: the checkpoint is malformed |
| 4 | ``ConfigError`` / ``CheckpointNotFoundError``: bad argument, setting or path |
| 5 | ``TransportError``, ``UpdateTimeoutError``, ``RemoteWorkerError``: a peer or the network failed |
| 6 | any other ``CkptError`` |
| 130 | interrupted (Ctrl-C) |
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import subprocess
import sys
from typing import Any

from ckpt_core._cli_args import COUNT, GIB, MAX_GIB, PID, PORT, nproc, number, renamed
from ckpt_core._cli_plan import plan_parser, plan_report
from ckpt_core.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CkptError,
    ConfigError,
    RemoteWorkerError,
    TransportError,
)

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_FORMAT, EXIT_CONFIG, EXIT_TRANSPORT, EXIT_OTHER = 0, 1, 2, 3, 4, 5, 6
GiB = float(1 << 30)
SERVE_WIRES = ("native", "stock", "stock-0.3")   # ckpt_core.wire.stock.WIRES, without importing torch here
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("ckpt-engine")
    except (ImportError, PackageNotFoundError):   # a source checkout that was not installed
        import re
        with open(os.path.join(REPO, "pyproject.toml")) as f:
            found = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
        return found.group(1) if found else "unknown"


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, CheckpointFormatError):
        return EXIT_FORMAT
    if isinstance(exc, (ConfigError, CheckpointNotFoundError)):
        return EXIT_CONFIG
    if isinstance(exc, (TransportError, RemoteWorkerError)):
        return EXIT_TRANSPORT
    return EXIT_OTHER if isinstance(exc, CkptError) else EXIT_INTERNAL


def _emit(args, doc: dict, text: str) -> None:
    print(json.dumps(doc, indent=2, default=str) if args.json else text)


# ------------------------------------------------------------------ serve
def socket_template(template: str | None) -> str:
    """The ``--uds`` template, checked before any memory is taken: only ``{rank}`` and ``{local_rank}``
    may be filled in (a typo such as ``{rnak}`` is a ConfigError naming it, not a KeyError)."""
    if template is None:
        from ckpt_core.service._runner import default_socket_dir
        return os.path.join(default_socket_dir(), "ps-{rank}.sock")
    try:
        template.format(rank=0, local_rank=0)
    except (KeyError, IndexError) as exc:
        raise ConfigError(f"--uds {template!r} names a field other than {{rank}} and {{local_rank}}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--uds {template!r} is not a valid template ({exc}); write a literal brace as "
                          "'{{' or '}}'") from None
    return template


def _check_port_offsets(args) -> None:
    """Local rank i listens on PORT+i: that must still be a port (checked before any memory is taken)."""
    from ckpt_core._settings import load_settings
    local = load_settings().local_rank   # the device index the ParameterServer takes (no gpu_count here)
    for option, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port and port + local > 65535:
            raise ConfigError(f"{option} {port}: local rank {local} would listen on {port + local}, past 65535")


def cmd_serve(args) -> int:
    from ckpt_core import ParameterServer
    from ckpt_core._settings import liveness, progress_log_s, service_token
    from ckpt_core.service import serve
    from ckpt_core.service._policy import ServicePolicy

    if args.parent_pid is not None:   # managed mode: never outlive the engine worker that started us
        from ckpt_core.engines.managed import watch_parent
        watch_parent(args.parent_pid)

    token = None
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --token-file {args.token_file!r}: {exc}") from exc
    token = token or service_token()
    tcp = args.host is not None or args.port is not None
    uds = None if tcp else socket_template(args.uds)   # before any memory is taken, like the policy
    liveness(), progress_log_s()                         # and the settings read later
    _check_port_offsets(args)
    policy = ServicePolicy.build(args.allow_dir, args.engine_url, args.engine_uds)
    ps = ParameterServer(device=args.device, max_bucket_gb=args.max_bucket_gib, mem_fraction=args.mem_fraction,
                         keep_device_buffers=args.keep_device_buffers, wire=args.wire,
                         serve_p2p=True if args.serve_p2p else None)   # None: PS_P2P_SERVE (off by default)
    idle = False
    try:
        from ckpt_core.ops.progress import LogProgress, TerminalProgress
        bar = TerminalProgress(f"rank {ps.rank}")
        if bar.enabled and ps.device_index == 0:
            ps.progress = bar   # one bar per host: torchrun ranks share the terminal
        else:   # production logs: a line when an operation starts, then one every CKPT_PROGRESS_LOG_S
            ps.progress = LogProgress(f"ps rank {ps.rank}/{ps.world_size}", every_s=0 if bar.enabled else None)
        metrics_port = (None if args.metrics_port is None
                        else args.metrics_port + (ps.device_index if args.metrics_port else 0))
        common = dict(token=token, log_level=args.uvicorn_log_level, policy=policy, metrics_port=metrics_port)
        if tcp:
            port = None if args.port is None else args.port + (ps.device_index if args.port else 0)
            idle = serve(ps, host=args.host or "127.0.0.1", port=port, **common)
        elif uds is not None:
            idle = serve(ps, uds=uds.format(rank=ps.rank, local_rank=ps.device_index), **common)
    finally:
        if not idle and sys.exc_info()[0] is None:
            # An operation is stuck (e.g. a collective whose peers are gone): closing would wait on it,
            # and so would the interpreter's exit. Leave now; the next PS on this host reclaims our
            # /dev/shm buffers (their names carry our pid).
            print(f"ckpt-engine serve: rank {ps.rank}: an operation is still running; exiting without "
                  "closing the parameter server", file=sys.stderr, flush=True)
            os._exit(EXIT_TRANSPORT)
        ps.close()
    return EXIT_OK


# ------------------------------------------------------------------ inspect
def _files_of(path: str) -> list[str]:
    from ckpt_core.checkpoint.hf_dir import checkpoint_files
    if os.path.isdir(path):
        return checkpoint_files(path)
    if not os.path.exists(path):
        raise ConfigError(f"no such file or directory: {path!r}")
    return [path]


def checkpoint_tensors(path: str) -> tuple[list[str], list[tuple]]:
    """The files of a safetensors file or HF directory and ``(name, dtype, shape, nbytes, file,
    itemsize)`` of every tensor in them, headers and index validated, each name once."""
    from ckpt_core.checkpoint.hf_dir import INDEX_NAME, check_index, read_index
    from ckpt_core.checkpoint.safetensors import read_header

    files, tensors, headers = _files_of(path), [], []
    for f in files:
        try:
            header = read_header(f)
        except OSError as exc:
            raise ConfigError(f"cannot read {f!r}: {exc}") from exc
        headers.append(header)
        tensors += [(e.name, str(e.dtype).removeprefix("torch."), tuple(e.shape), e.nbytes, f, e.dtype.itemsize)
                    for e in header.tensors]
    if os.path.isdir(path) and os.path.lexists(os.path.join(path, INDEX_NAME)):
        check_index(read_index(path), headers, os.path.join(path, INDEX_NAME))
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:5]
        raise CheckpointFormatError(f"tensor names appear in more than one file: {dup}", path=path)
    return files, tensors


def inspect_checkpoint(path: str, device_mem_gib: float, ranks: int = 1) -> dict:
    """Tensors, dtypes and sizes of a safetensors file or HF directory, validated, with a bucket plan."""
    from ckpt_core._settings import load_settings
    from ckpt_core.planning.buckets import choose_layout, plan_buckets

    if not (isinstance(ranks, int) and ranks >= 1):
        raise ConfigError(f"ranks must be an integer >= 1, got {ranks!r}")
    if not (isinstance(device_mem_gib, (int, float)) and math.isfinite(device_mem_gib)
            and 0 < device_mem_gib <= MAX_GIB):
        raise ConfigError(f"device_mem_gib must be a finite number in (0, {MAX_GIB:.0f}], got {device_mem_gib!r}")
    files, tensors = checkpoint_tensors(path)
    dtypes: dict = {}
    for _, dtype, _, nbytes, _, _ in tensors:
        d = dtypes.setdefault(dtype, {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += nbytes
    total = sum(t[3] for t in tensors)
    largest = max(tensors, key=lambda t: t[3], default=("-", "", (), 0, "", 0))
    settings = load_settings(rank=0, world_size=1)
    bucket, slots = choose_layout(int(device_mem_gib * GiB), mem_fraction=settings.mem_fraction,
                                  max_slots=settings.num_slots, max_bucket_bytes=settings.max_bucket_bytes,
                                  largest_tensor=largest[3], largest_owner_total=max(1, -(-total // ranks)))
    plan = plan_buckets(_spread(tensors, ranks), bucket) if tensors else None
    return {"path": path, "files": files, "valid": True, "tensors": len(tensors), "bytes": total,
            "dtypes": dtypes, "largest_tensor": {"name": largest[0], "bytes": largest[3], "shape": list(largest[2])},
            "plan": {"device_mem_gib": device_mem_gib, "ranks": ranks, "bucket_bytes": bucket, "slots": slots,
                     "buckets": len(plan.buckets) if plan else 0, "device_buffer_bytes": bucket * slots}}


def _spread(tensors: list[tuple], ranks: int) -> list[list]:
    """Each tensor, largest first, to the rank holding the fewest bytes so far (the lowest on a tie),
    as registration would spread them. Ranks beyond the tensors' count would hold nothing: no list is
    made for them (``--ranks`` may be a million)."""
    from ckpt_core.planning.buckets import TensorMeta
    metas: list[list] = [[] for _ in range(min(ranks, len(tensors)))]
    held = [(0, r) for r in range(len(metas))]   # a heap of (bytes so far, rank)
    for name, dtype, shape, nbytes, _, _ in sorted(tensors, key=lambda t: -t[3]):
        offset, r = heapq.heappop(held)
        metas[r].append(TensorMeta(name, dtype, shape, nbytes, 1, 0, offset))
        heapq.heappush(held, (offset + nbytes, r))
    return metas


def cmd_inspect(args) -> int:
    doc = inspect_checkpoint(args.path, args.device_mem_gib, args.ranks)
    p = doc["plan"]
    lines = [f"{doc['path']}: valid, {doc['tensors']} tensors, {doc['bytes'] / GiB:.3f} GiB in "
             f"{len(doc['files'])} file(s)"]
    lines += [f"  {k:>6}: {v['tensors']:6d} tensors {v['bytes'] / GiB:10.3f} GiB"
              for k, v in sorted(doc["dtypes"].items())]
    lt = doc["largest_tensor"]
    lines.append(f"  largest tensor {lt['name']} {lt['shape']} {lt['bytes'] / (1 << 20):.1f} MiB")
    lines.append(f"  plan for {p['device_mem_gib']:g} GiB free device memory, {p['ranks']} rank(s): "
                 f"{p['buckets']} buckets "
                 f"of <= {p['bucket_bytes'] / (1 << 20):.0f} MiB, {p['slots']} slot(s), device buffer "
                 f"{p['device_buffer_bytes'] / GiB:.2f} GiB")
    _emit(args, doc, "\n".join(lines))
    return EXIT_OK


# ------------------------------------------------------------------ plan
def cmd_plan(args) -> int:
    _emit(args, *plan_report(args, checkpoint_tensors(args.model)[1] if args.model else None))
    return EXIT_OK


# ------------------------------------------------------------------ bench
def cmd_bench(args, extra: list[str]) -> int:
    script = os.path.join(REPO, "benchmarks", "update_bench.py")
    if not os.path.exists(script):
        raise ConfigError(f"the benchmark is not here ({script}): run it from a source checkout of ckpt-engine")
    if args.help:   # the benchmark's own flags, then ours
        print("usage: ckpt-engine bench [--nproc N] [benchmark flags...]\n\n  --nproc N   ranks (devices) to run under "
              "torchrun (default 1)\n\nbenchmark flags (benchmarks/update_bench.py):", flush=True)
        return subprocess.call([sys.executable, script, "--help"], timeout=120)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", script,
           *extra]
    print("running: " + " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)


# ------------------------------------------------------------------ main
def _common(parser: argparse.ArgumentParser, top: bool) -> None:
    """``--json`` and ``--log-level``, accepted before and after the subcommand (after wins)."""
    default: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument("--json", action="store_true", help="machine-readable output (and errors) on stdout",
                        **({"default": False} if top else default))
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                        help="ckpt_core log level: " + ", ".join(LOG_LEVELS) + " (default INFO)",
                        **({"default": "INFO"} if top else default))


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
GIB_WHY = "the value is GiB (2^30 bytes)"


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve this rank's HTTP API (run one per device, under torchrun)")
    _common(s, False)
    s.add_argument("--uds", default=None,
                   help="unix socket path; {rank}/{local_rank} are filled in (default: ps-{rank}.sock in a "
                        "private per-user directory, $XDG_RUNTIME_DIR/ckpt-engine or /tmp/ckpt-engine-UID, mode 0700)")
    s.add_argument("--host", help="serve TCP on this address instead (needs a token)")
    s.add_argument("--port", type=PORT,
                   help="TCP port of local rank 0; local rank i listens on PORT+i (0: any)")
    s.add_argument("--token-file", help="file holding the bearer token (else CKPT_SERVICE_TOKEN; at least "
                                        "16 characters)")
    s.add_argument("--metrics-port", type=PORT,
                   help="also serve GET /metrics (only) on 127.0.0.1:PORT+local rank, for Prometheus; off by default")
    s.add_argument("--device", help="device kind (cpu, cuda, npu); default: the best available")
    renamed(s, "--max-bucket-gib", "--max-bucket-gb", GIB_WHY, type=GIB,
             help="upper bound of one bucket, GiB (default PS_MAX_BUCKET_SIZE_GB, 8)")
    s.add_argument("--mem-fraction", type=number(float, low=0, high=1))
    s.add_argument("--keep-device-buffers", action="store_true")
    s.add_argument("--serve-p2p", action="store_true",
                   help="serve registered checkpoints to P2P readers (Mooncake; exposes them: docs/p2p.md)")
    s.add_argument("--wire", choices=SERVE_WIRES, default="native",
                   help="wire to the engine workers: native (ckpt_core's, vLLM), stock (checkpoint-engine >= 0.4 "
                        "workers, e.g. SGLang's), stock-0.3 (0.2.1 - 0.3.4) (default %(default)s)")
    s.add_argument("--allow-dir", action="append", default=[], metavar="DIR",
                   help="a directory whose files (resolved: '..' and symlinks) requests may register; repeatable. "
                        "Default: none, the service reads no files")
    s.add_argument("--engine-url", action="append", default=[], metavar="URL",
                   help="an engine's base URL (http://host:port) that update_url may name; repeatable. "
                        "Default: any loopback host")
    s.add_argument("--engine-uds", action="append", default=[], metavar="PATH",
                   help="an engine's Unix socket that an update's uds may name; repeatable. Default: none")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    s.add_argument("--parent-pid", type=PID,
                   help="managed mode: stop (as on SIGTERM) once this process (the engine worker) is gone")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckpt-engine", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="exit codes: " + ", ".join(f"{c} {m}" for c, m in EXIT_TABLE))
    _common(p, True)
    p.add_argument("--version", action="version", version=f"ckpt-engine {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    _serve_parser(sub)

    i = sub.add_parser("inspect", help="validate a safetensors file or HF directory and show its bucket plan")
    _common(i, False)
    i.add_argument("path")
    i.add_argument("--device-mem-gib", type=GIB, default=16.0, help="free device memory to plan for (default 16)")
    i.add_argument("--ranks", type=COUNT, default=1, help="parameter-server ranks sharing the checkpoint")
    plan_parser(sub, _common)

    # -h is the benchmark's: `bench --help` shows its flags (cmd_bench), not only --nproc.
    b = sub.add_parser("bench", add_help=False,
                       help="run benchmarks/update_bench.py under torchrun "
                            "(other flags pass through; --help lists them)")
    b.add_argument("-h", "--help", action="store_true", help="show the benchmark's flags and exit")
    b.add_argument("--nproc", type=nproc(), default=1, help="ranks (devices) to run (default 1; at most the CPU count)")
    return p


EXIT_TABLE = ((EXIT_OK, "success"), (EXIT_INTERNAL, "internal error (a bug)"), (EXIT_USAGE, "bad command line"),
              (EXIT_FORMAT, "CheckpointFormatError"), (EXIT_CONFIG, "ConfigError/CheckpointNotFoundError"),
              (EXIT_TRANSPORT, "TransportError/UpdateTimeoutError/RemoteWorkerError"), (EXIT_OTHER, "other CkptError"),
              (130, "interrupted"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    import logging
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        if args.command == "bench":
            return cmd_bench(args, extra)
        return {"serve": cmd_serve, "inspect": cmd_inspect, "plan": cmd_plan}[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:   # the one place where every error becomes a message and an exit code
        code = exit_code(exc)
        kind = type(exc).__name__
        if args.json:
            print(json.dumps({"error": {"type": kind, "message": str(exc)}}))
        print(f"ckpt-engine {args.command}: {kind}: {exc}", file=sys.stderr)
        if code == EXIT_INTERNAL:
            import traceback
            traceback.print_exc()
            print("this is a bug in ckpt-engine: please report it with the traceback above", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
