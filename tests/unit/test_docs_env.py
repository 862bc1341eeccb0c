"""docs/api.md's environment-variable table lists exactly the variables ckpt_core reads: every name
that ckpt_core/_settings.py looks up, with ENV_VARS' type and default, and a unit for every
duration and size."""

import re
from pathlib import Path

from ckpt_core._settings import ENV_VARS

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
SETTINGS = ROOT / "ckpt_core" / "_settings.py"
ROW = re.compile(r"\| `([A-Z0-9_]+)` \| (\w+) \| (.+?) \| (.+) \|$")


def _table() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in API.read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return rows


def _names_read_by_settings() -> set[str]:
    """Every variable name _settings.py passes to a lookup (os.environ.get, _get, _bool)."""
    src = SETTINGS.read_text()
    return set(re.findall(r'(?:os\.environ\.get|_get|_bool)\(\s*"([A-Z][A-Z0-9_]*)"', src))


def test_the_table_matches_ENV_VARS_names_types_and_defaults():
    rows = _table()
    assert set(rows) == set(ENV_VARS), f"docs/api.md lacks {set(ENV_VARS) - set(rows)}, has extra {set(rows) - set(ENV_VARS)}"
    for name, (typ, default, _) in ENV_VARS.items():
        shown = rows[name][1]
        assert rows[name][0] == typ, name
        assert shown == f"`{default}`" or (default == "" and shown == "(empty)"), (name, shown, default)


def test_every_variable_settings_reads_is_in_ENV_VARS_and_the_table():
    read = _names_read_by_settings()
    assert len(read) >= 15, f"the lookups were not found in {SETTINGS} (pattern out of date?): {read}"
    assert read - set(ENV_VARS) == set(), f"_settings.py reads {read - set(ENV_VARS)} but ENV_VARS lacks them"
    assert read - set(_table()) == set(), f"docs/api.md lacks {read - set(_table())}"


def test_every_duration_and_size_states_its_unit():
    for name, (typ, _, meaning) in _table().items():
        if name.endswith("_S"):
            assert "second" in meaning, f"{name}: say that it is in seconds"
        if "_GB" in name:
            assert "GiB" in meaning or "GB/s" in meaning, f"{name}: say GiB (or GB/s)"
