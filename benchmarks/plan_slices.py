"""Predicted 8-GPU figures of sliced updates for public model architectures (no GPU, no checkpoint).

Builds the checkpoint's tensor names and shapes from an architecture's published sizes (the Hugging
Face naming of Qwen3 dense and Qwen3-MoE), has the capacity planner's slice estimate
(``ckpt_core.planning.slice_estimate``) say what each engine rank receives at TP 8 (and with the
experts under expert parallelism), and the capacity planner (``planning/capacity.py``) the update's
stages with and without slices on one node of 8 devices. A prediction, not a measurement: with a
real checkpoint use ``ckpt-engine plan --model DIR --slices-tp 8`` or, exactly, a recorded plan
(``--slices-plan FILE``).

    python benchmarks/plan_slices.py --out benchmarks/results/plan-slices-8gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from ckpt_core._cli_plan import REAL_VLLM_RELOAD_GBPS
from ckpt_core.planning.capacity import Calibration, ModelSpec, Topology, predict
from ckpt_core.planning.slice_estimate import estimate

BF16 = 2
# Published sizes (config.json of each release): layers, hidden, heads, KV heads, head dim, vocabulary,
# dense intermediate or (experts, expert intermediate).
ARCHS = {
    "Qwen3-8B": dict(layers=36, hidden=4096, heads=32, kv=8, head_dim=128, vocab=151936, inter=12288),
    "Qwen3-32B": dict(layers=64, hidden=5120, heads=64, kv=8, head_dim=128, vocab=151936, inter=25600),
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, heads=32, kv=4, head_dim=128, vocab=151936, experts=128,
                          moe_inter=768),
    "Qwen3-235B-A22B": dict(layers=94, hidden=4096, heads=64, kv=4, head_dim=128, vocab=151936, experts=128,
                            moe_inter=1536),
}


def checkpoint(a: dict) -> tuple[dict, dict]:
    """name -> (shape, itemsize) as the Hugging Face checkpoint names them, and the config the estimate reads."""
    h, d = a["hidden"], a["head_dim"]
    t = {"model.embed_tokens.weight": (a["vocab"], h), "lm_head.weight": (a["vocab"], h), "model.norm.weight": (h,)}
    for i in range(a["layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                  p + "self_attn.q_proj.weight": (a["heads"] * d, h), p + "self_attn.k_proj.weight": (a["kv"] * d, h),
                  p + "self_attn.v_proj.weight": (a["kv"] * d, h), p + "self_attn.o_proj.weight": (h, a["heads"] * d),
                  p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if "experts" in a:
            t[p + "mlp.gate.weight"] = (a["experts"], h)
            for e in range(a["experts"]):
                q = f"{p}mlp.experts.{e}."
                t.update({q + "gate_proj.weight": (a["moe_inter"], h), q + "up_proj.weight": (a["moe_inter"], h),
                          q + "down_proj.weight": (h, a["moe_inter"])})
        else:
            t.update({p + "mlp.gate_proj.weight": (a["inter"], h), p + "mlp.up_proj.weight": (a["inter"], h),
                      p + "mlp.down_proj.weight": (h, a["inter"])})
    config = {"num_attention_heads": a["heads"], "num_key_value_heads": a["kv"],
              **({"num_experts": a["experts"]} if "experts" in a else {})}
    return {n: (s, BF16) for n, s in t.items()}, config


ENGINES = {"copy": Calibration(),   # the calibrated engine: a device copy into its parameters
           "vllm": replace(Calibration(), reload_gbps=REAL_VLLM_RELOAD_GBPS)}   # vLLM 0.26's layerwise reload


def case(name: str, a: dict, tp: int, topo: Topology) -> dict:
    tensors, config = checkpoint(a)
    sizes = [math.prod(s) * i for s, i in tensors.values()]
    spec = ModelSpec(sum(sizes), len(sizes), max(sizes))
    layouts = {"tp": estimate(tensors, config, tp)}
    if "experts" in a:
        layouts["tp+ep"] = estimate(tensors, config, tp, ep=True)
    out = {"model": name, "bytes": spec.total_bytes, "tensors": spec.tensors,
           "layouts": {k: {"received_bytes_per_rank_max": v.most_bytes, "tensors_per_rank": max(v.tensors),
                           "received_fraction": round(v.most_bytes / spec.total_bytes, 4)} for k, v in layouts.items()}}
    for engine, cal in ENGINES.items():
        whole = predict(spec, topo, cal=cal)
        out[engine] = {"whole": _brief(whole)}
        for key, load in layouts.items():
            sliced = predict(spec, topo, cal=cal, slices=load)
            out[engine][key] = {**_brief(sliced), "speedup": round(whole["update_s"] / sliced["update_s"], 2)}
    return out


def _brief(doc: dict) -> dict:
    return {"update_s": doc["update_s"], "stages_s": doc["stages_s"], "bottleneck": doc["bottleneck"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--device-free-gib", type=float, default=16.0)
    ap.add_argument("--out", help="write the JSON there too")
    args = ap.parse_args(argv)
    topo = Topology(nodes=1, devices_per_node=args.tp, device_free_gib=args.device_free_gib)
    doc = {"kind": "prediction (capacity planner; no GPU ran)", "topology": {"nodes": 1, "devices": args.tp},
           "engines": {k: {"reload_gbps": c.reload_gbps, "per_tensor_s": c.per_tensor_s} for k, c in ENGINES.items()},
           "calibration_source": Calibration().source,
           "cases": [case(n, a, args.tp, topo) for n, a in ARCHS.items()]}
    for c in doc["cases"]:
        fractions = ", ".join(f"{k} {v['received_fraction']:.3f}" for k, v in c["layouts"].items())
        print(f"{c['model']}: {c['bytes'] / (1 << 30):.1f} GiB, {c['tensors']} tensors; received per rank: {fractions}")
        for engine in ENGINES:
            e = c[engine]
            row = [f"whole {e['whole']['update_s']:.3f} s ({e['whole']['bottleneck']})"]
            row += [f"{k} {e[k]['update_s']:.3f} s ({e[k]['bottleneck']}, x{e[k]['speedup']})" for k in c["layouts"]]
            print(f"  {engine:>5} reload ({ENGINES[engine].reload_gbps:g} GB/s, "
                  f"{ENGINES[engine].per_tensor_s * 1e6:.1f} us/tensor): " + "; ".join(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
