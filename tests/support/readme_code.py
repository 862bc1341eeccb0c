"""The README's code, as a reader copies it: the quickstart block, run in a fresh process."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from support.ports import run_with_master_port

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def quickstart() -> str:
    """The first ```python block under '## Quickstart'."""
    text = README.read_text()
    section = text[text.index("\n## Quickstart"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README.md's Quickstart section has no ```python block"
    return m.group(1)


def run_quickstart(python: str, cwd: Path, *, pythonpath: str | None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the quickstart with ``python`` in ``cwd``: ``pythonpath`` None means the installed package
    only (PYTHONPATH unset). MASTER_PORT is a free port (the default 29500 may be taken here), another
    if its store could not bind that one (``run_with_master_port``)."""
    script = cwd / "quickstart.py"
    script.write_text(quickstart())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return run_with_master_port([python, script], env=env, timeout=timeout, cwd=str(cwd))
