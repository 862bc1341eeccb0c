"""docs/architecture.md's module table keeps in step with the files under ckpt_core/: every module is
named by a row (itself, or the directory it lies in), and every name a row gives exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "ckpt_core"
ROW = re.compile(r"^\| (`[^|]+`) \|")   # a row of the module table: | `module`, `module` | seam | notes |
NAME = re.compile(r"`([A-Za-z0-9_/.]+(?:\.py|/))`")


def table_names() -> set[str]:
    names = set()
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            names.update(NAME.findall(m.group(1)))
    return names


def modules() -> set[str]:
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def covered(module: str, names: set[str]) -> bool:
    parts = module.split("/")
    return module in names or any("/".join(parts[:i]) + "/" in names for i in range(1, len(parts)))


def test_the_table_was_found():
    assert len(table_names()) >= 30, f"no module table found in {DOC} (row pattern out of date?)"


def test_every_module_under_ckpt_core_has_a_row():
    names = table_names()
    missing = sorted(m for m in modules() if not covered(m, names))
    assert missing == [], f"docs/architecture.md's module table lacks {missing}"


def test_every_row_names_a_module_or_directory_that_exists():
    gone = sorted(n for n in table_names() if not (PACKAGE / n).exists())
    assert gone == [], f"docs/architecture.md's module table names what is not under ckpt_core/: {gone}"


def test_the_tree_lists_every_subpackage():
    text = DOC.read_text()
    tree = text[text.index("```\nckpt_core/"): text.index("```", text.index("```\nckpt_core/") + 3)]
    listed = set(re.findall(r"^  ([a-z_0-9]+)/", tree, re.M))
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert listed == subpackages, f"the tree lists {sorted(listed)}, ckpt_core has {sorted(subpackages)}"
