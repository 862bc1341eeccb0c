"""Delta updates in the vLLM benchmark (``vllm_bench.py --delta-density D``, ours only), issue 39.

The PS child, after the full updates: one more full update with ``deltas=True`` (the workers map the
model and hold version ``bench``), then ``--repeats`` versions in which a fraction D of every
tensor's elements changed by one ulp (``_bench_delta.perturb_``), each registered whole (timed,
then dropped) and with the previous version as its base, and updated as a delta
(``ps.update(..., delta=True)``; the engine's ``update_weights_from_ipc(handles, deltas=True,
version=...)`` scatters or reloads by layer and checks the digests). The last version is written
beside the checkpoint (``delta_dir``) so that ``--verify`` compares the engine with a cold load of it.
"""

from __future__ import annotations

import os
import shutil
import time

from _bench_delta import perturb_

BASE = "bench"


def delta_dir(directory: str) -> str:
    return directory.rstrip("/") + "-delta"


def run_deltas(ps, files: list[str], density: float, repeats: int, send_update, directory: str,
               snapshot=None) -> dict:
    """The delta rounds on the PS side. ``send_update(handles, version, deltas)`` posts one update to the
    engine and returns the worker's reply (its ``delta`` figures); ``snapshot()`` (--verify) has the
    engine record its state after the full update, before the deltas."""
    import torch
    from safetensors.torch import load_file, save_file

    def req(version):
        return lambda handles: replies.append(send_update(handles, version, True))

    replies: list = []
    t0 = time.perf_counter()
    full_info = ps.update(BASE, req(BASE))   # the workers map the model and keep what a delta rebuilds from
    full_deltas_s = time.perf_counter() - t0
    # where that update's time went: the PS's phases and the worker's report (its map's figures and phases)
    full_deltas = {"ps": full_info.get("seconds") if isinstance(full_info, dict) else None,
                   "worker": replies[-1] if replies and isinstance(replies[-1], dict) else None}
    if snapshot is not None:
        snapshot()
    per_file = {f: load_file(f) for f in files}
    current = {n: t for d in per_file.values() for n, t in d.items()}
    gen = torch.Generator().manual_seed(1_000_003)
    rounds, prev = [], BASE
    for k in range(1, 1 + repeats):
        name = f"{BASE}-d{k}"
        changed = sum(perturb_(t, density, gen) for t in current.values())
        t0 = time.perf_counter()
        ps.register_checkpoint(f"{name}-full", named_tensors=current)
        reg_full = time.perf_counter() - t0
        ps.unregister_checkpoint(f"{name}-full")
        t0 = time.perf_counter()
        ps.register_checkpoint(name, named_tensors=current, base=prev)
        reg_base = time.perf_counter() - t0
        ps.gather_metas(name)
        replies.clear()
        t0 = time.perf_counter()
        info = ps.update(name, req(name), delta=True)
        update_s = time.perf_counter() - t0
        worker = (replies[-1] or {}).get("delta") if replies and isinstance(replies[-1], dict) else None
        ps_fig = info.get("delta") if isinstance(info, dict) else None
        rounds.append({"version": name, "changed_elements": changed, "register_full_s": reg_full,
                       "register_base_s": reg_base, "update_s": update_s, "ps": ps_fig, "worker": worker})
        print(f"[vllm bench] delta {name}: registered whole {reg_full:.3f} s, with its base {reg_base:.3f} s, "
              f"update {update_s * 1e3:.1f} ms, payload {(ps_fig or {}).get('payload_bytes', 0) / 1e6:.2f} MB",
              flush=True)
        if prev != BASE:
            ps.unregister_checkpoint(prev)
        prev = name
    out_dir = delta_dir(directory)
    _write_version(directory, out_dir, per_file, save_file)
    elements = sum(t.numel() for t in current.values())
    return {"density": density, "full_deltas_s": full_deltas_s, "full_deltas": full_deltas, "rounds": rounds,
            "dir": out_dir, "version": prev, "elements": elements}


def _write_version(src: str, dst: str, per_file: dict, save_file) -> None:
    """``src``'s other files (config) and its safetensors files holding the current (perturbed) tensors
    (``per_file``'s tensors were changed in place)."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    for path, tensors in per_file.items():
        save_file(tensors, os.path.join(dst, os.path.basename(path)))


def summarize(delta: dict, full_best_s: float, full_bytes: int) -> dict:
    rounds = delta["rounds"]
    best = min(rounds, key=lambda r: r["update_s"])
    w, p = best.get("worker") or {}, best.get("ps") or {}
    return {"density": delta["density"], "changed_fraction": best["changed_elements"] / max(delta["elements"], 1),
            "full": {"update_s": full_best_s, "with_map_s": delta["full_deltas_s"], "bytes": full_bytes,
                     "with_map_worker": _map_figures(delta.get("full_deltas")),
                     "register_s": min(r["register_full_s"] for r in rounds)},
            "delta": {"update_s": best["update_s"], "register_s": min(r["register_base_s"] for r in rounds),
                      "payload_bytes": p.get("payload_bytes"), "apply_s": w.get("apply_s"),
                      "check_s": w.get("verify_s"), "reload_s": w.get("reload_s"),
                      "reloaded_layers": _count(w.get("reloaded_layers")), "scattered": w.get("scattered")}}


def _map_figures(full: dict | None) -> dict:
    """Of the first full update with deltas=True: the engine call's time and the worker's own parts (the
    digests and host copies of what arrived, the map)."""
    worker = (full or {}).get("worker") or {}
    m = (worker.get("delta") or {}).get("map") or {}
    return {"engine_s": worker.get("engine_s"), "digest_s": m.get("digest_s"), "host_copy_s": m.get("host_copy_s"),
            "host_copy_bytes": m.get("host_copy_bytes"), "host_copy_gbps": m.get("host_copy_gbps"),
            "map_s": m.get("map_s")}


def _count(x):
    return len(x) if isinstance(x, (list, tuple)) else x


def format_delta(s: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f} ms"
    f, d = s["full"], s["delta"]
    return (f"  delta at {s['density']:.4f} ({s['changed_fraction']:.4f} changed): register {ms(d['register_s'])} "
            f"(whole {ms(f['register_s'])}), update best {ms(d['update_s'])} (full {ms(f['update_s'])}, full with "
            f"the map {ms(f['with_map_s'])}: {_parts(f.get('with_map_worker') or {}, ms)}), payload "
            f"{d['payload_bytes'] or 0:,} of {f['bytes']:,} bytes, worker "
            f"apply {ms(d['apply_s'])}, check {ms(d['check_s'])}, reload {ms(d['reload_s'])} "
            f"({d['reloaded_layers']} layers reloaded, {d['scattered']} tensors scattered)")


def _parts(w: dict, ms) -> str:
    rate = w.get("host_copy_gbps")
    copied = "" if rate is None else f" ({(w.get('host_copy_bytes') or 0) / 1e9:.2f} GB at {rate:.1f} GB/s)"
    return (f"engine call {ms(w.get('engine_s'))}, of it digests {ms(w.get('digest_s'))}, host copies "
            f"{ms(w.get('host_copy_s'))}{copied}, map {ms(w.get('map_s'))}")
