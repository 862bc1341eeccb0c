"""scripts/_common.sh's cached virtualenvs: a failed build is never stamped, a foreign directory never deleted.

Runs the real shell functions the way test.sh and demo.sh call them (``PY=$(ensure_project_venv)``
under ``set -e``), with pip unable to reach any index.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def run_bash(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source {REPO}/scripts/_common.sh; {script}"],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=240)


NO_INDEX = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": "", "PIP_CONFIG_FILE": os.devnull,
            "CKPT_BASE_PYTHON": sys.executable if "venv" not in sys.executable else "python3"}


def test_a_failed_project_venv_install_is_not_stamped_and_says_what_failed(tmp_path):
    venv = tmp_path / "venv"
    env = {**NO_INDEX, "CKPT_PROJECT_VENV": str(venv)}
    for attempt in range(2):   # the second run must rebuild, not reuse a broken venv
        proc = run_bash('PY=$(ensure_project_venv); echo "reached: $PY"', env)
        assert proc.returncode != 0, proc.stdout
        assert "reached" not in proc.stdout
        assert "pip install" in proc.stderr and "failed" in proc.stderr, proc.stderr[-2000:]
        assert not (venv / ".ckpt-installed").exists(), f"attempt {attempt}: a failed build was stamped"


def test_an_existing_directory_we_did_not_create_is_refused_and_kept(tmp_path):
    theirs = tmp_path / "my-venv"
    (theirs / "bin").mkdir(parents=True)
    (theirs / "bin" / "python").write_text("precious")
    proc = run_bash('PY=$(ensure_project_venv); echo "reached: $PY"', {**NO_INDEX, "CKPT_PROJECT_VENV": str(theirs)})
    assert proc.returncode != 0 and "reached" not in proc.stdout
    assert "refusing to use" in proc.stderr and "nothing was deleted" in proc.stderr, proc.stderr[-2000:]
    assert (theirs / "bin" / "python").read_text() == "precious"


def test_an_unfinished_venv_of_ours_is_rebuilt(tmp_path):
    venv = tmp_path / "venv"
    proc = run_bash(f'ckpt_cached_venv {venv} python3 30 false || echo "failed as it should"', {})
    assert "failed as it should" in proc.stdout and (venv / ".ckpt-venv").exists()
    assert not (venv / ".ckpt-installed").exists()
    proc = run_bash(f'ckpt_cached_venv {venv} python3 30 true && echo built', {})
    assert "built" in proc.stdout and (venv / ".ckpt-installed").exists(), proc.stderr[-2000:]
