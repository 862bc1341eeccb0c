"""The README's environment-variable table lists exactly the variables ckpt_core reads, with their defaults."""

import re
from pathlib import Path

from ckpt_core._settings import ENV_VARS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_table_matches_ENV_VARS():
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `([A-Z0-9_]+)` \| (\w+) \| (.+?) \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    assert set(rows) == set(ENV_VARS), f"README lacks {set(ENV_VARS) - set(rows)}, has extra {set(rows) - set(ENV_VARS)}"
    for name, (typ, default, _) in ENV_VARS.items():
        shown = rows[name][1]
        assert rows[name][0] == typ, name
        assert shown == f"`{default}`" or (default == "" and shown == "(empty)"), (name, shown, default)
