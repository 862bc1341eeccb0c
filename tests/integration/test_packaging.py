"""Something to pin: the wheel and the sdist build from the checkout, carry what they promise (license,
typing markers, metadata; the docs and examples in the sdist), and the wheel installed into a clean
virtualenv runs the README quickstart and answers `ckpt-engine --version` without importing torch or numpy.

The builds call setuptools' PEP 517 hooks directly, as `python -m build --no-isolation` does (the
project environment has setuptools; nothing is downloaded). The clean virtualenv gets the project
environment's site-packages through a .pth file (torch, pyzmq, httpx, numpy: the CPU torch
scripts/_common.sh pins, never a CUDA download) and the wheel with `--no-deps --no-index`, so every
ckpt-engine module it imports comes from the wheel. The full dependency resolution from pyproject.toml
is tests/integration/test_clean_install.py's (slow).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from support.readme_code import ROOT, run_quickstart

HEAVY = {"torch", "numpy", "safetensors", "zmq", "requests"}   # what `ckpt-engine --version` must not import
PACKAGES = ("ckpt_core", "ckpt_vllm", "ckpt_sglang", "ckpt_ascend")
SKIP = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", "build", "dist", "*.egg-info", ".venv", ".pytest_cache")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _build(src: Path, out: Path) -> tuple[Path, Path]:
    """(sdist, wheel) of the sources in ``src``, through the PEP 517 hooks, each in a process of its own
    as a build frontend calls them (in one process setuptools put the wheel beside the sdist's files)."""
    built = []
    for hook in ("build_sdist", "build_wheel"):
        code = f"import sys; from setuptools import build_meta as b; print('BUILT', b.{hook}(sys.argv[1]))"
        proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=str(src), capture_output=True, text=True,
                              env=_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        built.append(out / next(line for line in proc.stdout.splitlines() if line.startswith("BUILT ")).split()[1])
        assert built[-1].is_file(), f"{hook} said {built[-1].name}, which is not in {out}"
    return built[0], built[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)   # the checkout as it is, new files included
    (tmp / "dist").mkdir()
    return _build(src, tmp / "dist")


def test_the_sdist_carries_the_docs_examples_changelog_license_and_builds_a_wheel_itself(built, tmp_path):
    sdist, _ = built
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        tar.extractall(tmp_path, filter="data")
    for doc in (ROOT / "docs").glob("*.md"):
        assert f"docs/{doc.name}" in names, doc.name
    for example in (ROOT / "examples").glob("*.py"):
        assert f"examples/{example.name}" in names, example.name
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"} <= names
    assert {f"{p}/py.typed" for p in PACKAGES} <= names
    (tmp_path / "again").mkdir()
    _, wheel = _build(tmp_path / sdist.name.removesuffix(".tar.gz"), tmp_path / "again")
    assert wheel.name == built[1].name, "the sdist alone builds the same wheel"


def test_the_wheel_carries_the_license_typing_markers_and_the_metadata_to_pin(built):
    _, wheel = built
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = whl.read(f"{info}/METADATA").decode()
    assert {f"{p}/py.typed" for p in PACKAGES} <= names
    assert f"{info}/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in meta and "Requires-Python: >=3.11" in meta
    assert "Classifier: Typing :: Typed" in meta and "Classifier: Programming Language :: Python :: 3.11" in meta


def test_the_wheel_in_a_clean_venv_runs_the_quickstart_and_the_console_script(built, tmp_path):
    _, wheel = built
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120, env=_env())
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, env=_env()).stdout.strip()
    # the project environment's packages (torch & co.), behind the venv's own: no download at all
    Path(purelib, "project_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", str(wheel)],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]

    work = tmp_path / "elsewhere"   # not the checkout: only the installed package can be imported
    work.mkdir()
    where = subprocess.run([str(py), "-c", "import ckpt_core, ckpt_vllm, ckpt_sglang, ckpt_ascend; "
                            "print(ckpt_core.__file__)"], capture_output=True, text=True, cwd=str(work),
                           env=_env(), timeout=120)
    assert where.returncode == 0 and where.stdout.startswith(purelib), (where.stdout, where.stderr[-3000:])
    # engines by name through the installed entry points (no source tree beside the installed package)
    engines = subprocess.run([str(py), "-c", "from ckpt_core.engines import get_engine as g; from ckpt_core.engines "
                              "import registry as r; print(r.source_tree_entry_points(), g('vllm').routes, "
                              "g('sglang').name)"], capture_output=True, text=True, cwd=str(work), env=_env(),
                             timeout=120)
    assert engines.stdout.split() == ["[]", "('/collective_rpc',)", "sglang"], (engines.stdout, engines.stderr[-3000:])

    # --version answers without the heavy imports (torch, numpy): asked of the interpreter's own import
    # log, not of a wall clock (a loaded CI machine once took 5.2 s where an idle one takes 0.4 s)
    version = subprocess.run([str(venv / "bin" / "ckpt-engine"), "--version"], capture_output=True, text=True,
                             cwd=str(work), env={**_env(), "PYTHONPROFILEIMPORTTIME": "1"}, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == "ckpt-engine 0.1.0", version
    imported = {line.rsplit("|", 1)[1].strip() for line in version.stderr.splitlines()
                if line.startswith("import time:")}
    assert "ckpt_core" in imported and "importlib.metadata" in imported, version.stderr[-2000:]
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, f"ckpt-engine --version imported {heavy[:8]}"

    quick = run_quickstart(str(py), work, pythonpath=None, timeout=300)
    assert quick.returncode == 0, f"the README quickstart failed:\n{quick.stdout[-2000:]}\n{quick.stderr[-4000:]}"
    assert "'total'" in quick.stdout, quick.stdout
