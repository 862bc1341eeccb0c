"""P2P update throughput against the transport's ceiling measured in the same run.

An owner world (``--owners`` ranks, P2P store on ``--owner-host``) registers a
checkpoint of ``--gib`` GiB of random bf16 tensors and saves its metas; a separate
reader world (``--readers`` ranks on ``--reader-host``) loads the metas and pulls the
checkpoint with ``update(..., ranks=all readers)`` into engine workers (one process per
reader that copies every tensor into its own preallocated parameter and checksums it).
The ceiling is a plain Mooncake read of the same bytes from the same owners by the
reader's own store into a registered buffer of the same device kind.

    python benchmarks/p2p_bench.py --device cpu --gib 0.25 --out p2p.json
    python benchmarks/p2p_bench.py --device cuda --gib 4 --readers 2 --out p2p.json   # 2 GPUs

The first (warm-up) update is verified (per-tensor checksums) before any figure is reported.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time

CTX = mp.get_context("spawn")
MiB = 1 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stacks_later() -> None:
    """With CKPT_BENCH_STACKS_AFTER=S, every process of the run prints all its threads' stacks
    to stderr after S seconds (a run that hangs shows where)."""
    after = float(os.environ.get("CKPT_BENCH_STACKS_AFTER") or 0)
    if after > 0:
        import faulthandler
        faulthandler.dump_traceback_later(after, exit=False)


def _say(args, who: str, msg: str) -> None:
    """Progress, flushed at once: a run cut short (a test's timeout) still shows how far it got."""
    print(f"[p2p_bench +{time.monotonic() - args.t0:7.1f} s] {who}: {msg}", flush=True)


def _checksum(t) -> int:
    """Order-sensitive and cheap at any size: 32-bit words summed per block of 4096 in int64 (no
    int64 copy of the tensor), each block weighted by its position so a misplaced block shows."""
    import torch
    flat = t.reshape(-1).view(torch.uint8)
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    m = words.numel() // 4096 * 4096
    blocks = words[:m].view(-1, 4096).sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, blocks.numel() + 1, device=blocks.device, dtype=torch.int64)
    return int((blocks * weights).sum().item()) + int(words[m:].sum(dtype=torch.int64).item())


