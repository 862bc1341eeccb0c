"""Delta updates in the update benchmark (``update_bench.py --delta-density D``), issue 39.

After a case's full updates, a chain of next versions is made from the case's data: in each, a
fraction D of every tensor's elements changes (random positions, the lowest bit of each changed
element flipped: one ulp for a float, so the bytes always differ). Each is registered twice, whole
(the full version's registration time) and then with the previous version as its base, and updated
as a delta into the simulated engine, whose worker applies it in place through the project's
``DeltaReceiver`` (scatter into the live parameters, then the version's digests checked). After the
last delta the engine's tensors are compared with the last version bit for bit (checksums).
``measured`` takes the density the density study measured (``MEASURED``).
"""

from __future__ import annotations

import json
import os
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
MEASURED = os.path.join(HERE, "results", "2026-12-03-cpu-delta-density.json")
MEASURED_LR = "1e-06"   # the study's lowest learning rate: ~2 % changed per step (docs/deltas.md)
# registered copies a delta round holds at once (the case, the base, the version; source and next data)
HOST_COPIES = 5
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parse_density(value: str) -> float:
    """``D`` in (0, 1], or ``measured``: the mean changed fraction of steps 2-8 of the density study."""
    if value == "measured":
        with open(MEASURED) as f:
            steps = json.load(f)["runs"][MEASURED_LR]
        later = [s["changed_fraction"] for s in steps[1:]]   # step 1 changes the zero biases whole
        return sum(later) / len(later)
    d = float(value)
    if not 0.0 < d <= 1.0:
        raise ValueError(f"--delta-density must be in (0, 1] or 'measured'; got {value!r}")
    return d


