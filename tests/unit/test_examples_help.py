"""Every example explains itself: ``--help`` exits 0 and prints what the example does (its docstring),
every numeric flag is bounded like ckpt-engine's own options (a value out of bounds is a usage error,
exit 2, naming the option), the examples import only public names, and the controller, which runs
where no torch may be installed, does not import torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TORCH_FREE = {"rl_controller.py"}   # a controller beside the services: httpx only

# Runs an example's `--help` and reports every argparse parser it built (subcommands' included).
PROBE = r'''
import argparse, json, runpy, sys
out, example = sys.argv[1], sys.argv[2]
parsers, init = [], argparse.ArgumentParser.__init__
def recording_init(self, *a, **k):
    init(self, *a, **k)
    parsers.append(self)
argparse.ArgumentParser.__init__ = recording_init
sys.argv = [example, "--help"]
code = 0
try:
    runpy.run_path(example, run_name="__main__")
except SystemExit as exc:
    code = exc.code
options = []
for p in parsers:
    for a in p._actions:
        if a.type is None or not a.option_strings:
            continue
        t = a.type
        try:   # ten times the upper bound must be refused by the type itself
            t(repr(10 * t.high))
            refuses_above = False
        except argparse.ArgumentTypeError:
            refuses_above = True
        except AttributeError:
            refuses_above = False
        options.append({"option": a.option_strings[-1], "bounded": getattr(t, "high", None) is not None,
                        "refuses_above": refuses_above})
with open(out, "w") as f:
    json.dump({"code": code, "options": options, "torch": "torch" in sys.modules}, f)
'''


def _help(example: Path, tmp_path: Path) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / f"{example.stem}.json"
    p = subprocess.run([sys.executable, "-c", PROBE, str(out), str(example)], capture_output=True, text=True,
                       timeout=300, cwd=str(tmp_path), env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.exists(), p.stderr[-3000:]
    return json.loads(out.read_text()), p


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_help_exits_0_and_explains_the_example_and_every_number_is_bounded(example, tmp_path):
    report, p = _help(example, tmp_path)
    assert report["code"] == 0, p.stderr[-3000:]
    first_line = ast.get_docstring(ast.parse(example.read_text())).splitlines()[0]
    assert p.stdout.startswith("usage:") and first_line in p.stdout, p.stdout[:2000]
    assert "torchrun" in p.stdout or "python examples/" in p.stdout, "the help shows how to run it"
    numeric = [o for o in report["options"]]
    assert all(o["bounded"] and o["refuses_above"] for o in numeric), \
        f"options without an upper bound (use ckpt_core.engines' types): {[o for o in numeric if not o['bounded']]}"
    if example.name in TORCH_FREE:
        assert not report["torch"], f"{example.name} --help imported torch"


def _imported_modules(example: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(example.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


PUBLIC = {"ckpt_core", "ckpt_core.client", "ckpt_core.engines", "ckpt_core.planning", "ckpt_vllm", "ckpt_sglang",
          # the RL frameworks' seams: public modules of their own (docs/api.md, Writing a driver)
          "ckpt_vllm.trainer", "ckpt_vllm.sync_client", "ckpt_vllm.trl"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_import_public_names_only_and_never_edit_sys_path(example):
    ours = {m for m in _imported_modules(example) if m.split(".")[0].startswith("ckpt_")}
    assert ours and ours <= PUBLIC, f"{example.name} imports internals: {sorted(ours - PUBLIC)}"
    assert "sys.path" not in example.read_text(), f"{example.name} edits sys.path"
