"""Bytes a joining world reads over the network for a P2P delta, against the full checkpoint (issue 39).

A Qwen2-shaped model (``delta_density.Qwen2Like``, 15 M parameters by default) trains with AdamW on
float32 master weights; each step's bf16 snapshot is a version. An owner world (2 PS processes,
Mooncake TCP on 127.0.0.2, ``serve_p2p``) registers version 0 whole and every later version with
the previous one as its base, gathers each and saves its metas; a joining world (2 PS processes on
127.0.0.3, 2 engine-worker processes holding live tensors: ``tests/delta_world.DeltaEngine``) loads
them, pulls version 0 whole over P2P, then each later version as a P2P delta, and last the final
version whole again (the comparison). After every update each engine's tensors are checked
against the version's digests (bit-exact). Recorded per update: the elements changed, the bytes
the joiners read over the network (the sum of their ``read_bytes``), the version's bytes, and the
update's wall seconds (2 loaded CPU cores: an upper bound).

    python benchmarks/delta_p2p.py --out benchmarks/results/2026-12-03-cpu-delta-p2p.json

``--fold``: instead, the joiners take version 0 whole, the owners drop version 0 and fold the last
version's chain of deltas into one from version 0 (``fold_delta``: the union of the chain's
payloads), and the joiners take the last version as that one delta; then whole. Recorded beside:
the fold's bytes against the chain's deltas together and against the direct delta (the last version
encoded against version 0 here, in this process: what a fold made while version 0 was registered
weighs), and the fold's seconds on each owner.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]   # the tests' worlds and engine

from delta_density import Qwen2Like, bf16_state, model_arguments, report  # noqa: E402
from support.delta_world import DeltaEngine  # noqa: E402
from support.data import want_digests  # noqa: E402
from support.engine import EngineFront  # noqa: E402
from support.world import PsWorld  # noqa: E402
from support.p2p_cases import JOINERS, OWNERS  # noqa: E402

from ckpt_core.delta.encode import changed_mask, encode_tensor  # noqa: E402

WORLD = 2


def versions(args) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Version k: the bf16 weights after k AdamW steps, split over the owner ranks (tensor i on rank i % 2)."""
    torch.manual_seed(args.seed)
    model = Qwen2Like(args.vocab, args.hidden, args.inter, args.layers, args.heads, args.kv_heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for step in range(args.steps + 1):
        if step:
            ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
            loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        state = bf16_state(model)
        out.append({r: {n: t for i, (n, t) in enumerate(state.items()) if i % WORLD == r} for r in range(WORLD)})
    return out


def _ok(got: dict) -> dict:
    bad = {r: o for r, o in got.items() if not o.ok}
    if bad:
        raise RuntimeError(f"a rank failed: {bad}")
    return got


def _changed(a: dict, b: dict) -> tuple[int, int]:
    n = sum(int(changed_mask(b[r][k], a[r][k]).sum()) for r in a for k in a[r])
    return n, sum(t.numel() for r in a for t in a[r].values())


def run(args) -> dict:
    vs = versions(args)
    names = [f"v{k}" for k in range(len(vs))]
    full = sum(t.numel() * t.element_size() for share in vs[0].values() for t in share.values())
    rows = []
    with tempfile.TemporaryDirectory() as tmp, PsWorld("cpu", WORLD, env=OWNERS) as owners, \
            PsWorld("cpu", WORLD, env=JOINERS) as joiners:
        front = EngineFront("cpu", WORLD, engine_cls=DeltaEngine)
        try:
            t0 = time.perf_counter()
            for k, name in enumerate(names):
                extra = {} if k == 0 else {"base": names[k - 1]}
                _ok(owners.all("register", per_rank={r: (name, {"named_tensors": vs[k][r], **extra})
                                                     for r in range(WORLD)}, timeout=600))
                _ok(owners.all("gather", name))
            register_s = time.perf_counter() - t0
            path = str(Path(tmp) / "metas.json")
            _ok(owners.all("call", ("support.delta_world", "save_metas", (path,))))
            _ok(joiners.all("load_metas", path))
            plan = [(names[0], False)] + [(n, True) for n in names[1:]] + [(names[-1], False)]
            if args.fold:
                plan = [(names[0], False), (names[-1], True), (names[-1], False)]
            fold = None
            for i, (name, mode) in enumerate(plan):
                k = names.index(name)
                if args.fold and mode:   # the joiners hold version 0: the owners fold the chain from it
                    fold = _fold(args, owners, joiners, names, vs, path)
                per = {w: {"version": name} for w in range(WORLD)}
                t1 = time.perf_counter()
                got = _ok(joiners.all("call", ("support.delta_world", "p2p_delta_update",
                                               (name, front.address, 300, list(range(WORLD)), per, mode)), timeout=600))
                wall = time.perf_counter() - t1
                want = want_digests(*vs[k].values())
                exact = all(front.digests(w) == want for w in range(WORLD))
                if not exact:
                    raise RuntimeError(f"an engine is not bit-exact with {name} after its update")
                read = sum(got[r].value["read_bytes"] for r in range(WORLD))
                row = {"update": name, "delta": mode, "read_bytes": read, "version_bytes": full,
                       "read_fraction": read / full, "seconds": wall, "bit_exact": exact}
                if mode:
                    fig = got[0].value["delta"]
                    changed, total = _changed(vs[names.index(fig["base"])], vs[k])
                    row.update(base=fig["base"], delta_bytes=fig["delta_bytes"], changed_fraction=changed / total)
                rows.append(row)
                print(f"{i}: {name} {'delta of ' + row['base'] if mode else 'whole'}: read {read / 1e6:.3f} MB of "
                      f"{full / 1e6:.3f} MB ({row['read_fraction']:.2%})"
                      + (f", {row['changed_fraction']:.2%} of the elements changed" if mode else "")
                      + f", {wall:.2f} s, bit-exact", flush=True)
        finally:
            front.close()
    deltas = [r for r in rows if r["delta"]]
    return {"date": args.date, "machine": "cpu", "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transport": "Mooncake TCP, loopback "
            "(owners 127.0.0.2, joiners 127.0.0.3)", "owners": WORLD, "joiners": WORLD, "lr": args.lr,
            "model": {k: getattr(args, k) for k in ("vocab", "hidden", "inter", "layers", "heads", "kv_heads")},
            "params": sum(t.numel() for share in vs[0].values() for t in share.values()), "register_s": register_s,
            "updates": rows, "fold": fold, "delta_read_fraction_max": max(r["read_fraction"] for r in deltas),
            "delta_read_fraction_mean": sum(r["read_fraction"] for r in deltas) / len(deltas)}


def _fold(args, owners, joiners, names, vs, path) -> dict:
    """The owners drop version 0 and fold the last version from it; the joiners load the new metas."""
    _ok(owners.all("unregister", (names[0], {})))
    t0 = time.perf_counter()
    figs = _ok(owners.all("call", ("support.delta_world", "fold_delta", (names[-1], names[0])), timeout=600))
    fold_s = time.perf_counter() - t0
    _ok(owners.all("gather", names[-1]))
    _ok(owners.all("call", ("support.delta_world", "save_metas", (path,))))
    _ok(joiners.all("load_metas", path))
    comp = f"{names[-1]}@delta:{names[0]}"
    size = _ok(joiners.all("call", ("support.delta_world", "companion_bytes", (comp,))))[0].value
    steps = [_ok(joiners.all("call", ("support.delta_world", "companion_bytes", (f"{n}@delta",))))[0].value
             for n in names[1:]]
    direct = sum(encode_tensor(vs[-1][r][k], vs[0][r][k])[1]["bytes"] for r in vs[0] for k in vs[0][r])
    out = {"companion": comp, "bytes": size, "chain_bytes": sum(steps), "step_bytes": steps, "direct_bytes": direct,
           "fold_s": fold_s, "encode_s": [figs[r].value["encode_s"] for r in sorted(figs)],
           "changed_elements": sum(figs[r].value["changed_elements"] for r in figs)}
    print(f"fold of {names[-1]} from {names[0]}: {size / 1e6:.3f} MB (the chain's deltas {sum(steps) / 1e6:.3f} MB, "
          f"the direct delta {direct / 1e6:.3f} MB), {fold_s:.2f} s", flush=True)
    return out


def summary(res: dict) -> str:
    lines = [f"P2P deltas over {res['transport']}: {res['params'] / 1e6:.1f} M parameters (bf16, "
             f"{res['updates'][0]['version_bytes'] / 1e6:.1f} MB), AdamW lr {res['lr']:g}, {res['owners']} owners, "
             f"{res['joiners']} joiners with live engines; every update checked bit-exact on every engine",
             "| update | kind | elements changed | read over the network | of the version | seconds |",
             "|---|---|---|---|---|---|"]
    for r in res["updates"]:
        kind = f"delta of {r['base']}" if r["delta"] else "whole"
        changed = f"{r['changed_fraction']:.2%}" if r["delta"] else "-"
        lines.append(f"| {r['update']} | {kind} | {changed} | {r['read_bytes'] / 1e6:.3f} MB | "
                     f"{r['read_fraction']:.2%} | {r['seconds']:.2f} |")
    if res.get("fold"):
        f = res["fold"]
        encode = ", ".join(f"{s:.2f}" for s in f["encode_s"])
        lines.append(f"fold {f['companion']}: {f['bytes'] / 1e6:.3f} MB, the chain's deltas together "
                     f"{f['chain_bytes'] / 1e6:.3f} MB, the direct delta {f['direct_bytes'] / 1e6:.3f} MB; "
                     f"fold_delta {f['fold_s']:.2f} s (encode per owner {encode} s)")
    goal = "one fold of every step" if res.get("fold") else "goal: <= 12 %"
    lines.append(f"deltas read {res['delta_read_fraction_mean']:.2%} of the version's bytes on average, "
                 f"{res['delta_read_fraction_max']:.2%} at most ({goal})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lr", type=float, default=1e-6, help="1e-6: the ~2 %% density measured in docs/deltas.md")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--fold", action="store_true", help="take the last version as one fold of the chain from version 0")
    model_arguments(ap)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here (and a .txt summary beside)")
    args = ap.parse_args(argv)
    if not 1 <= args.steps <= 100 or not 0 < args.lr < 1:
        ap.error("--steps must be in [1, 100] and --lr in (0, 1)")
    res = run(args)
    report(res, summary(res), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