def _random_share(rank: int, n: int, numel: int) -> dict:
    """``n`` distinct random bf16 tensors of ``numel`` elements, generated at memory speed: one
    random block of bits, each tensor that block XOR its own random 16-bit key (randn and a bf16
    cast cost ~0.6 s per 16 MiB on one CPU core: over a minute for a 2 GiB share)."""
    import torch
    gen = torch.Generator().manual_seed(rank)
    base = torch.randint(-(1 << 15), 1 << 15, (numel,), dtype=torch.int16, generator=gen)
    keys = (torch.randperm((1 << 15) - 1, generator=gen) + 1).tolist()   # distinct, non-zero, int16
    out = {}
    for i in range(n):
        t = base ^ keys[i % len(keys)]
        out[f"r{rank}.w{i}"] = (t if i < len(keys) else t.roll(i // len(keys))).view(torch.bfloat16)
    return out


def owner_main(rank, world, port, args, metas_path, ready, stop):
    _stacks_later()
    os.environ["PS_P2P_HOST"] = args.owner_host
    from ckpt_core import ParameterServer
    ps = ParameterServer(rank, world, device="cpu", master_addr="127.0.0.1", master_port=port, serve_p2p=True)
    per_rank = int(args.gib * (1 << 30)) // world
    n = max(1, per_rank // (args.tensor_mib * MiB))
    who = f"owner {rank}/{world}"
    _say(args, who, f"making {n} random tensors of {args.tensor_mib} MiB")
    ts = _random_share(rank, n, args.tensor_mib * MiB // 2)
    sums = {k: _checksum(v) for k, v in ts.items()}
    _say(args, who, f"registering {n * args.tensor_mib / 1024:.2f} GiB")
    t0 = time.perf_counter()
    ps.register_checkpoint("ck", named_tensors=ts)
    del ts
    dt = time.perf_counter() - t0
    _say(args, who, f"registered in {dt:.2f} s ({n * args.tensor_mib * MiB / dt / 1e9:.2f} GB/s); gathering metas")
    ps.gather_metas("ck")
    if rank == 0:
        ps.save_metas(metas_path)
    ready.put(sums)
    stop.wait(3600)
    ps.close()


def engine_main(kind, index, conn, verify_first):
    """One engine worker in its own process (CUDA IPC cannot be opened by the exporting process):
    copies every tensor into its own preallocated parameter; checksums the first update."""
    _stacks_later()
    import torch
    import zmq
    from ckpt_core import update_weights_from_ipc
    dev = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
    ctx, params, check = zmq.Context(), {}, [verify_first]
    while True:
        handle = conn.recv()
        if handle is None:
            return
        got = {}

        def run(weights):
            for name, t in weights:
                p = params.get(name)
                if p is None:
                    p = params[name] = torch.empty_like(t, device=dev)
                p.copy_(t)
                if check[0]:
                    got[name] = _checksum(p)
        try:
            update_weights_from_ipc(ctx, handle, index, run=run)
            conn.send(("ok", got))
        except Exception as exc:
            conn.send(("error", repr(exc)))
        check[0] = False


def reader_main(rank, world, port, args, metas_path, sums, out):
    _stacks_later()
    os.environ["PS_P2P_HOST"] = args.reader_host
    os.environ["LOCAL_RANK"] = str(rank)
    from ckpt_core import ParameterServer
    ps = ParameterServer(rank, world, device=args.device, master_addr="127.0.0.1", master_port=port)
    ps.load_metas(metas_path)
    conn, child = CTX.Pipe()
    engine = CTX.Process(target=engine_main, args=(args.device, ps.device_index, child, args.verify), daemon=True)
    engine.start()

    def req(handles):   # every reader rank asks its own engine worker to pull
        conn.send(dict(handles)[ps.device_uuid])
        status, got = conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine worker failed: {got}")
        if got and got != sums:
            bad = [k for k in sums if got.get(k) != sums[k]][:5]
            raise RuntimeError(f"rank {rank}: the update is not bit-exact: {bad}")

    times, who = [], f"reader {rank}/{world}"
    for i in range(args.repeats + 1):
        r = ps.update("ck", req, ranks=list(range(world)), timeout=600)
        times.append(r["seconds"]["total"])
        _say(args, who, f"update {i + 1}/{args.repeats + 1}{' (warm-up, verified)' if i == 0 and args.verify else ''}: "
                        f"{r['bytes'] / (1 << 30):.2f} GiB in {times[-1]:.2f} s ({r['bytes'] / times[-1] / 1e9:.2f} GB/s)")
    conn.send(None)
    engine.join(30)
    ceiling = _ceiling(ps, args) if rank == 0 else None
    out.put({"rank": rank, "update_s": times, "bytes": r["bytes"], "ceiling": ceiling})
    ps.close()


def _ceiling(ps, args) -> dict:
    """A plain Mooncake read of every owner region into one registered buffer of this device kind."""
    import torch
    dev = torch.device(args.device, ps.device_index) if args.device == "cuda" else torch.device("cpu")
    store = ps._p2p.store
    src = ps._p2p.loaded["ck"]
    regions = [(peer, rid, ptr, n) for peer in src.peers for rid, (ptr, n) in peer.regions.items()]
    total = sum(n for *_, n in regions)
    dst = torch.empty(total, dtype=torch.uint8, device=dev)
    store.register(dst.data_ptr(), total)
    best = None
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        off = 0
        for owner, (peer, rid, ptr, n) in enumerate(regions):
            store.read(peer, owner, [(dst.data_ptr() + off, ptr, n)], what=f"region {rid}",
                       deadline=time.monotonic() + 600, should_stop=lambda: None)
            off += n
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
        _say(args, "ceiling", f"plain Mooncake read of {total / (1 << 30):.2f} GiB in {dt:.2f} s ({total / dt / 1e9:.2f} GB/s)")
    store.unregister(dst.data_ptr())
    return {"bytes": total, "best_s": best, "gbps": total / best / 1e9}


def _get(q, procs, timeout: float, what: str):
    """The next result from ``q``; fails as soon as one of ``procs`` died without sending it (a
    child that cannot even import ckpt_core must not leave the run waiting for the timeout)."""
    import queue
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"p2p_bench: {what} {dead[0][0]} exited with code {dead[0][1]} (its stderr is above)")
            if time.monotonic() > deadline:
                raise SystemExit(f"p2p_bench: no result from the {what}s within {timeout:g} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--gib", type=float, default=0.25)
    ap.add_argument("--tensor-mib", type=int, default=16)
    ap.add_argument("--owners", type=int, default=2)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--owner-host", default="127.0.0.2")
    ap.add_argument("--reader-host", default="127.0.0.3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.t0 = time.monotonic()   # CLOCK_MONOTONIC is system-wide: the children's progress shares it
    metas = f"/tmp/p2p-bench-{os.getpid()}.json"
    ready, stop, out = CTX.Queue(), CTX.Event(), CTX.Queue()
    oport, rport = _port(), _port()
    owners = [CTX.Process(target=owner_main, args=(r, args.owners, oport, args, metas, ready, stop), daemon=True)
              for r in range(args.owners)]
    for p in owners:
        p.start()
    readers = []   # not daemons: each starts its engine worker process
    try:
        _say(args, "main", f"{args.owners} owners register {args.gib:g} GiB ({args.device} readers: {args.readers})")
        sums = {}
        for _ in owners:
            sums.update(_get(ready, owners, 600, "owner"))
        _say(args, "main", "owners ready; readers load the metas and update")
        readers = [CTX.Process(target=reader_main, args=(r, args.readers, rport, args, metas, sums, out))
                   for r in range(args.readers)]
        for p in readers:
            p.start()
        res = sorted((_get(out, readers, 1800, "reader") for _ in readers), key=lambda x: x["rank"])
        for p in readers:
            p.join(60)
    finally:
        for p in readers:
            if p.is_alive():
                p.kill()
        stop.set()
        for p in owners:
            p.join(30)
            if p.is_alive():
                p.kill()
        if os.path.exists(metas):
            os.unlink(metas)
    nbytes = res[0]["bytes"]
    best = min(max(r["update_s"][i] for r in res) for i in range(1, args.repeats + 1))
    ceil = res[0]["ceiling"]
    report = {"device": args.device, "owners": args.owners, "readers": args.readers, "bytes": nbytes,
              "verified": args.verify, "p2p_update_best_s": best, "p2p_gbps": nbytes / best / 1e9,
              "ceiling": ceil, "ratio": (nbytes / best / 1e9) / ceil["gbps"],
              "first_update_s": max(r["update_s"][0] for r in res)}
    print(json.dumps(report, indent=1))
    print(f"P2P update: {nbytes / MiB:.0f} MiB in {best:.3f} s = {report['p2p_gbps']:.2f} GB/s; plain Mooncake "
          f"read of the same bytes: {ceil['gbps']:.2f} GB/s; ratio {report['ratio']:.2f}"
          + ("; the first update was verified bit-exact" if args.verify else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
