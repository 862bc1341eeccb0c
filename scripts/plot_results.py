#!/usr/bin/env python3
"""Draw the README's plot and print its tables of figures, all from benchmarks/results/*.json.

    python3 scripts/plot_results.py             # writes docs/img/update-time.svg
    python3 scripts/plot_results.py --headline  # prints the README's small table (no run names)
    python3 scripts/plot_results.py --table     # prints docs/verification.md's table (every case, its run)
    python3 scripts/plot_results.py --summary   # a few lines of the headline figures (scripts/demo.sh)
    python3 scripts/plot_results.py --check     # exits 1 if the committed SVG or either table is stale

Only the standard library: the SVG is written by hand, so no plotting package is needed. Every
number comes from a recorded run named below; nothing is typed in here except which runs to show.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SVG = ROOT / "docs" / "img" / "update-time.svg"
README = ROOT / "README.md"
VERIFICATION = ROOT / "docs" / "verification.md"
GiB = float(1 << 30)

# The runs shown: one H200 with the benchmark's simulated engine (the transfer), and one H200
# with a real vLLM 0.26.0 (ours, and the reference checkpoint-engine 0.4.2 on the same model).
SIMULATED_1GPU = "2026-12-01-1xH200-0388eb2-tiny-moe8-dense16.json"
SIMULATED_2GPU = "2026-11-30-2xH200-7b50b1f-all-cases.json"
VLLM_OURS = "2026-12-01-1xH200-e1bbe20-vllm026-7b-bf16-side-by-side.json"
VLLM_REFERENCE = VLLM_OURS   # one run, the same engine build and checkpoint for both
CASE_LABEL = {"tiny": "64 MiB (fixed cost)", "moe8": "MoE", "dense16": "dense", "dense40": "dense"}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _bench_points(name: str) -> list[dict]:
    """update_bench.py cases: size, first (warm-up) and best update, the run's own floor."""
    doc = _load(name)
    return [{"case": c["case"], "gib": c["bytes"] / GiB, "tensors": c["tensors"], "first": c["warmup_update_s"],
             "best": c["update"]["best_s"], "floor": c["floor"]["seconds"], "file": name} for c in doc["cases"]]


def _vllm_point(name: str, impl: str, h2d_gbps: float) -> dict:
    """vllm_bench.py: the first update, then the best of the rest; the floor is H2D of every byte."""
    doc = _load(name)
    run = next(r for r in doc["runs"] if r["impl"] == impl and "update_s" in r)
    return {"gib": run["bytes"] / GiB, "tensors": doc["checkpoint"]["tensors"], "first": run["update_s"][0],
            "best": min(run["update_s"][1:]), "floor": run["bytes"] / (h2d_gbps * 1e9), "file": name}


def collect() -> dict:
    sim1 = _bench_points(SIMULATED_1GPU)
    h2d = _load(SIMULATED_1GPU)["ceilings"]["h2d_gbps"][0]   # the same kind of host, measured alone
    return {"sim1": sim1, "sim2": _bench_points(SIMULATED_2GPU), "h2d_1gpu": h2d,
            "vllm_ours": _vllm_point(VLLM_OURS, "ours", h2d), "vllm_ref": _vllm_point(VLLM_REFERENCE, "reference", h2d)}


