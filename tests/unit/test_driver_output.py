"""The drivers' JSON report lines: one write each, so ranks sharing torchrun's stdout never split
another rank's line (issue found in a full run: two ranks' lines fused into one)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = r"""
import sys
from ckpt_core.engines.driver import emit_json_line
for i in range(400):
    emit_json_line({"rank": int(sys.argv[1]), "i": i, "pad": "x" * 600})
"""


def test_lines_of_concurrent_unbuffered_writers_never_interleave():
    """8 processes, unbuffered (PYTHONUNBUFFERED=1, as cluster jobs often run), one pipe."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    r, w = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(k)], stdout=w, env=env) for k in range(8)]
    os.close(w)
    with os.fdopen(r) as f:
        lines = f.read().splitlines()
    assert all(p.wait(60) == 0 for p in procs)
    got = [json.loads(line) for line in lines]   # a fused line fails to parse
    assert sorted((x["rank"], x["i"]) for x in got) == [(k, i) for k in range(8) for i in range(400)]


def test_a_captured_stdout_gets_the_line_too(capsys):
    from ckpt_core.engines.driver import emit_json_line
    emit_json_line({"a": 1})
    assert json.loads(capsys.readouterr().out) == {"a": 1}