def changed_positions(n: int, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """``round(fraction * n)`` distinct positions in ``[0, n)``, sorted, drawn from ``gen`` (on its device).
    Sampled with replacement and deduplicated (no permutation of all n: tensors of 10^9 elements)."""
    k = min(n, int(round(fraction * n)))
    dev = gen.device
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    if 2 * k > n:   # dense: a permutation is no bigger than the samples would be
        return torch.randperm(n, generator=gen, device=dev)[:k].sort().values
    got = torch.empty(0, dtype=torch.int64, device=dev)
    while got.numel() < k:
        more = torch.randint(0, n, (int((k - got.numel()) * 1.2) + 16,), generator=gen, device=dev)
        got = torch.unique(torch.cat([got, more]))
    keep = torch.randperm(got.numel(), generator=gen, device=dev)[:k]
    return got[keep].sort().values


def perturb_(t: torch.Tensor, fraction: float, gen: torch.Generator) -> int:
    """Flip the lowest bit of ``round(fraction * t.numel())`` elements of ``t`` in place; returns how
    many. A float's lowest mantissa bit: one ulp, the exponent untouched (finite stays finite)."""
    words = t.reshape(-1).view(_WORD[t.element_size()])
    pos = changed_positions(words.numel(), fraction, gen).to(words.device)
    words[pos] ^= 1
    return int(pos.numel())


def host_bytes_needed(share_bytes: int, local_ranks: int, kind: str) -> int:
    """Host memory a delta round needs on one host: ``HOST_COPIES`` copies of each local rank's
    share (plus the simulated engine's parameters when it runs on the CPU)."""
    per_rank = share_bytes * (HOST_COPIES + (1 if kind == "cpu" else 0))
    return per_rank * local_ranks


def host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def check_host_memory(largest_share: int, local_ranks: int, kind: str, say) -> None:
    """Print the estimate; refuse (SystemExit) when the host has less available."""
    need, have = host_bytes_needed(largest_share, local_ranks, kind), host_available()
    say(f"delta: host memory needed ~{need / 2**30:.1f} GiB ({HOST_COPIES} copies of the largest share x "
        f"{local_ranks} local ranks), available {have / 2**30:.1f} GiB")
    if have and need > have:
        raise SystemExit(f"--delta-density: this host has {have / 2**30:.1f} GiB available, the delta rounds need "
                         f"~{need / 2**30:.1f} GiB; run fewer/smaller cases (--scale) or without --delta-density")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def delta_section(bench, case: str, share, full_update_s: float) -> dict:
    """The delta rounds of one case on one rank (every rank calls it); ``bench`` is update_bench's Bench."""
    density, ps = bench.args.delta_density, bench.ps
    gen = torch.Generator(device=bench.device)
    gen.manual_seed(1_000_003 + bench.rank)
    nxt = {n: t.clone() for n, t in share.named.items()}
    rounds, prev = [], case
    # with --profile one more round, not timed (cProfile slows what it watches): the PS and the worker's
    # delta apply profiled (the worker's CUDA kernels too, bench worker's ``profiled``)
    profiling = bench.args.profile is not None
    for k in range(1, 1 + bench.args.repeats + profiling):
        name = f"{case}-d{k}"
        profiled_round = profiling and k == 1 + bench.args.repeats
        t0 = time.perf_counter()
        changed = 0
        for t in nxt.values():   # on cuda the positions are drawn on the device (fast), flipped on the host copy
            changed += perturb_(t, density, gen)
        gen_s = time.perf_counter() - t0
        full_reg = bench.timed(lambda: ps.register_checkpoint(f"{name}-full", named_tensors=nxt))
        ps.unregister_checkpoint(f"{name}-full")
        base_reg = bench.timed(lambda: ps.register_checkpoint(name, named_tensors=nxt, base=prev))
        ps.gather_metas(name)
        if bench.front is not None:
            bench.front.version = name
        bench.barrier()
        _sync(bench.device)
        t0 = time.perf_counter()
        with bench.profiling(f"{case}-delta" if profiled_round else None):
            info = ps.update(name, bench.req_func, delta=True)
        _sync(bench.device)
        seconds = time.perf_counter() - t0
        engine = bench.front.last if bench.front is not None else None
        views = bench.gather({"seconds": seconds, "changed": changed, "ps": info.get("delta") if isinstance(info, dict)
                              else None, "gen_s": gen_s})
        if prev != case:
            ps.unregister_checkpoint(prev)
        prev = name
        if profiled_round:
            bench.say(f"{case}: delta {name} profiled (not timed): {seconds * 1e3:.1f} ms under the profilers")
            continue
        workers = [e.get("delta") or {} for e in engine or []]
        rounds.append({
            "version": name, "update_s": max(v["seconds"] for v in views), "per_rank_s": [v["seconds"] for v in views],
            "register_full_s": full_reg["s"], "register_base_s": base_reg["s"],
            "changed_elements": sum(v["changed"] for v in views),
            "payload_bytes": sum((v["ps"] or {}).get("payload_bytes", 0) for v in views),
            "full_bytes": sum((v["ps"] or {}).get("full_bytes", 0) for v in views),
            "encode_s": max((v["ps"] or {}).get("encode_s", 0.0) for v in views),
            "apply_s": max((w.get("apply_s", 0.0) for w in workers), default=None),
            "check_s": max((w.get("verify_s", 0.0) for w in workers), default=None),
            "apply_split_s": max(workers, key=lambda w: w.get("apply_s", 0.0), default={}).get("apply_split_s"),
            "worker_s": max((e.get("seconds", 0.0) for e in engine or []), default=None),
            "worker_buckets": max((e.get("buckets", 0) for e in engine or []), default=None),
            "generate_s": max(v["gen_s"] for v in views), "ps": [v["ps"] for v in views]})
        bench.say(f"{case}: delta {name}: registered whole {full_reg['s']:.3f} s, with its base "
                  f"{base_reg['s']:.3f} s; update "
                  f"{rounds[-1]['update_s'] * 1e3:.1f} ms, payload {rounds[-1]['payload_bytes'] / 1e6:.2f} MB"
                  + _split_text(rounds[-1]))
    exact = _bit_exact(bench, nxt)
    ps.unregister_checkpoint(prev)
    elements = sum(t.numel() for t in share.named.values())
    return summarize(case, density, rounds, exact, full_update_s, bench.gather(elements))


def _split_text(r: dict) -> str:
    """The slowest worker's apply by step (host time: peek, take, checks, swap, digests, decode_scatter)."""
    split = r.get("apply_split_s") or {}
    if not split:
        return ""
    steps = " / ".join(f"{k} {v * 1e3:.1f}" for k, v in split.items())
    return f"; worker apply {r['apply_s'] * 1e3:.1f} ms ({steps} ms), check {r['check_s'] * 1e3:.1f} ms"


def _bit_exact(bench, nxt: dict) -> dict:
    """The engine's checksums against the last version's (made on the engine's kind of device)."""
    from _bench_cases import checksums
    want = {}
    for n, t in nxt.items():
        want.update(checksums({n: t.to(bench.device)}))
    got = bench.worker.call("checksum")
    mine = [n for n in want if tuple(got.get(n, ())) != tuple(want[n])]
    views = bench.gather(mine)
    bad = [n for v in views for n in v]
    if bad:
        bench.say("!" * 30 + f" DELTA NOT BIT-EXACT: {len(bad)} tensors differ, e.g. {bad[:3]}")
        raise RuntimeError(f"after the last delta the engine differs from the version in {len(bad)} tensors")
    return {"bit_exact": True, "tensors": sum(len(v) for v in bench.gather(list(want)))}


def summarize(case: str, density: float, rounds: list[dict], exact: dict, full_update_s: float,
              elements_per_rank: list[int]) -> dict:
    best = min(rounds, key=lambda r: r["update_s"])
    order = sorted(r["update_s"] for r in rounds)
    elements = sum(elements_per_rank)
    return {"case": case, "density": density, "rounds": rounds, **exact,
            "changed_fraction": best["changed_elements"] / max(elements, 1),
            "full": {"register_s": min(r["register_full_s"] for r in rounds), "update_s": full_update_s,
                     "bytes": best["full_bytes"]},
            "delta": {"register_s": min(r["register_base_s"] for r in rounds), "update_s": best["update_s"],
                      "update_median_s": order[len(order) // 2], "payload_bytes": best["payload_bytes"],
                      "apply_s": best["apply_s"], "check_s": best["check_s"], "encode_s": best["encode_s"]}}


def format_delta(cases: list[dict]) -> str:
    """Full against delta, side by side, per case."""
    rows = [c["delta"] for c in cases if c.get("delta")]
    if not rows:
        return ""

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f} ms"
    out = ["delta updates (best round; apply/check: the engine worker's, slowest worker)",
           f"{'case':<10} {'density':>8} {'':>6} {'register':>11} {'update':>11} {'bytes':>12} {'apply':>10} "
           f"{'check':>10}"]
    for d in rows:
        f, x = d["full"], d["delta"]
        out.append(f"{d['case']:<10} {d['density']:>8.4f} {'full':>6} {ms(f['register_s']):>11} "
                   f"{ms(f['update_s']):>11} {f['bytes']:>12,} {'-':>10} {'-':>10}")
        out.append(f"{'':<10} {d['changed_fraction']:>8.4f} {'delta':>6} {ms(x['register_s']):>11} "
                   f"{ms(x['update_s']):>11} {x['payload_bytes']:>12,} {ms(x['apply_s']):>10} {ms(x['check_s']):>10}")
        out.append(f"{'':<10} {'':>8} {'':>6} bit-exact after the last delta: {d['bit_exact']}")
    return "\n".join(out)