def table(d: dict) -> str:
    rows = ["| hardware | engine | checkpoint | ckpt-engine first / best | checkpoint-engine 0.4.2 first / best "
            "| floor | run |", "|---|---|---|---|---|---|---|"]
    o, r = d["vllm_ours"], d["vllm_ref"]
    rows.append(f"| 1x H200 | real vLLM 0.26.0 | 7B-shaped bf16, {o['gib']:.2f} GiB, {o['tensors']} tensors "
                f"| {o['first']:.3f} / **{o['best']:.3f} s** | {r['first']:.3f} / {r['best']:.3f} s "
                f"| {o['floor']:.3f} s | {', '.join(f'`{Path(f).stem}`' for f in dict.fromkeys((o['file'], r['file'])))} |")
    for hw, key in (("1x H200", "sim1"), ("2x H200", "sim2")):
        for p in sorted(d[key], key=lambda p: p["gib"], reverse=True):
            what = CASE_LABEL[p["case"]] if p["case"] == "tiny" else \
                f"{CASE_LABEL[p['case']]} bf16, {p['gib']:.2f} GiB, {p['tensors']} tensors"
            rows.append(f"| {hw} | simulated engine | {what} | {p['first']:.3f} / "
                        f"**{p['best']:.3f} s** | not recorded | {p['floor']:.3f} s | `{Path(p['file']).stem}` |")
    return "\n".join(rows) + "\n"


def headline(d: dict) -> str:
    """The README's table: the largest case of each run shown, best of 3, without the runs' names."""
    rows = ["| hardware | engine | checkpoint | ckpt-engine | checkpoint-engine 0.4.2 | floor (H2D alone) |",
            "|---|---|---|---|---|---|"]
    o, r = d["vllm_ours"], d["vllm_ref"]
    rows.append(f"| 1x H200 | real vLLM 0.26.0 | {o['gib']:.2f} GiB bf16 (7B-shaped) | **{o['best']:.3f} s** "
                f"({o['gib'] * GiB / o['best'] / 1e9:.1f} GB/s) | {r['best']:.3f} s | {o['floor']:.3f} s |")
    for hw, key in (("1x H200", "sim1"), ("2x H200", "sim2")):
        p = max(d[key], key=lambda p: p["gib"])
        rows.append(f"| {hw} | simulated engine | {p['gib']:.2f} GiB bf16 | **{p['best']:.3f} s** "
                    f"({p['gib'] * GiB / p['best'] / 1e9:.1f} GB/s) | not run | {p['floor']:.3f} s |")
    return "\n".join(rows) + "\n"


def summary(d: dict) -> str:
    """A few lines for a terminal (scripts/demo.sh): the headline runs."""
    o, r = d["vllm_ours"], d["vllm_ref"]
    lines = [f"  1x H200, real vLLM 0.26.0, {o['gib']:.2f} GiB bf16: ckpt-engine {o['best']:.3f} s "
             f"({o['gib'] * GiB / o['best'] / 1e9:.1f} GB/s), checkpoint-engine 0.4.2 {r['best']:.3f} s, "
             f"floor {o['floor']:.3f} s"]
    for hw, key in (("1x H200", "sim1"), ("2x H200", "sim2")):
        p = max(d[key], key=lambda p: p["gib"])
        lines.append(f"  {hw}, simulated engine, {p['gib']:.2f} GiB: ckpt-engine {p['best']:.3f} s "
                     f"({p['gib'] * GiB / p['best'] / 1e9:.1f} GB/s), floor {p['floor']:.3f} s")
    return "\n".join(lines) + "\n"


