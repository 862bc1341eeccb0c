"""The docs link where they say: every relative link of README.md and docs/*.md leads to a file that
exists and, with a #fragment, to a heading of that file (GitHub's anchors); docs/index.md reaches
every page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces -> '-'; repeats
    get -1, -2, ... (headings inside code blocks are not headings)."""
    out, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_exists(page):
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_the_index_reaches_every_page_of_docs():
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall((ROOT / "docs" / "index.md").read_text())}
    missing = {p.name for p in (ROOT / "docs").glob("*.md")} - linked - {"index.md"}
    assert not missing, f"docs/index.md does not link {sorted(missing)}"
