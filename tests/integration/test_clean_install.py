"""The package installs from pyproject.toml alone into a fresh virtualenv, and the README quickstart
and the console script run there: every import the code makes at run time is declared.

torch is installed first, as on a user's machine that already has the torch build it wants (the
same requirement the project's own virtualenv installs: scripts/_common.sh, `torch==2.13.0`,
found by pip's configured local wheel folder); everything else, numpy included, must come from
what pyproject.toml declares. The package is installed non-editable from a copy of its sources
and run from outside the repository with PYTHONPATH unset, so nothing of the checkout leaks in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from support.readme_code import ROOT, run_quickstart

TORCH = "torch==2.13.0"   # what scripts/_common.sh installs into the project venv


def _pip(python: Path, log: Path, *args: str, timeout: float = 600) -> None:
    with open(log, "a") as out:
        p = subprocess.run([str(python), "-m", "pip", "install", "--no-input", "--no-compile", *args], stdout=out,
                           stderr=subprocess.STDOUT, timeout=timeout, env=_clean_env())
    assert p.returncode == 0, f"pip install {' '.join(args)} failed; its output ends:\n{log.read_text()[-4000:]}"


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _copy_sources(dst: Path) -> Path:
    """pyproject.toml, README.md, the license file, the manifest and the packages pyproject lists: what a
    source distribution holds of them."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "CHANGELOG.md"):
        shutil.copy(ROOT / name, dst / name)
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in sorted({p.rstrip("*") for p in include}):
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fresh_venv_from_pyproject_alone_runs_the_quickstart_and_the_cli(tmp_path):
    src, venv, log = _copy_sources(tmp_path / "src"), tmp_path / "venv", tmp_path / "pip.log"
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120, env=_clean_env())
    py = venv / "bin" / "python"
    _pip(py, log, TORCH)
    _pip(py, log, f"{src}[server]")
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True, env=_clean_env()).stdout
    assert "numpy==" in listed, "numpy comes from pyproject.toml's dependencies (torch does not pull it)"
    check = subprocess.run([str(py), "-m", "pip", "check"], capture_output=True, text=True, env=_clean_env())
    assert check.returncode == 0, check.stdout + check.stderr

    work = tmp_path / "elsewhere"   # not the checkout: only the installed package can be imported
    work.mkdir()
    where = subprocess.run([str(py), "-c", "import ckpt_core, ckpt_vllm, ckpt_sglang, ckpt_ascend; "
                            "print(ckpt_core.__file__)"], capture_output=True, text=True, cwd=str(work),
                           env=_clean_env(), timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    assert str(venv) in where.stdout, f"imported from {where.stdout.strip()}, not the fresh venv"

    p = run_quickstart(str(py), work, pythonpath=None)
    assert p.returncode == 0, f"the README quickstart failed in a fresh venv:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    assert "'total'" in p.stdout, p.stdout

    cli = venv / "bin" / "ckpt-engine"
    for args in (["--help"], ["serve", "--help"], ["--json", "plan", "--size-gib", "16", "--tensors", "300"]):
        out = subprocess.run([str(cli), *args], capture_output=True, text=True, cwd=str(work), env=_clean_env(),
                             timeout=120)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (args, out.stdout[-1000:], out.stderr[-3000:])
