"""Set-up for the NPU backend's tests: the installed package's entry points, a fake board, a fake torch_npu.

Nothing here imports torch_npu into the test process: the fake cannot be undone once
imported (it renames torch's PrivateUse1 backend), and with the ``npu`` entry point
loaded the registry would then pick ``npu`` as the default kind for unrelated tests.
Code that needs the fake runs in child processes (``run_py``, or the harness's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from . import npu_board

ROOT = Path(__file__).resolve().parents[2]
FAKES = Path(__file__).resolve().parent
BIN = FAKES / "bin"


def install_project(dest: Path) -> Path:
    """Install ckpt-engine (no dependencies) into ``dest`` as pip would; returns ``dest``.

    Builds the wheel from a copy of the sources with setuptools (as pip does) and unpacks
    it with its ``.dist-info``, so ``importlib.metadata`` finds the entry points that
    pyproject.toml declares. Without setuptools, writes the ``.dist-info`` from
    pyproject.toml's own tables instead (still a real entry-point lookup).
    """
    dest.mkdir(parents=True, exist_ok=True)
    src = dest.parent / (dest.name + "-src")
    src.mkdir(exist_ok=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):   # LICENSE: pyproject's license-files
        shutil.copy(ROOT / name, src / name)
    for pkg in ("ckpt_core", "ckpt_vllm", "ckpt_sglang", "ckpt_ascend"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    try:
        import setuptools  # noqa: F401
    except ImportError:
        return _write_dist_info(dest)
    wheels = dest.parent / (dest.name + "-wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("ckpt_engine-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    return dest


_INSTALLED: list[Path] = []   # one per pytest process: each module that imports the fixture has its own copy


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Path:
    """ckpt-engine installed into a folder of its own (``install_project``), once per session; import
    it into a test module."""
    if not _INSTALLED:
        _INSTALLED.append(install_project(tmp_path_factory.mktemp("site") / "site"))
    return _INSTALLED[0]


def _write_dist_info(dest: Path) -> Path:
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = dest / f"ckpt_engine-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ckpt-engine\nVersion: {meta['version']}\n")
    lines = []
    for group, eps in meta.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return dest


def board_env(state: Path, npu_ids: list[int], chips: int, *, proc_mem: str = "ok",
              visible: str | None = None) -> dict[str, str]:
    """Environment of a process on a fake board: fake npu-smi first on PATH, the board's state folder."""
    npu_board.make_board(str(state), npu_ids, chips, proc_mem)
    env = {"FAKE_NPU_STATE": str(state), "FAKE_NPU_PYTHON": sys.executable,
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    if visible is not None:
        env["ASCEND_RT_VISIBLE_DEVICES"] = visible
    return env


def run_py(code: str, env: dict[str, str], *, paths: list[Path], timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter with ``paths`` first on sys.path; returns its stdout.

    The environment is the test's, without PYTHONPATH and ASCEND_RT_VISIBLE_DEVICES unless
    ``env`` sets them. A failing child fails the test with its stderr.
    """
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASCEND_RT_VISIBLE_DEVICES")}
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    done = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=timeout,
                          cwd=tempfile.gettempdir())   # not the checkout: "-c" puts the working folder on sys.path
    assert done.returncode == 0, f"child failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return done.stdout
