"""README.md does what it says: its quickstart runs as written, its table and plot are those the
recorded results give, its links lead somewhere, and it stays short."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from support.ports import run_with_master_port
from support.readme_code import README, ROOT, quickstart, run_quickstart


def test_the_quickstart_runs_as_written_and_the_engine_ends_with_the_new_weights(tmp_path):
    code = quickstart()
    assert len(code.strip().splitlines()) <= 15, "the quickstart stays about ten lines"
    p = run_quickstart(sys.executable, tmp_path, pythonpath=str(ROOT))
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    assert "'pipeline'" in p.stdout and "'total'" in p.stdout, p.stdout   # the printed update timings


def test_a_quickstart_whose_engine_misses_the_weights_fails(tmp_path):
    """The quickstart's own check can fail: with the load step removed the assert fires."""
    broken = quickstart().replace("engine[name].copy_(t)", "None")
    assert broken != quickstart()
    (tmp_path / "broken.py").write_text(broken)
    p = run_with_master_port([sys.executable, tmp_path / "broken.py"], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             timeout=300, cwd=str(tmp_path))
    assert p.returncode != 0 and "the engine must hold the new weights" in p.stderr, p.stderr[-2000:]


def test_the_table_and_the_plot_are_generated_from_the_recorded_results():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_results.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    table = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_results.py"), "--table"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert "| 1x H200 | real vLLM 0.26.0 |" in table and "0.313 s" in table and "0.526 s" in table, table


def test_every_relative_link_and_named_file_exists():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    named = re.findall(r"`((?:tests|examples|scripts|benchmarks|docs)/[\w./-]+\.(?:py|sh|md|svg))`", text)
    assert links and named
    missing = [p for p in links + named if not p.startswith("http") and not (ROOT / p).exists()]
    assert not missing, f"README.md points to files that do not exist: {missing}"


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) < 200
