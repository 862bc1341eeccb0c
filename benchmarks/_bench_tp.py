"""The benchmark's sliced section (``update_bench.py --tp T``): T simulated tensor-parallel engine
ranks, each holding only its part of every tensor, updated with ``ParameterServer.update(...,
slices=plan)`` and verified bit-exact against the source's slices (update_bench's docstring says
how the ranks are served)."""

from __future__ import annotations

import time
from dataclasses import replace

from _bench_cases import GiB
from _bench_report import per_tensor_costs, per_tensor_line


def tp_section(bench, case: str, specs, share, whole_s: float, whole_floor_s: float = 0.0) -> dict:
    """Each of T simulated engine ranks receives only its slices (see the module's docstring)."""
    from ckpt_core.checkpoint.safetensors import WIRE_CODES
    from ckpt_core.planning.slices import SliceKey, SlicePlan, split_plan

    tp = bench.args.tp
    tensors = {s.name: (WIRE_CODES[s.dtype], tuple(s.shape), s.dtype.itemsize) for s in specs}
    plan = split_plan(SliceKey(f"bench-{case}-{bench.args.scale}", f"tp={tp}", "simulated"), tensors, tp,
                      tp_dims(specs))
    bench.ps.register_checkpoint(f"{case}-tp", named_tensors=share.named)
    bench.ps.gather_metas(f"{case}-tp")
    serial = bench.world == 1 and tp > 1
    # (engine ranks served by one update, the plan of that update): all at once, or one at a time
    rounds = ([(list(range(tp)), plan)] if not serial else
              [([t], SlicePlan(SliceKey(plan.key.model, f"{plan.key.layout},rank={t}", "simulated"), tensors,
                               (replace(plan.ranks[t], rank=0),))) for t in range(tp)])
    dtypes = {s.name: s.dtype for s in specs}
    per_rank: dict[int, list[float]] = {}
    breakdown: dict[int, dict] = {}
    received = [0] * tp
    last: dict[int, dict] = {}   # per round (its first engine rank): its last update, for the per-tensor costs
    for engine_ranks, part in rounds:
        mine = engine_ranks[0] if serial else bench.rank   # the engine rank this PS rank's worker plays
        index = 0 if serial else bench.rank                # ... and its rank in the update's plan
        wanted = slice_sums(bench, part, share.named)[index]
        bench.worker.call("alloc", [(n, part.ranks[index].params[n], dtypes[n]) for n in tensors])
        bench.worker.call("slices", (part.digest, index))   # the worker refuses slices routed for another rank
        times = []
        # one more update of the first round with --profile, not timed: cProfile slows what it watches
        profiled = bench.args.profile is not None and engine_ranks[0] == 0
        for i in range(1 + bench.args.repeats + profiled):
            bench.worker.call("zero")
            bench.barrier()
            with bench.profiling(f"{case}-tp{tp}" if i > bench.args.repeats else None):
                t0, c0 = time.perf_counter(), time.thread_time()
                info = bench.ps.update(f"{case}-tp", bench.req_func, slices=part)
                seconds, cpu = bench.gather(time.perf_counter() - t0), bench.gather(time.thread_time() - c0)
            got = bench.worker.call("checksum")
            bad = sorted(n for n in set(wanted) | set(got) if tuple(got.get(n, ())) != tuple(wanted.get(n, ())))
            nbad = bench.gather(len(bad))
            if any(nbad):
                raise RuntimeError(f"sliced update of {case!r} (tp={tp}) is not bit-exact: engine rank {mine} "
                                   f"has {len(bad)} wrong tensors, e.g. {bad[:3]}; all ranks: {nbad}")
            if i > bench.args.repeats:
                continue
            times.append(max(seconds))
            timed = info
            last[engine_ranks[0]] = {"seconds": max(seconds), "ps_cpu_s": cpu,
                                     "engine": bench.front.last if bench.front is not None else None}
        for i, t in enumerate(engine_ranks):
            per_rank[t] = times[1:] or times
            received[t] = timed["slices"]["received_bytes"][i]
            breakdown[t] = timed["seconds"]   # this PS rank's phases of the last timed update
    bench.worker.call("slices", None)
    bench.ps.unregister_checkpoint(f"{case}-tp")
    best = [min(per_rank[t]) for t in range(tp)]
    out = {"tp": tp, "mode": "serial" if serial else "parallel", "whole_update_s": whole_s,
           "sliced_s": max(best), "per_rank_best_s": best, "received_bytes_per_rank": received,
           "whole_bytes": plan.whole_bytes(), "received_fraction": max(received) / plan.whole_bytes(),
           "speedup": whole_s / max(best) if max(best) else None,
           "update_breakdown_slowest": breakdown[best.index(max(best))]}
    floor = whole_floor_s * out["received_fraction"]   # the bytes one engine rank receives, at the whole update's rates
    rounds_costs = [per_tensor_costs(u, len(specs), floor) for u in last.values()]
    out["per_tensor"] = {k: max((c[k] for c in rounds_costs if c[k] is not None), default=None)
                         for k in rounds_costs[0]}   # the costliest round's figure of each
    bench.say(f"{case}: tp={tp} ({out['mode']}) each rank receives {out['received_fraction']:.3f} of "
              f"{plan.whole_bytes() / GiB:.3f} GiB; sliced update {out['sliced_s']:.3f} s (slowest rank) "
              f"against a whole update of {whole_s:.3f} s ({out['speedup']:.2f}x); per tensor "
              f"{per_tensor_line(out['per_tensor'])}")
    return out


def slice_sums(bench, plan, named: dict) -> list[dict]:
    """Per engine rank of ``plan``: the checksums of its slices of this rank's tensors, computed
    on this device like the engine's (gathered from every PS rank)."""
    from _bench_cases import checksums
    mine = []
    for rs in plan.ranks:
        sums: dict = {}
        names = [n for n in named if n in rs.needs]
        for at in range(0, len(names), 256):   # a few hundred slices on the device at a time
            part = {}
            for n in names[at: at + 256]:
                v = named[n]
                for d, start, length in rs.needs[n] or ():
                    v = v.narrow(d, start, length)
                part[n] = v.contiguous() if bench.kind == "cpu" else v.to(bench.device)
            sums.update(checksums(part))
        mine.append(sums)
    every = bench.gather(mine)
    return [{k: v for views in every for k, v in views[r].items()} for r in range(len(plan.ranks))]


# Which dimension a tensor-parallel engine splits each tensor of the synthetic layouts along
# (column-parallel: rows, row-parallel: columns); the others are whole on every rank.
_ROWS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
         "gate_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")
_COLS = ("o_proj.weight", "down_proj.weight")


def tp_dims(specs) -> dict:
    return {s.name: 0 if s.name.endswith(_ROWS) else 1 if s.name.endswith(_COLS) else None for s in specs}