def svg(d: dict) -> str:
    """Update time against checkpoint size on one H200: ours, the reference, and the floor."""
    w, h, left, right, top, bottom = 720, 400, 64, 250, 40, 52
    pts = d["sim1"] + [d["vllm_ours"], d["vllm_ref"]]
    xstep, ystep = 4, 0.1   # tick spacing: GiB, seconds
    xmax = xstep * math.ceil(max(p["gib"] for p in pts) * 1.05 / xstep)
    ymax = ystep * math.ceil(max(p["best"] for p in pts) * 1.1 / ystep)
    X = lambda g: left + (w - left - right) * g / xmax   # noqa: E731
    Y = lambda s: h - bottom - (h - top - bottom) * s / ymax   # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14" font-weight="bold">Update time vs checkpoint size, one NVIDIA '
           'H200 (best of 3)</text>']
    for i in range(round(ymax / ystep) + 1):   # grid and ticks
        s = ystep * i
        out.append(f'<line x1="{left}" y1="{Y(s):.1f}" x2="{w - right}" y2="{Y(s):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{Y(s) + 4:.1f}" text-anchor="end">{s:.1f}</text>')
    for i in range(round(xmax / xstep) + 1):
        g = xstep * i
        out.append(f'<text x="{X(g):.1f}" y="{h - bottom + 16}" text-anchor="middle">{g}</text>')
    out.append(f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">checkpoint size, GiB</text>')
    out.append(f'<text transform="translate(16 {(top + h - bottom) / 2}) rotate(-90)" text-anchor="middle">'
               'update time, s</text>')
    f_end = xmax
    out.append(f'<line x1="{X(0):.1f}" y1="{Y(0):.1f}" x2="{X(f_end):.1f}" y2="{Y(f_end * GiB / (d["h2d_1gpu"] * 1e9)):.1f}"'
               ' stroke="#888" stroke-dasharray="5 4" stroke-width="1.5"/>')
    sim = sorted(d["sim1"], key=lambda p: p["gib"])
    out.append('<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="'
               + " ".join(f"{X(p['gib']):.1f},{Y(p['best']):.1f}" for p in sim) + '"/>')
    for p in sim:
        out.append(f'<circle cx="{X(p["gib"]):.1f}" cy="{Y(p["best"]):.1f}" r="4" fill="#1f77b4"/>')
    o, r = d["vllm_ours"], d["vllm_ref"]
    out.append(f'<rect x="{X(o["gib"]) - 5:.1f}" y="{Y(o["best"]) - 5:.1f}" width="10" height="10" fill="#2ca02c"/>')
    out.append(f'<path d="M{X(r["gib"]) - 5:.1f},{Y(r["best"]) - 5:.1f} l10,10 m0,-10 l-10,10" stroke="#d62728" '
               'stroke-width="3"/>')
    legend = [("line", "#1f77b4", "ckpt-engine, simulated engine"), ("rect", "#2ca02c", "ckpt-engine, real vLLM 0.26"),
              ("x", "#d62728", "checkpoint-engine 0.4.2, real vLLM"),
              ("dash", "#888", f"floor: H2D at {d['h2d_1gpu']:.1f} GB/s")]
    lx, ly = w - right + 10, top + 10
    for i, (kind, color, text) in enumerate(legend):
        y = ly + 22 * i
        if kind == "line":
            out.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 18}" y2="{y}" stroke="{color}" stroke-width="2"/>')
        elif kind == "dash":
            out.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 18}" y2="{y}" stroke="{color}" stroke-dasharray="5 4"/>')
        elif kind == "rect":
            out.append(f'<rect x="{lx + 4}" y="{y - 5}" width="10" height="10" fill="{color}"/>')
        else:
            out.append(f'<path d="M{lx + 4},{y - 5} l10,10 m0,-10 l-10,10" stroke="{color}" stroke-width="3"/>')
        out.append(f'<text x="{lx + 24}" y="{y + 4}" font-size="11">{text}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print docs/verification.md's table instead of writing the SVG")
    ap.add_argument("--headline", action="store_true", help="print the README's small table")
    ap.add_argument("--summary", action="store_true", help="print a few lines of the headline figures")
    ap.add_argument("--check", action="store_true", help="fail if the committed SVG or a table is stale")
    ap.add_argument("--out", type=Path, default=SVG, help=f"where the SVG goes (default {SVG.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    d = collect()
    if args.table or args.summary or args.headline:
        sys.stdout.write(table(d) if args.table else headline(d) if args.headline else summary(d))
        return 0
    if args.check:
        stale = [what for what, ok in (("docs/img/update-time.svg", SVG.exists() and SVG.read_text() == svg(d)),
                                       ("README.md's table (--headline)", headline(d) in README.read_text()),
                                       ("docs/verification.md's table (--table)", table(d) in VERIFICATION.read_text()))
                 if not ok]
        for what in stale:
            print(f"stale: {what} (run python3 scripts/plot_results.py and paste its tables)", file=sys.stderr)
        return 1 if stale else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg(d))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
